"""Overlapped rounds in a real swarm: node processes that average while they train end with
identical global parameters and a falling loss, also when a member is killed mid-round; and
rounds of one fragment of the model at a time. (``light`` specs: what is tested is the rounds,
not the model.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

from swarmgrad.node.runspec import RunSpec
from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate
from tests.helpers import light

KILL = """\
[[event]]
at_epoch = 2
action = "kill"
node = 3
during = "round"
"""


def test_an_overlapped_swarm_stays_identical_and_survives_a_kill_mid_round(
    tmp_path: Path,
) -> None:
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(
        light(DEMO_SPEC)
        .replace("outer_momentum = 0.0", "outer_momentum = 0.0\noverlap = true")
        .replace(
            "matchmaking_timeout_seconds = 20.0",
            "matchmaking_timeout_seconds = 10.0\n"
            "sender_timeout_seconds = 5.0\nreducer_timeout_seconds = 10.0",
        )
    )
    assert RunSpec.load(spec_path).algorithm.overlap
    churn = tmp_path / "churn.toml"
    churn.write_text(KILL)
    out = tmp_path / "sim"
    summary = simulate(
        SimulationConfig(
            nodes=4,
            rounds=5,
            spec_path=spec_path,
            profile_path=None,
            out_dir=out,
            churn_path=churn,
        )
    )
    assert sorted(summary["churn"]["finished"]) == ["node-0", "node-1", "node-2"]
    assert summary["replicas_identical"]
    assert [p["epoch"] for p in summary["peers"]] == [5, 5, 5]
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.0
    for i in range(3):
        history = json.loads((out / f"node-{i}.json").read_text())["history"]
        outcomes = [entry["outcome"] for entry in history]
        assert outcomes.count("averaged") >= 3, outcomes  # rounds landed, late by one
    # The round the kill cut short left values unaveraged or went on without the dead member.
    logs = "".join((out / f"node-{i}.log").read_text() for i in range(3))
    assert "node-3" not in summary["churn"]["finished"]
    assert "averaging in a group of 4" in logs


def test_a_swarm_syncing_in_fragments_stays_identical(tmp_path: Path) -> None:
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(
        light(DEMO_SPEC)
        .replace("group_size = 256", "group_size = 2")
        .replace("outer_momentum = 0.0", "outer_momentum = 0.0\noverlap = true\nfragments = 2")
    )
    spec = RunSpec.load(spec_path)
    assert spec.algorithm.fragments == 2
    out = tmp_path / "sim"
    summary = simulate(
        SimulationConfig(nodes=2, rounds=6, spec_path=spec_path, profile_path=None, out_dir=out)
    )
    assert summary["ok"]
    assert summary["replicas_identical"]
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.5
    history = json.loads((out / "node-0.json").read_text())["history"]
    # 6 rounds, then the run's end: the other fragment sends its progress since its last round
    assert [entry["outcome"] for entry in history].count("averaged") == 7
    assert [p["epoch"] for p in summary["peers"]] == [7, 7]


def test_a_node_joining_an_overlapped_run_keeps_its_work(tmp_path: Path) -> None:
    """Node 3 joins at epoch 2 and downloads the state while the swarm's round is in flight.
    Its first round either meets the swarm's (still matchmaking) or, if the swarm has landed
    rounds without it, it takes the swarm's state with its own progress on top and sends that
    progress in the round it starts with the swarm (before: "dropped 320 local samples", its
    first round of work); which one depends on timing (the unit test pins the second). Either
    way no work is dropped and everyone ends at the last epoch, identical."""
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(
        light(DEMO_SPEC)
        .replace("outer_momentum = 0.0", "outer_momentum = 0.0\noverlap = true")
        .replace("inner_steps = 10", "inner_steps = 20")
        .replace("matchmaking_timeout_seconds = 20.0", "matchmaking_timeout_seconds = 12.0")
    )
    churn = tmp_path / "churn.toml"
    churn.write_text('[[event]]\nat_epoch = 2\naction = "start"\nnode = 3\n')
    # The joiner computes 2x slower: by its first boundary the swarm has landed the round that
    # was in flight when it joined (and started the next), so it must take the swarm's state.
    # Later its lateness is its extra compute (seconds, more on a loaded machine): the swarm's
    # wave (the timeout less 2 s) must outlast it, or the joiner is never in a group at all.
    profile = tmp_path / "peers.toml"
    profile.write_text("[[peer]]\n" * 3 + "[[peer]]\nslowdown = 2.0\n")
    out = tmp_path / "sim"
    summary = simulate(
        SimulationConfig(
            nodes=3,
            rounds=8,
            spec_path=spec_path,
            profile_path=profile,
            out_dir=out,
            churn_path=churn,
        )
    )
    assert summary["ok"]
    assert summary["replicas_identical"]
    assert [p["epoch"] for p in summary["peers"]] == [8, 8, 8, 8]
    history = json.loads((out / "node-3.json").read_text())["history"]
    assert "averaged" in [entry["outcome"] for entry in history], history
    log = (out / "node-3.log").read_text()
    assert "resynced from" in log  # it joined by state sync
    assert not re.search(r"dropped [1-9]\d* local samples", log), log
