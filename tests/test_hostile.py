"""Hostile peers against live swarms: a writer without any member's key attacks the DHT of a
training swarm (both discovery backends), and the swarm trains on with its full group."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from swarmgrad.node.runspec import RunSpec
from swarmgrad.simulations.swarm import simulate

pytestmark = pytest.mark.slow

FORGER = Path(__file__).with_name("dht_forger.py")
JOINER = """\
[[event]]
at_epoch = {epoch}
action = "start"
node = 3
"""


def _status(path: Path) -> dict[str, Any]:
    try:
        status: dict[str, Any] = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or being replaced
        return {}
    return status


def _wait_epoch(out: Path, epoch: int, runner: threading.Thread, seconds: float) -> int:
    """Wait until every first node reports ``epoch``; the swarm's epoch then."""
    deadline = time.monotonic() + seconds
    while True:
        epochs = [_status(out / f"node-{i}.json").get("epoch", -1) for i in range(3)]
        if min(epochs) >= epoch:
            return max(epochs)
        assert runner.is_alive(), "the swarm stopped before the attack"
        assert time.monotonic() < deadline, f"epochs {epochs} after {seconds} s"
        time.sleep(0.2)


@pytest.mark.parametrize("backend", ["hivemind", "libp2p"])
def test_dht_forgeries_leave_the_swarm_training_with_its_full_group(
    tmp_path: Path, backend: str
) -> None:
    # Before: an altered record with a later expiry hid its node, a forged leave erased one,
    # a plain value over the spec entry made a joiner exit 3, and plain values over the next
    # round keys froze matchmaking. Now every DHT node refuses each of them.
    rounds, attack_at, join_at = 10, 2, 5
    out = tmp_path / "sim"
    churn = tmp_path / "churn.toml"
    churn.write_text(JOINER.format(epoch=join_at))
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["summary"] = simulate(
                nodes=3,
                rounds=rounds,
                spec_path=None,
                profile_path=None,
                out_dir=out,
                churn_path=churn,
                discovery=backend,
                timeout_seconds=400,
            )
        except Exception as error:  # reported by the assertion below
            result["error"] = error

    runner = threading.Thread(target=run)
    runner.start()
    try:
        epoch = _wait_epoch(out, attack_at, runner, 240)
        spec = RunSpec.load(out / "run.toml")
        if backend == "hivemind":
            maddrs = json.loads((out / "bootstrap.json").read_text())["maddrs"]
        else:  # every node's sidecar: the forger writes to each replica itself
            logs = [(out / f"node-{i}.log").read_text() for i in range(3)]
            maddrs = [re.search(r"DHT \(libp2p\) (\S+)", text)[1] for text in logs]  # type: ignore[index]
        forged = subprocess.run(
            [
                sys.executable,
                str(FORGER),
                backend,
                *maddrs,
                "--run",
                spec.run.id,
                "--spec",
                spec.hash.hex(),
                "--epoch",
                str(epoch),
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        attacked_at = max(_status(out / f"node-{i}.json").get("epoch", 0) for i in range(3))
    finally:
        runner.join(timeout=500)
    assert forged.returncode == 0, forged.stderr[-3000:]
    report = json.loads(forged.stdout.strip().splitlines()[-1])
    assert len(report["members"]) == 3, report
    assert set(report["accepted"].values()) == {0}, report["accepted"]
    assert report["seen_after"] == report["members"], report

    assert "error" not in result, result.get("error")
    summary = result["summary"]
    peers = summary["peers"]
    # The joiner (started after the attack, spec entry "overwritten") joined and caught up.
    assert [p["epoch"] for p in peers] == [rounds] * 4
    assert summary["replicas_identical"], [p["checksum"] for p in peers]
    for i in range(3):
        history = _status(out / f"node-{i}.json")["history"]
        after = [h for h in history if h["epoch"] > attacked_at + 1]
        full = [h for h in after if h["outcome"] == "averaged" and h["group_size"] >= 3]
        assert len(full) >= len(after) - 1, [
            (h["epoch"], h["outcome"], h["group_size"]) for h in after
        ]
        assert after, history
