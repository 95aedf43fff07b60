"""``swarmgrad doctor`` names what stops this machine from running a node of a run: a taken
port, a device it does not have, a run it cannot reach; and passes on a machine that can. (From
a ticket, on a live run: tests/integration/test_ticket_join.py.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from swarmgrad.simulations.swarm import DEMO_SPEC
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

NOBODY = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"


def _doctor(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SWARMGRAD_HOME": str(tmp_path / "home")}
    return subprocess.run(
        [sys.executable, "-m", "swarmgrad.node.cli", "doctor", *args],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip


def _lines(out: str) -> dict[str, str]:
    """Each check's line, by its name."""
    return {line.split()[1]: line for line in out.splitlines() if line[:4] in ("OK  ", "FAIL")}


def test_doctor_names_a_taken_port_a_missing_device_and_an_unreachable_run(
    tmp_path: Path,
) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(DEMO_SPEC)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        done = _doctor(tmp_path, str(spec), "--port", port, "--bootstrap", NOBODY,
                       "--device", "cuda", "--timeout", "90")  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr[-2000:]
    lines = _lines(done.stdout)
    assert lines["grpc"].startswith("FAIL")
    assert f"127.0.0.1:{port} is in use" in lines["grpc"]
    assert lines["run"].startswith("FAIL")
    assert "nobody listens at 127.0.0.1:9" in lines["run"]
    import torch

    if not torch.cuda.is_available():
        assert lines["device"].startswith("FAIL")
        assert "sees no CUDA device" in lines["device"]
    for ok in ("python", "memory", "disk"):
        assert lines[ok].startswith("OK"), lines[ok]
    assert "problem(s): " in done.stdout


def test_doctor_passes_on_a_machine_that_can_join_the_run(tmp_path: Path) -> None:
    maddrs = tmp_path / "boot.json"
    boot = subprocess.Popen(
        [sys.executable, "-m", "swarmgrad.node.cli", "bootstrap", "--maddrs-file", str(maddrs),
         "--identity", str(tmp_path / "boot.key")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(maddrs.exists, timeout_seconds=90, what="the bootstrap's multiaddrs")
        (maddr,) = json.loads(maddrs.read_text())["maddrs"][:1]
        spec = tmp_path / "run.toml"
        spec.write_text(DEMO_SPEC)
        done = _doctor(tmp_path, str(spec), "--bootstrap", maddr, "--device", "cpu")
    finally:
        boot.send_signal(signal.SIGINT)
        boot.wait(timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    lines = _lines(done.stdout)
    assert set(lines) == {"python", "device", "grpc", "memory", "disk", "run", "clock", "reach"}
    assert "the DHT answers, 0 peer(s) listed" in lines["run"]
    assert "no peers' records to compare this clock with" in lines["clock"]
    assert "no reachable peer of the run to ask" in lines["reach"]
    assert done.stdout.rstrip().endswith("all checks passed")
