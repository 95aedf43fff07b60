"""Hostile DHT writers against live swarms: a writer without any member's key forges, erases and
overwrites the records of a training swarm (both discovery backends), and the swarm trains on with
its full group, a joiner included."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from swarmgrad.node.runspec import RunSpec
from swarmgrad.simulations.swarm import SimulationConfig, simulate
from tests.helpers import wait_until

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


def _tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.exists() else ""


def _wait_epoch(out: Path, epoch: int, runner: threading.Thread, seconds: float) -> int:
    """Wait until every first node reports ``epoch``; the swarm's epoch then."""

    def reached() -> int:
        epochs = [_status(out / f"node-{i}.json").get("epoch", -1) for i in range(3)]
        return max(epochs) if min(epochs) >= epoch else 0

    def running() -> None:
        assert runner.is_alive(), "the swarm stopped before the attack"

    return wait_until(
        reached,
        timeout_seconds=seconds,
        what=f"all at epoch {epoch}",
        check=running,
        interval_seconds=0.2,
    )


def _forger_targets(out: Path, backend: str, runner: threading.Thread) -> list[str]:
    """Where the forger writes: the bootstrap (hivemind), or every first node's sidecar (libp2p:
    the forger writes to each replica itself); [] until they are all known."""
    assert runner.is_alive(), "the swarm stopped before the attack"
    if not (out / "run.toml").exists():
        return []
    if backend == "hivemind":
        boot = out / "bootstrap.json"
        return list(json.loads(boot.read_text())["maddrs"]) if boot.exists() else []
    logs = [out / f"node-{i}.log" for i in range(3)]
    found = [re.search(r"DHT \(libp2p\) (\S+)", p.read_text()) if p.exists() else None
             for p in logs]  # fmt: skip
    return [m[1] for m in found if m] if all(found) else []


@pytest.mark.timeout(300)  # ~95 s on a 2-core machine: room for a slower one
@pytest.mark.parametrize("backend", ["hivemind", "libp2p"])
def test_dht_forgeries_leave_the_swarm_training_with_its_full_group(
    tmp_path: Path, backend: str
) -> None:
    # Before: an altered record with a later expiry hid its node, a forged leave erased one,
    # a plain value over the spec entry made a joiner exit 3, and plain values over the next
    # round keys froze matchmaking. Now every DHT node refuses each of them.
    rounds, attack_at, join_at = 12, 2, 5
    out = tmp_path / "sim"
    churn = tmp_path / "churn.toml"
    churn.write_text(JOINER.format(epoch=join_at))
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["summary"] = simulate(
                SimulationConfig(
                    nodes=3,
                    rounds=rounds,
                    spec_path=None,
                    profile_path=None,
                    out_dir=out,
                    churn_path=churn,
                    discovery=backend,
                    timeout_seconds=400,
                )
            )
        except Exception as error:  # reported by the assertion below
            result["error"] = error

    runner = threading.Thread(target=run)
    runner.start()
    forger: subprocess.Popen[str] | None = None
    forged = tmp_path / "forger.out"
    try:
        # The forger starts as soon as it can reach the DHT, while the nodes start, and strikes
        # at ``attack_at``: its own start-up (an interpreter, a DHT join; 20 s and more on a
        # loaded machine) must not push the attack towards the run's end (CI: it landed after
        # the last round but one, leaving no round to judge).
        maddrs = wait_until(
            lambda: _forger_targets(out, backend, runner), timeout_seconds=240,
            what="the DHT addresses the forger writes to",
        )  # fmt: skip
        spec = RunSpec.load(out / "run.toml")
        with forged.open("w") as stdout, (tmp_path / "forger.log").open("w") as stderr:
            forger = subprocess.Popen(
                [
                    sys.executable,
                    str(FORGER),
                    backend,
                    *maddrs,
                    "--run",
                    spec.run.id,
                    "--spec",
                    spec.hash.hex(),
                ],
                stdin=subprocess.PIPE,
                stdout=stdout,
                stderr=stderr,
                text=True,
            )

        def alive() -> None:
            assert forger is not None
            assert forger.poll() is None, _tail(tmp_path / "forger.log")

        wait_until(
            lambda: forged.read_text().startswith("ready\n"),
            timeout_seconds=120,
            what="the forger joined",
            check=alive,
        )
        epoch = _wait_epoch(out, attack_at, runner, 240)
        assert forger.stdin is not None
        forger.stdin.write(f"{epoch}\n")
        forger.stdin.close()
        forger.wait(timeout=180)
        attacked_at = max(_status(out / f"node-{i}.json").get("epoch", 0) for i in range(3))
    finally:
        if forger is not None and forger.poll() is None:
            forger.kill()
            forger.wait()
        runner.join(timeout=500)
    assert forger.returncode == 0, _tail(tmp_path / "forger.log")
    report = json.loads(forged.read_text().strip().splitlines()[-1])
    assert set(report["accepted"].values()) == {0}, report["accepted"]
    # Every member's genuine record is still there; the only one beside them is the joiner's,
    # if it started before the attack's last read (a loaded machine) and not the forger's own.
    assert set(report["members"]) <= set(report["seen_after"]), report

    assert "error" not in result, result.get("error")
    summary = result["summary"]
    peers = summary["peers"]
    # The joiner (started after the attack, spec entry "overwritten") joined and caught up.
    assert [p["epoch"] for p in peers] == [rounds] * 4
    # The forger read every member's genuine record before it struck: the three nodes', and the
    # joiner's where that had started first (on a busy machine the forger, a fresh interpreter
    # joining the DHT, can come up after epoch 5).
    first, joiner = {p["peer_id"] for p in peers[:3]}, peers[3]["peer_id"]
    assert first <= set(report["members"]) <= first | {joiner}, report
    assert set(report["seen_after"]) <= {p["peer_id"] for p in peers}, report
    assert summary["replicas_identical"], [p["checksum"] for p in peers]
    for i in range(3):
        history = _status(out / f"node-{i}.json")["history"]
        after = [h for h in history if h["epoch"] > attacked_at + 1]
        full = [h for h in after if h["outcome"] == "averaged" and h["group_size"] >= 3]
        # Before the fix: epochs frozen, dozens of "no group" rounds. Now at most one round
        # is lost, to the joiner: its record can reach one peer's last read and not another's
        # (they form different groups: aborted, then a short "no group" before that peer
        # catches up by state sync, which is a recovery, not a loss).
        lost = [h for h in after if h not in full and h["outcome"] != "resynced"]
        assert len(lost) <= 2, [(h["epoch"], h["outcome"], h["group_size"]) for h in after]
        assert after, history
