"""The processes of one local simulation (``swarm.py``): its node slots, and the loop that starts
them, fires the churn schedule's events and watches them until every running node has finished."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmgrad.simulations.churn import MARKERS, ChurnEvent
from swarmgrad.simulations.launchers import (
    LocalProcess,
    Process,
    RayProcess,
    stop_all,
)
from swarmgrad.simulations.natlab import Host
from swarmgrad.simulations.netem import Wan
from swarmgrad.simulations.processes import adversary_command, node_command
from swarmgrad.simulations.profiles import SimulationError
from swarmgrad.simulations.summary import loss_mean
from swarmgrad.simulations.swarm_config import SimulationConfig

log = logging.getLogger(__name__)
#: A (re)started node's log line once it takes part at the swarm's epoch.
REJOINED = re.compile(r"epoch \d+: (averaged|partial|resynced)")


def _wait_for_file(path: Path, process: Process, deadline: float) -> dict[str, Any]:
    while time.monotonic() < deadline:
        if path.exists():
            return dict(json.loads(path.read_text()))
        if process.poll() is not None:
            raise SimulationError(f"{process.name} exited early:\n{process.tail()}")
        time.sleep(0.1)
    raise SimulationError(f"{process.name} did not come up in time:\n{process.tail()}")


@dataclass(slots=True)
class SwarmNode:
    """One node slot: an identity, checkpoints and a status file, run by one process at a time."""

    index: int
    args: list[str]
    status: Path
    log: Path
    process: Process | None = None
    running: bool = False  # started and neither finished, stopped nor killed
    finished: bool = False  # reached the last epoch (and was stopped once all had)
    started_at: float = 0.0  # monotonic, of the current process
    log_offset: int = 0  # where the current process's log begins
    rejoin_seconds: list[float] = field(default_factory=list)
    waiting_rejoin: bool = False
    attack: str = ""  # a malicious peer's attack (profiles.py)
    host: Host | None = None  # its namespace, with --netem
    cgroup: str | None = None  # its CPU share's cgroup.procs (a profile's cpu_cores)

    def command(self) -> list[str]:
        if self.attack:
            return adversary_command(self.attack, *self.args)
        return node_command(*self.args)

    def watch_rejoin(self) -> None:
        """From now (a resume, a heal), time how long the node takes to take part again."""
        self.waiting_rejoin = True
        self.started_at, self.log_offset = time.monotonic(), self.log_size()

    def log_size(self) -> int:
        return self.log.stat().st_size if self.log.exists() else 0

    def log_since(self, offset: int | None = None) -> str:
        """The log from ``offset`` (default: the current process's start) on."""
        if not self.log.exists():
            return ""
        with self.log.open("rb") as f:
            f.seek(self.log_offset if offset is None else offset)
            return f.read().decode(errors="replace")

    def status_of(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.status.read_text()))
        except (OSError, ValueError):  # not written yet
            return {}


class SwarmRun:
    """The processes of one simulation, the churn schedule's progress, and the loop that
    watches them until every running node has finished."""

    def __init__(self, config: SimulationConfig, events: list[ChurnEvent]) -> None:
        self.config = config
        self.pending = list(events)
        self.armed: ChurnEvent | None = None  # a kill waiting for its node to enter a phase
        self.armed_offset = 0
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMGRAD_")}
        self.deadline = time.monotonic() + config.timeout_seconds
        self.bootstrap: Process | None = None
        self.processes: list[Process] = []  # every node process started, restarts included
        self.swarm: list[SwarmNode] = []
        self.started = time.time()
        self.fired: list[dict[str, Any]] = []
        self.wan: Wan | None = None

    def spawn(
        self,
        name: str,
        command: list[str],
        log_path: Path,
        host: Host | None,
        cgroup: str | None = None,
    ) -> Process:
        """A process here, or (``--launcher ray``) on the Ray cluster."""
        if self.config.launcher == "ray":
            return RayProcess(name, command, log_path, self.env)
        warm = self.config.fork_nodes
        return LocalProcess(name, command, log_path, self.env, host, warm=warm, cgroup=cgroup)

    def start_bootstrap(self) -> list[str]:
        maddrs_file = self.config.out_dir / "bootstrap.json"
        maddrs_file.unlink(missing_ok=True)
        command = node_command(
            "bootstrap", "--maddrs-file", str(maddrs_file), "--discovery", self.config.discovery,
            "--identity", str(self.config.out_dir / "bootstrap.key"),
        )  # fmt: skip
        host = self.wan.host() if self.wan is not None else None
        if host is not None:
            command += ["--host", host.address]
        log_path = self.config.out_dir / "bootstrap.log"
        boot = self.spawn("bootstrap", command, log_path, host)
        self.bootstrap = boot
        return list(_wait_for_file(maddrs_file, boot, self.deadline)["maddrs"])

    def start(self, node: SwarmNode) -> None:
        node.log_offset = node.log_size()
        name, command = f"node-{node.index}", node.command()
        node.process = self.spawn(name, command, node.log, node.host, node.cgroup)
        self.processes.append(node.process)
        node.running, node.started_at = True, time.monotonic()
        node.waiting_rejoin = bool(self.fired)  # a node (re)joining a run under way

    def until_finished(self) -> None:
        shown = 0
        while True:
            self._check()
            current = {node.index: node.status_of() for node in self.swarm}
            self._fire_due(max(status.get("epoch", 0) for status in current.values()))
            self._fire_armed()
            running = [n for n in self.swarm if n.running]
            if (
                not self.pending
                and self.armed is None
                # Attackers need not finish: banned, they may never reach the last epoch.
                and all(current[n.index].get("finished") for n in running if not n.attack)
                and (self.config.hold is None or self.config.hold.is_set())
            ):
                # Every one is done: now they may leave.
                stop_all([node.process for node in running if node.process is not None])
                for node in running:
                    node.running, node.finished = False, True
                return
            honest = [n for n in self.swarm if not n.attack]
            shown = _show_progress(honest, shown, self.config.rounds)
            time.sleep(0.05)

    def _check(self) -> None:
        """Fail on the deadline or a node that exited; note nodes that (re)joined."""
        if time.monotonic() > self.deadline:
            late = [n for n in self.swarm if n.running]
            tails = "\n".join(f"node-{n.index}: {n.process.tail(5)}" for n in late if n.process)
            raise SimulationError(f"the swarm did not finish in time:\n{tails}")
        for node in self.swarm:
            code = node.process.poll() if node.running and node.process else None
            if code is not None:
                assert node.process is not None
                raise SimulationError(f"node-{node.index} exited ({code}):\n{node.process.tail()}")
        for node in self.swarm:
            if node.waiting_rejoin and REJOINED.search(node.log_since()):
                node.rejoin_seconds.append(time.monotonic() - node.started_at)
                node.waiting_rejoin = False

    def _fire_due(self, epoch: int) -> None:
        """Fire the schedule's events due at ``epoch`` (a kill for a phase is armed instead)."""
        while self.armed is None and self.pending and self.pending[0].at_epoch <= epoch:
            event = self.pending.pop(0)
            target = self.swarm[event.node]
            if event.action == "start":
                target.status.unlink(missing_ok=True)  # its old "finished", if any
                self.start(target)
            elif event.during:  # wait for the node to enter that phase
                self.armed, self.armed_offset = event, target.log_size()
                continue
            else:
                self._act(event, target)
            self._fired(event)

    def _act(self, event: ChurnEvent, target: SwarmNode) -> None:
        """Do ``event``'s action (other than a start) to ``target``, now."""
        if event.action in ("partition", "heal"):
            assert self.wan is not None  # checked before the run
            assert target.host is not None
            if event.action == "partition":
                self.wan.partition(target.host)
            else:
                self.wan.heal(target.host)
                target.watch_rejoin()
        elif event.action in ("pause", "resume"):
            assert target.process is not None
            target.process.signal(signal.SIGSTOP if event.action == "pause" else signal.SIGCONT)
            if event.action == "resume":
                target.watch_rejoin()
            else:
                target.waiting_rejoin = False
        elif event.action == "stop":
            assert target.process is not None
            target.process.stop()
            target.running = False
        else:
            assert target.process is not None
            target.process.kill()
            target.running = False

    def _fire_armed(self) -> None:
        armed = self.armed
        if armed is None:
            return
        target = self.swarm[armed.node]
        if MARKERS[armed.during] in target.log_since(self.armed_offset):
            self._act(armed, target)
            target.waiting_rejoin = False
            self._fired(armed)
            self.armed = None
        elif not target.running:
            raise SimulationError(f"node-{armed.node} exited before {armed.describe()}")

    def _fired(self, event: ChurnEvent) -> None:
        self.fired.append({"event": event.describe(), "time": time.time() - self.started})
        log.info("churn: %s", event.describe())


def _show_progress(swarm: list[SwarmNode], shown: int, rounds: int) -> int:
    """Log the swarm's progress when its slowest running node finishes a new epoch."""
    statuses = []
    for node in swarm:
        if not node.running:
            continue
        try:
            statuses.append(json.loads(node.status.read_text()))
        except (OSError, ValueError):  # not written yet
            return shown
    if not statuses:
        return shown
    epoch = int(min(s["epoch"] for s in statuses))
    if epoch > shown:
        loss = loss_mean(s["val_loss"] for s in statuses)
        sent = statistics.fmean(s["bytes_sent"] for s in statuses) / 2**20
        log.info("epoch %d/%d: val loss %.3f, %.1f MiB sent per peer", epoch, rounds, loss, sent)
    return max(shown, epoch)
