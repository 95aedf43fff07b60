"""Each node process on a CPU share of its own (a profile's ``cpu_cores``): a cgroup with a CPU
quota per node, so N nodes on a small machine each run as on a machine of that many cores,
instead of taking CPU from one another as the scheduler happens to hand it out.

A node's cgroup holds the node and what it starts (its DHT process): a child joins its parent's
cgroup. The quota is CFS bandwidth control: ``cores`` x the period of CPU time per period, on
cgroup v1 (``cpu.cfs_quota_us``) or v2 (``cpu.max``). It needs root (or a delegated subtree);
without it, ``simulate`` says so rather than run the nodes unshared. The groups are removed when
the simulation ends (after its processes stopped).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from swarmgrad.simulations.profiles import SimulationError

#: CFS bandwidth period: the quota is granted per this many microseconds (the kernel's default).
PERIOD_US = 100_000


def _cpu_hierarchy() -> tuple[Path, int]:
    """Where this machine's cgroup CPU controller is mounted, and its cgroup version."""
    v1 = v2 = None
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError as error:
        raise SimulationError(f"cpu_cores: cannot read the mounts ({error})") from None
    for line in mounts:
        fields = line.split()
        if len(fields) < 4:
            continue
        where, kind, options = fields[1], fields[2], fields[3].split(",")
        if kind == "cgroup" and "cpu" in options and v1 is None:
            v1 = Path(where)
        elif kind == "cgroup2" and v2 is None:
            controllers = Path(where) / "cgroup.controllers"
            with contextlib.suppress(OSError):
                if "cpu" in controllers.read_text().split():
                    v2 = Path(where)
    if v1 is not None:
        return v1, 1
    if v2 is not None:
        return v2, 2
    raise SimulationError(
        "cpu_cores needs the cgroup CPU controller (cgroup v1 'cpu' or v2 with 'cpu' enabled); "
        "this machine has neither mounted"
    )


class CpuShares:
    """One cgroup per node under a group of this simulation's own."""

    def __init__(self) -> None:
        root, self.version = _cpu_hierarchy()
        self.base = root / f"swarmgrad-{os.getpid()}"
        try:
            self.base.mkdir(exist_ok=True)
            if self.version == 2:  # the nodes' groups under it get the cpu controller
                (self.base / "cgroup.subtree_control").write_text("+cpu")
        except OSError as error:
            raise SimulationError(
                f"cpu_cores: cannot create a cgroup under {root} ({error.strerror}); it needs "
                "root or a delegated cgroup subtree"
            ) from None
        self._groups: list[Path] = []

    def group(self, name: str, cores: float) -> Path:
        """The ``cgroup.procs`` file of a group limited to ``cores`` CPUs (created once; a
        restarted node joins the same one). A process writes its pid there to join it."""
        group = self.base / name
        quota = max(1000, round(cores * PERIOD_US))  # the kernel's floor is 1 ms
        try:
            group.mkdir(exist_ok=True)
            if self.version == 1:
                (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        except OSError as error:
            raise SimulationError(f"cpu_cores: cannot set {group}'s quota ({error})") from None
        if group not in self._groups:
            self._groups.append(group)
        return group / "cgroup.procs"

    def throttled(self) -> dict[str, float]:
        """Per group, the share of the quota's periods in which it was throttled (it had work
        left when its quota ran out): near 1, the node wanted more CPU all along."""
        shares = {}
        for group in self._groups:
            with contextlib.suppress(OSError, ValueError):
                stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
                periods = int(stat["nr_periods"])
                if periods:
                    shares[group.name] = int(stat["nr_throttled"]) / periods
        return shares

    def close(self) -> None:
        """Remove the groups (their processes gone: what is still in one is moved out)."""
        parent = self.base.parent / "cgroup.procs"
        for group in [*self._groups, self.base]:
            with contextlib.suppress(OSError):
                for pid in (group / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        parent.write_text(pid)
            with contextlib.suppress(OSError):
                group.rmdir()


@contextlib.contextmanager
def cpu_shares() -> Iterator[CpuShares]:
    shares = CpuShares()
    try:
        yield shares
    finally:
        shares.close()


def join(procs: str) -> None:
    """Put the calling process in the cgroup of ``procs`` (a ``cgroup.procs`` file): run in a
    node's process before it starts, so all it starts is in the group too."""
    with open(procs, "w") as f:
        f.write(str(os.getpid()))
