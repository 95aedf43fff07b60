"""A volunteer's node that crashes keeps its work, once: it checkpoints mid-round
(``checkpoint_every_seconds``); killed just after such a checkpoint and restarted, it resumes the
unaveraged training the checkpoint holds and sends it in its next round (on top of the swarm's
state if the swarm moved on meanwhile: ``algorithm.carry_epochs``); killed in the round after
such a checkpoint, which may have delivered part of that training, it does not send it again.
And the survivors of a member killed mid-round drop it in about a second. Real node processes, a
real SIGKILL; the replicas end identical."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from swarmgrad.node.state.checkpoint import read
from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate
from tests.helpers import light

# Node 1 dies just after a mid-round checkpoint; node 2 dies in the round after one. Each is
# restarted at once.
SCHEDULE = """\
[[event]]
at_epoch = 2
action = "kill"
node = 1
during = "checkpoint"

[[event]]
at_epoch = 2
action = "start"
node = 1

[[event]]
at_epoch = 4
action = "kill"
node = 2
during = "round"

[[event]]
at_epoch = 4
action = "start"
node = 2
"""
RESUMED = r"resumed from (\S+) \(epoch (\d+)\), with (\d+) samples trained since its last round"


def _first_round(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The first round a (restarted) node's contribution went into."""
    return next(h for h in history if h["outcome"] in ("averaged", "partial"))


def test_a_restarted_node_sends_the_training_its_checkpoint_kept_and_only_once(
    tmp_path: Path,
) -> None:
    rounds = 10  # node 2 restarts at epoch 4 and needs a few slots to come to a round
    spec_path = tmp_path / "run.toml"
    # Windows of 3 s, a checkpoint once a second of training is at risk (none at rounds; all
    # kept, to read the one a node resumed from).
    spec_path.write_text(
        light(DEMO_SPEC).replace("[averaging]", "round_seconds = 3.0\n\n[averaging]")
        + "\n[node]\ncheckpoint_every_rounds = 1000\ncheckpoint_every_seconds = 1\n"
        + "keep_checkpoints = 1000\n"
    )
    schedule = tmp_path / "churn.toml"
    schedule.write_text(SCHEDULE)
    out = tmp_path / "sim"
    summary = simulate(
        SimulationConfig(
            nodes=3, rounds=rounds, spec_path=spec_path, churn_path=schedule, out_dir=out, seed=4
        )
    )
    assert len(summary["churn"]["events"]) == 4
    assert [p["epoch"] for p in summary["peers"]] == [rounds] * 3
    assert summary["replicas_identical"], [p["checksum"] for p in summary["peers"]]

    # Node 1 resumed from the checkpoint written mid-round, which held training that no round
    # had averaged yet; its restarted process's first round sent it: its contribution weighed
    # at least that (plus what it trained since), whether the swarm had waited at that epoch
    # or moved on (a resync that carried it, not one that dropped it).
    text = (out / "node-1.log").read_text()
    resumed = re.search(RESUMED, text)
    assert resumed, text[-3000:]
    kept = int(resumed[3])
    assert kept > 0, resumed[0]
    after = text[resumed.end() :]
    assert "dropped" not in after, after[:3000]
    first = _first_round(json.loads((out / "node-1.json").read_text())["history"])
    assert first["sent_samples"] >= kept, (kept, first)

    # Node 2 died in the round after its checkpoint: that round may hold the checkpoint's
    # training already. The survivors finished it (it was theirs to finish), so the restart
    # found the swarm past it and counted that training as sent: it carried none of it (or,
    # on a loaded machine, came back more than carry_epochs behind and dropped it as stale);
    # its first round sent only what it trained after the restart.
    text = (out / "node-2.log").read_text()
    resumed = re.search(RESUMED, text)
    assert resumed, text[-3000:]
    assert int(resumed[3]) > 0  # the checkpoint held training of the round it died in
    after = text[resumed.end() :]
    assert "a round started after that checkpoint" in after, after[:3000]
    assert re.search(
        r"resynced from \d+ donor\(s\): epoch \d+ -> \d+, (carried 0|dropped \d+) local samples",
        after,
    )
    since = int(read(Path(resumed[1])).meta["progress"]["samples"])  # its count at the checkpoint
    first = _first_round(json.loads((out / "node-2.json").read_text())["history"])
    assert first["sent_samples"] == first["samples"] - since, (since, first)


def _churned_swarm(tmp_path: Path, schedule: str, rounds: int) -> dict[str, Any]:
    """4 nodes for ``rounds`` rounds with churn ``schedule``, their timeouts long (sender 30 s,
    reducer 60 s, round 120 s) so that a peer dropped by them shows; out in ``tmp_path/sim``."""
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(
        light(DEMO_SPEC).replace(
            "matchmaking_timeout_seconds = 20.0",
            "matchmaking_timeout_seconds = 20.0\nround_timeout_seconds = 120.0\n"
            "sender_timeout_seconds = 30.0\nreducer_timeout_seconds = 60.0",
        )
    )
    churn = tmp_path / "churn.toml"
    churn.write_text(schedule)
    config = SimulationConfig(
        nodes=4, rounds=rounds, spec_path=spec_path, churn_path=churn, out_dir=tmp_path / "sim",
        seed=2,
    )  # fmt: skip
    return simulate(config)


FREEZE_MID_ROUND = """\
[[event]]
at_epoch = 2
action = "pause"
node = 1
during = "round"

[[event]]
at_epoch = 4
action = "resume"
node = 1
"""


def test_a_member_frozen_mid_round_is_dropped_in_seconds_not_by_its_timeouts(
    tmp_path: Path,
) -> None:
    """A frozen process (SIGSTOP: a laptop gone to sleep, a link that drops every packet)
    neither answers nor resets its connections. The survivors ask it whether it is there once
    its results are late and drop it from the round when it leaves two questions unanswered
    (2 s quiet + 2 x 2 s), not after the sender timeout (30 s here) or the reducer timeout
    (60 s). Resumed, it ends its round at once, not at its sender timeout, catches up, and
    every replica ends identical. Where the freeze came before the survivors' streams reached
    it (3 of the 4 runs looked at), its part waits for them: it asks, and hears they have left
    that round (``quiet.py``; the rule alone: test_quiet_peers). Where they had delivered, its
    part is complete and there is nothing to wait for. Where the freeze came once its own part
    had gone out (a round's all-reduce takes ~0.1 s here, the freeze a poll of its log after
    the round began: one CI run of five, 2026-12-01), nothing of that round waits for it, and
    the next round's matchmaking asks it whether it is there and does not wait for it either."""
    out, rounds = tmp_path / "sim", 6
    summary = _churned_swarm(tmp_path, FREEZE_MID_ROUND, rounds)
    paused, resumed = summary["churn"]["events"]
    assert [paused["event"], resumed["event"]] == [
        "epoch 2: pause node 1 during its round",
        "epoch 4: resume node 1",
    ]
    history = json.loads((out / "node-1.json").read_text())["history"]
    own = [h for h in history if h["outcome"] != "resynced"][2]  # the round it froze in
    after_resume = own["round_seconds"] - (resumed["time"] - paused["time"])
    assert after_resume < 8.0, (after_resume, history)  # not at its 30 s sender timeout
    assert [p["epoch"] for p in summary["peers"]] == [rounds] * 4
    assert summary["replicas_identical"], [p["checksum"] for p in summary["peers"]]
    delivered = True  # its part of round 2 had reached every survivor before the freeze
    for i in (0, 2, 3):
        history = {
            h["epoch"]: h for h in json.loads((out / f"node-{i}.json").read_text())["history"]
        }
        frozen = history[3]  # the round node 1 froze in (round 2)
        assert frozen["outcome"] in ("averaged", "partial"), history
        delivered &= frozen["outcome"] == "averaged" and frozen["group_size"] == 4
        for epoch in (3, 4):  # that round and the next, each without its timeouts (30 s)
            assert history[epoch]["round_seconds"] < 15, (i, history)
    log = "\n".join((out / f"node-{i}.log").read_text() for i in (0, 2, 3))
    if delivered:
        # Frozen once its part had gone out (the docstring's last case): round 3 drops it.
        assert re.search(r"round 3: \S+ does not answer at \S+; not waiting for it", log), log
    else:
        assert "answered none of 2 liveness probes" in log


KILL_MID_ROUND = """\
[[event]]
at_epoch = 2
action = "kill"
node = 1
during = "round"
"""


def test_a_member_killed_mid_round_is_dropped_in_seconds_not_by_its_timeouts(
    tmp_path: Path,
) -> None:
    """A crashed process's connections reset: the survivors drop it from the round it died in
    as soon as a call to it fails, not after the sender timeout (30 s here), and the next
    round's matchmaking asks it whether it is there instead of waiting out its timeout (20 s
    here). Measured on 2 cores (3 runs): the round of the kill 0.8-1.4 s, the next 1.8-2.1 s."""
    out, rounds = tmp_path / "sim", 5
    summary = _churned_swarm(tmp_path, KILL_MID_ROUND, rounds)
    assert summary["churn"]["finished"] == ["node-0", "node-2", "node-3"]
    assert [p["epoch"] for p in summary["peers"]] == [rounds] * 3
    assert summary["replicas_identical"], [p["checksum"] for p in summary["peers"]]
    for i in (0, 2, 3):
        history = json.loads((out / f"node-{i}.json").read_text())["history"]
        by_epoch = {h["epoch"]: h for h in history}
        # The round it died in: its part is missing (partial) or it had sent everything.
        killed, after = by_epoch[3], by_epoch[4]
        assert killed["outcome"] in ("averaged", "partial"), history
        assert killed["round_seconds"] < 10, (i, history)  # not its 30 s sender timeout
        assert (after["outcome"], after["group_size"]) == ("averaged", 3), history
        assert after["round_seconds"] < 10, (i, history)  # not the 20 s matchmaking timeout
