"""A volunteer's node that crashes keeps its work: it checkpoints mid-round
(``checkpoint_every_seconds``), and when it is killed just after such a checkpoint and restarted,
it resumes the unaveraged training the checkpoint holds and sends it in its next round (on top of
the swarm's state if the swarm moved on meanwhile: ``algorithm.carry_epochs``). Real node
processes, a real SIGKILL; the replicas end identical."""

from __future__ import annotations

import json
import re
from pathlib import Path

from swarmgrad.node.state.checkpoint import read
from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate
from tests.helpers import light

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
"""


def test_a_restarted_node_sends_the_training_its_checkpoint_kept(tmp_path: Path) -> None:
    rounds = 6
    spec_path = tmp_path / "run.toml"
    # Windows of 3 s, a checkpoint once 2 s of training are at risk (none at rounds): the kill
    # lands two thirds into a round, just after one was written.
    spec_path.write_text(
        light(DEMO_SPEC).replace("[averaging]", "round_seconds = 3.0\n\n[averaging]")
        + "\n[node]\ncheckpoint_every_rounds = 1000\ncheckpoint_every_seconds = 2\n"
    )
    schedule = tmp_path / "churn.toml"
    schedule.write_text(SCHEDULE)
    out = tmp_path / "sim"
    summary = simulate(
        SimulationConfig(
            nodes=3, rounds=rounds, spec_path=spec_path, churn_path=schedule, out_dir=out, seed=4
        )
    )
    assert len(summary["churn"]["events"]) == 2
    assert [p["epoch"] for p in summary["peers"]] == [rounds] * 3
    assert summary["replicas_identical"], [p["checksum"] for p in summary["peers"]]

    # The restart resumed from the checkpoint written mid-round, which held training that no
    # round had averaged yet.
    text = (out / "node-1.log").read_text()
    resumed = re.search(
        r"resumed from (\S+) \(epoch (\d+)\), with (\d+) samples trained since its last round",
        text,
    )
    assert resumed, text[-3000:]
    kept = int(resumed[3])
    assert kept > 0, resumed[0]

    # ... and the restarted process's first round sent it: its contribution weighed at least
    # the samples the checkpoint kept (plus what it trained since), whether the swarm had
    # waited at that epoch or moved on (a resync that carried it, not one that dropped it).
    after = text[resumed.end() :]
    assert "dropped" not in after, after[:3000]
    history = json.loads((out / "node-1.json").read_text())["history"]
    first = next(h for h in history if h["outcome"] in ("averaged", "partial"))
    assert first["sent_samples"] >= kept, (kept, history)


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
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(
        light(DEMO_SPEC).replace(
            "matchmaking_timeout_seconds = 20.0",
            "matchmaking_timeout_seconds = 20.0\nround_timeout_seconds = 120.0\n"
            "sender_timeout_seconds = 30.0\nreducer_timeout_seconds = 60.0",
        )
    )
    schedule = tmp_path / "churn.toml"
    schedule.write_text(KILL_MID_ROUND)
    out = tmp_path / "sim"
    rounds = 5
    summary = simulate(
        SimulationConfig(
            nodes=4, rounds=rounds, spec_path=spec_path, churn_path=schedule, out_dir=out, seed=2
        )
    )
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


KILL_IN_ROUND_AFTER_CHECKPOINT = """\
[[event]]
at_epoch = 2
action = "kill"
node = 1
during = "round"

[[event]]
at_epoch = 2
action = "start"
node = 1
"""


def test_training_a_node_died_sending_is_not_sent_twice(tmp_path: Path) -> None:
    """Killed in a round after a mid-round checkpoint: the training that checkpoint holds may
    have reached the survivors' round already (the parts it delivered), so the restart, which
    finds the swarm past that round, counts it as sent instead of carrying it into its next
    round (it would weigh twice in the model). What it trains after the restart it sends."""
    rounds = 5
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(
        light(DEMO_SPEC).replace("[averaging]", "round_seconds = 3.0\n\n[averaging]")
        + "\n[node]\ncheckpoint_every_rounds = 1000\ncheckpoint_every_seconds = 1\n"
        + "keep_checkpoints = 1000\n"
    )
    schedule = tmp_path / "churn.toml"
    schedule.write_text(KILL_IN_ROUND_AFTER_CHECKPOINT)
    out = tmp_path / "sim"
    summary = simulate(
        SimulationConfig(
            nodes=3, rounds=rounds, spec_path=spec_path, churn_path=schedule, out_dir=out, seed=6
        )
    )
    assert [p["epoch"] for p in summary["peers"]] == [rounds] * 3
    assert summary["replicas_identical"], [p["checksum"] for p in summary["peers"]]
    text = (out / "node-1.log").read_text()
    resumed = re.search(r"resumed from (\S+) \(epoch (\d+)\), with (\d+) samples", text)
    assert resumed, text[-3000:]
    assert int(resumed[3]) > 0  # the checkpoint held training of the round it died in
    after = text[resumed.end() :]
    assert "a round started after that checkpoint" in after, after[:3000]
    # The survivors finished that round (it was theirs to finish): the restart found the
    # swarm past it and kept none of the checkpoint's training.
    assert re.search(
        r"resynced from \d+ donor\(s\): epoch 2 -> \d+, carried 0 local samples", after
    )
    restored = read(Path(resumed[1]))
    since = int(restored.meta["progress"]["samples"])  # its lifetime count at the checkpoint
    history = json.loads((out / "node-1.json").read_text())["history"]
    first = next(h for h in history if h["outcome"] in ("averaged", "partial"))
    assert first["sent_samples"] == first["samples"] - since, (since, history)
