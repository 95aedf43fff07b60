"""Rounds by time window in real node processes: four nodes, one of them 4x slower and one 2x,
each trains until the same slot boundary of the DHT clock (``algorithm.round_seconds``) and
comes with its own samples, so every round is averaged by all four, none waits for the slowest,
and the replicas end identical."""

from __future__ import annotations

import json
from pathlib import Path

from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate
from tests.helpers import light


def test_a_4x_speed_spread_averages_every_round_with_every_peer(tmp_path: Path) -> None:
    rounds = 5
    spec = tmp_path / "run.toml"
    spec.write_text(light(DEMO_SPEC).replace("[averaging]", "round_seconds = 4.0\n\n[averaging]"))
    profile = tmp_path / "peers.toml"
    profile.write_text("".join(f"[[peer]]\nslowdown = {s}\n" for s in (1.0, 1.0, 2.0, 4.0)))
    out = tmp_path / "sim"
    summary = simulate(
        SimulationConfig(
            nodes=4, rounds=rounds, spec_path=spec, profile_path=profile, out_dir=out, seed=3
        )
    )
    peers = summary["peers"]
    assert [p["epoch"] for p in peers] == [rounds] * 4
    assert summary["replicas_identical"], [p["checksum"] for p in peers]
    seen = {}
    for i in range(4):
        history = json.loads((out / f"node-{i}.json").read_text())["history"]
        # A node up before the others may find nobody at its first slot: it trains on alone
        # (nothing dropped) and meets them at the next one, still at epoch 0 (CI once saw it).
        while history and (history[0]["outcome"], history[0]["epoch"]) == ("no group", 0):
            history.pop(0)
            assert "trained on alone" in (out / f"node-{i}.log").read_text()
        seen[i] = [(h["outcome"], h["group_size"]) for h in history]
    # Every round after the first is averaged by all four. The first is the first slot boundary
    # at least a quarter slot after each node's start: a node that started later than that (the
    # launcher starts them one by one) trains on to the next one, downloads the first round's
    # outcome on the way and carries its training into the second round (nothing dropped).
    late = [i for i in seen if seen[i][0] == ("resynced", 0)]
    assert len(late) <= 2, seen
    for i in seen:
        first, rest = seen[i][0], seen[i][1:]
        if i in late:
            log = (out / f"node-{i}.log").read_text()
            assert "carried" in log, log
            assert "dropped" not in log, log
        else:
            assert first == ("averaged", 4 - len(late)), (i, seen)
        assert rest == [("averaged", 4)] * (rounds - 1), (i, seen)
    # The same seconds of training: the fast nodes trained several times the slowest's steps
    # (4x by their speeds, less what sharing two cores takes from the fast ones).
    samples = [p["samples"] for p in peers]
    assert min(samples[:2]) >= 2.5 * samples[3], samples
