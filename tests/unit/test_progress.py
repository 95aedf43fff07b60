"""What the status file says of a node's rounds: the samples it sent in rounds that averaged are
counted (what ``simulate`` reports as samples kept), and survive a restart with the other
totals."""

from __future__ import annotations

from swarmgrad.node.averaging.rounds import RoundOutcome
from swarmgrad.node.training.progress import Progress
from swarmgrad.node.training.replica import RoundReport


def _round(epoch: int, outcome: RoundOutcome, sent: int) -> RoundReport:
    return RoundReport(epoch=epoch, outcome=outcome, group_size=4, seconds=1.0, sent_samples=sent)


def test_samples_sent_in_averaged_rounds_are_counted_and_kept_over_a_restart() -> None:
    progress = Progress(samples=160)
    progress.take_round(_round(1, RoundOutcome.AVERAGED, 64), val_loss=5.0, peers=4, checksum="a")
    progress.take_round(_round(2, RoundOutcome.NO_GROUP, 0), val_loss=5.0, peers=4, checksum="a")
    progress.take_round(_round(3, RoundOutcome.PARTIAL, 48), val_loss=4.9, peers=4, checksum="b")
    assert progress.samples_averaged == 112
    assert [h["sent_samples"] for h in progress.history] == [64, 0, 48]
    assert progress.outcomes == {"averaged": 1, "no group": 1, "partial": 1}
    assert (progress.epoch, progress.checksum) == (3, "b")

    restarted = Progress()
    restarted.resume_counters(progress.counters())
    assert (restarted.samples, restarted.samples_averaged) == (160, 112)
    older = {k: v for k, v in progress.counters().items() if k != "samples_averaged"}
    restarted.resume_counters(older)  # a checkpoint from before the count was kept
    assert restarted.samples_averaged == 0
