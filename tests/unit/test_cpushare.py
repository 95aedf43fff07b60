"""A profile's ``cpu_cores``: a node process runs in a cgroup of its own whose CPU quota holds it
to that share, whatever else the machine has free; the groups go when the simulation ends."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from swarmgrad.simulations import cpushare
from swarmgrad.simulations.launchers import LocalProcess
from swarmgrad.simulations.profiles import PeerProfile, SimulationError

SPIN = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n"


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_node_on_a_tenth_of_a_core_gets_no_more_and_its_group_is_removed(tmp_path: Path) -> None:
    try:
        shares = cpushare.CpuShares()
    except SimulationError as error:
        pytest.skip(str(error))  # no cgroup CPU controller, or not root
    try:
        procs = shares.group("node-0", 0.1)
        spinner = LocalProcess(
            "spin", [sys.executable, "-c", SPIN], tmp_path / "spin.log", dict(os.environ),
            cgroup=str(procs),
        )  # fmt: skip
        try:
            pid = spinner.popen.pid
            assert str(pid) in procs.read_text().split()  # before it ran anything of its own
            started, used = time.monotonic(), _cpu_seconds(pid)
            time.sleep(2.0)  # the window the share is measured over
            share = (_cpu_seconds(pid) - used) / (time.monotonic() - started)
            # A spinning process takes a whole core when it can: held to a tenth (a loaded
            # machine gives it less, never more; 1.5x for the quota's period edges).
            assert share <= 0.15, share
            # It had work left at the end of its quota's periods (how often depends on what
            # else the machine runs): what the summary reports as cpu_throttled.
            assert 0.0 <= shares.throttled()["node-0"] <= 1.0
        finally:
            spinner.kill()
    finally:
        shares.close()
    assert not shares.base.exists()


def test_a_cpu_share_must_be_positive() -> None:
    with pytest.raises(SimulationError, match="cpu_cores must be positive"):
        PeerProfile(cpu_cores=0)
    assert PeerProfile(slowdown=2.0, cpu_cores=0.5).compute_factor == 4.0
    assert PeerProfile(slowdown=2.0, cpu_cores=4).compute_factor == 2.0  # training: one core
