"""A DiLoCo replica that downloads the swarm's state keeps the progress it has not averaged yet
(``algorithm.carry_epochs``): moved onto the downloaded state, its samples with it, and sent in
the swarm's round of that epoch in the same call, so that its work reaches the next global
model. Too stale (or with ``carry_epochs = 0``) it is dropped, as before. Blocking replicas, each
in its own thread, in the fake group of ``replica_hub``."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from swarmgrad.node.kinds import RoundOutcome
from swarmgrad.node.runspec.algorithm import AlgorithmSection
from swarmgrad.node.state.sync import carries_progress
from swarmgrad.node.training.diloco import DiLoCo
from swarmgrad.node.training.model import flatten
from swarmgrad.node.training.replica import RoundReport
from tests.unit.replica_hub import H, Hub, replicas


@pytest.mark.parametrize(
    ("epoch", "donor_epoch", "limit", "carried"),
    [
        (5, 5, 2, True),  # its group averaged apart at its own epoch: 1 round stale
        (5, 6, 2, True),  # it missed one round: 2 rounds stale
        (5, 7, 2, False),  # 3 rounds stale: dropped
        (5, 7, 3, True),
        (5, 5, 0, False),  # carry_epochs = 0: always dropped
        (0, 40, 2, False),  # a long absence
    ],
)
def test_the_carry_rule(epoch: int, donor_epoch: int, limit: int, carried: bool) -> None:
    assert carries_progress(epoch, donor_epoch, limit) is carried


def left_behind(
    made: list[tuple[torch.nn.Linear, DiLoCo]], donor_epoch: int, carry_epochs: int
) -> torch.Tensor:
    """Every replica finds the swarm at ``donor_epoch`` with a state of its own (theta moved by
    0.5, no momentum); the swarm's theta."""
    theta = made[0][1].outer.theta + 0.5
    state = torch.cat([theta, torch.zeros_like(theta)])
    for _, replica in made:
        swarm = replica.swarm
        swarm.spec = SimpleNamespace(algorithm=AlgorithmSection(carry_epochs=carry_epochs))
        donor = SimpleNamespace(peer_id="donor", epoch=donor_epoch)
        swarm.find_donors = lambda epoch, checksum, donor=donor: (
            [donor] if epoch <= donor.epoch else []
        )
        swarm.download_state = lambda donors, numel: SimpleNamespace(
            epoch=donor_epoch, values=state.clone()
        )
    return theta


def boundary(made: list[tuple[torch.nn.Linear, DiLoCo]]) -> list[RoundReport]:
    """H inner "steps" on each replica in its own thread (a blocking round waits for the
    others); replica i moves its parameters by 0.01 x (i + 1) a step and counts 1 + i samples."""

    def run(i: int) -> Any:
        model, replica = made[i]
        report = None
        for _ in range(H):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * (i + 1))
            report = replica.step(samples=1 + i)
        return report

    with concurrent.futures.ThreadPoolExecutor(len(made)) as pool:
        futures = [pool.submit(run, i) for i in range(len(made))]
        return [f.result(timeout=60) for f in futures]


@pytest.mark.parametrize("donor_epoch", [0, 1])
def test_a_replica_that_resyncs_sends_its_progress_in_the_swarms_round(donor_epoch: int) -> None:
    hub = Hub(members=2)
    made = replicas(hub, 2, overlap=False)
    theta = left_behind(made, donor_epoch, carry_epochs=2)
    reports = boundary(made)
    for report, (_, replica) in zip(reports, made, strict=True):
        assert report.outcome is RoundOutcome.AVERAGED, report
        assert report.after_resync is not None
        assert report.after_resync.outcome is RoundOutcome.RESYNCED
        assert report.after_resync.carried
        assert replica.epoch == donor_epoch + 1  # the swarm's round of that epoch
        assert replica.samples == 0
    assert len({r.outer.checksum() for _, r in made}) == 1  # replicas identical
    # Outer lr 1, no momentum: the new model is the swarm's plus the samples-weighted mean of
    # what each replica trained since its own state.
    progress = torch.tensor([0.01 * (i + 1) * H for i in range(2)])
    weights = torch.tensor([1.0, 2.0]) * H
    expected = theta + float((progress * weights).sum() / weights.sum())
    torch.testing.assert_close(made[0][1].outer.theta, expected)


@pytest.mark.parametrize(("donor_epoch", "carry_epochs"), [(3, 2), (1, 0)])
def test_stale_progress_is_dropped_and_the_replica_waits_for_the_next_round(
    donor_epoch: int, carry_epochs: int
) -> None:
    hub = Hub(members=2)
    made = replicas(hub, 2, overlap=False)
    theta = left_behind(made, donor_epoch, carry_epochs=carry_epochs)
    reports = boundary(made)
    for report, (_, replica) in zip(reports, made, strict=True):
        assert report.outcome is RoundOutcome.RESYNCED
        assert not report.carried
        assert report.after_resync is None
        assert replica.epoch == donor_epoch
        assert replica.samples == 0
        assert torch.equal(flatten(replica.params), theta)
    assert not hub.joined  # nobody started a round


def resumed_in_doubt(hub: Hub, steps: int) -> list[tuple[torch.nn.Linear, DiLoCo]]:
    """Two replicas that trained ``steps`` steps of a round, were checkpointed, and came back
    (fresh replicas loaded from the checkpoints) in doubt: a round started after the
    checkpoint may hold that training (``doubt_progress``). Replica i moved 0.01 x (i + 1) and
    counted 1 + i samples a step."""
    made = replicas(hub, 2, overlap=False)
    for _ in range(steps):
        for i, (model, replica) in enumerate(made):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * (i + 1))
            replica.count(1 + i)
    saved = [replica.state_dict() for _, replica in made]
    back = replicas(hub, 2, overlap=False)
    for (_, replica), (tensors, meta) in zip(back, saved, strict=True):
        replica.load_state_dict(tensors, meta)
        replica.doubt_progress()
    return back


def train_then_round(made: list[tuple[torch.nn.Linear, DiLoCo]]) -> list[RoundReport | None]:
    """H steps on each replica (as ``boundary``), then the round due, whatever the step count
    (a window's end), each in its own thread."""

    def run(i: int) -> RoundReport | None:
        model, replica = made[i]
        for _ in range(H):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * (i + 1))
            replica.count(1 + i)
        return replica.boundary()

    with concurrent.futures.ThreadPoolExecutor(len(made)) as pool:
        futures = [pool.submit(run, i) for i in range(len(made))]
        return [f.result(timeout=60) for f in futures]


def test_training_that_may_have_gone_out_is_not_sent_again_once_the_swarm_is_past_it() -> None:
    # They died in the round of epoch 0, which landed: the swarm is at epoch 1. Their resync
    # keeps only what they trained since the restart; the round sends that alone.
    hub = Hub(members=2)
    made = resumed_in_doubt(hub, steps=2)
    theta = left_behind(made, donor_epoch=1, carry_epochs=2)
    reports = train_then_round(made)
    for i, (report, (_, replica)) in enumerate(zip(reports, made, strict=True)):
        assert report is not None
        assert report.outcome is RoundOutcome.AVERAGED, report
        assert report.after_resync is not None
        assert report.after_resync.carried
        assert report.sent_samples == H * (1 + i)  # not the 2 x (1 + i) resumed
        assert replica.epoch == 2
    assert len({r.outer.checksum() for _, r in made}) == 1
    progress = torch.tensor([0.01 * (i + 1) * H for i in range(2)])
    weights = torch.tensor([1.0, 2.0]) * H
    expected = theta + float((progress * weights).sum() / weights.sum())
    torch.testing.assert_close(made[0][1].outer.theta, expected)


def test_training_in_doubt_goes_with_the_next_round_if_the_swarm_is_not_past_it() -> None:
    # The round they died in did not land: the swarm is still at epoch 0. The training resumed
    # is sent with the next round's, with its samples, once; then nothing is in doubt.
    hub = Hub(members=2)
    made = resumed_in_doubt(hub, steps=2)
    theta = made[0][1].outer.theta.clone()
    for _, replica in made:  # a round still to come: the doubt survives another checkpoint
        _, meta = replica.state_dict()
        assert meta["in_flight"]["epoch"] == 0
        assert replica.rounds_started == 0  # no round of its own pending: blocking rounds
    reports = train_then_round(made)
    for i, (report, (_, replica)) in enumerate(zip(reports, made, strict=True)):
        assert report is not None
        assert report.outcome is RoundOutcome.AVERAGED, report
        assert report.sent_samples == (2 + H) * (1 + i)
        assert replica.epoch == 1
        assert replica.state_dict()[1]["in_flight"] is None
    progress = torch.tensor([0.01 * (i + 1) * (2 + H) for i in range(2)])
    weights = torch.tensor([1.0, 2.0])
    expected = theta + float((progress * weights).sum() / weights.sum())
    torch.testing.assert_close(made[0][1].outer.theta, expected)
