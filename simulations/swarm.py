"""``swarmgrad simulate``: a bootstrap and N real node processes on loopback, and their summary.

Each node is the real ``swarmgrad node`` command in its own process, with its own identity, a
per-peer compute slowdown and upload cap from the profile, writing its status file after every
round. The driver waits (with a deadline) for every node to reach the target epoch, then reads
the status files into one summary: the loss curve, each peer's contribution, bytes, round times,
utilization, and whether all replicas ended with the same parameters.

A profile is TOML with one ``[[peer]]`` table per node (reused in turn if there are fewer)::

    [[peer]]
    slowdown = 1.0                  # compute speed factor (2.0: steps take twice as long)
    upload_bytes_per_second = 5e6   # cap on averaging uploads (omit: no cap)
    bandwidth = 1.0                 # relative share of each vector this peer owns
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from swarmgrad.node import config as node_config
from swarmgrad.node.discovery.base import BACKENDS
from swarmgrad.node.identity import Identity
from swarmgrad.node.runspec import RunSpec
from swarmgrad.simulations.churn import MARKERS, ChurnEvent, ScheduleError, load_schedule
from swarmgrad.simulations.lab_nodes import prepare_corpus
from swarmgrad.simulations.launchers import (
    LAUNCHERS,
    LocalProcess,
    Process,
    RayProcess,
    ray_cluster,
    stop_all,
)
from swarmgrad.simulations.natlab import Host
from swarmgrad.simulations.netem import GRPC_PORT, Wan
from swarmgrad.simulations.netem import unavailable as netem_unavailable
from swarmgrad.simulations.processes import adversary_command, node_command
from swarmgrad.simulations.profiles import PeerProfile, SimulationError, load_profile
from swarmgrad.simulations.summary import loss_mean, summarize

log = logging.getLogger(__name__)
#: A (re)started node's log line once it takes part at the swarm's epoch.
REJOINED = re.compile(r"epoch \d+: (averaged|partial|resynced)")

DEMO_SPEC = """\
# The demo run: a small GPT on Shakespeare's plays, DiLoCo with 8-bit averaging. On a run this
# short from scratch, plain model averaging (outer lr 1, no momentum) measured best; the paper's
# Nesterov 0.7/0.9 is for long runs (see docs/benchmarks.md).
[run]
id = "shakespeare-demo"

[model]
vocab_size = 2048
d_model = 128
n_layers = 2
n_heads = 4
seq_len = 64

[data]
source = "demo"
batch_size = 16

[algorithm]
name = "diloco"
inner_steps = 10
inner_lr = 2e-3
outer_lr = 1.0
outer_momentum = 0.0

[averaging]
codec = "int8"
group_size = 4
matchmaking_timeout_seconds = 20.0
"""


def simulation_identity(seed: int, index: int) -> Identity:
    """Node ``index``'s key in a simulation run with ``--seed seed``."""
    return Identity.from_seed(f"swarmgrad-simulation:{seed}:{index}")


def _wait_for_file(path: Path, process: Process, deadline: float) -> dict[str, Any]:
    while time.monotonic() < deadline:
        if path.exists():
            return dict(json.loads(path.read_text()))
        if process.poll() is not None:
            raise SimulationError(f"{process.name} exited early:\n{process.tail()}")
        time.sleep(0.1)
    raise SimulationError(f"{process.name} did not come up in time:\n{process.tail()}")


@dataclass(slots=True)
class _Node:
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


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationConfig:
    """A local swarm: ``nodes`` node processes (and a bootstrap) training to ``rounds`` epochs."""

    nodes: int
    rounds: int
    out_dir: Path
    spec_path: Path | None = None  # None: the demo spec
    profile_path: Path | None = None  # per-node slowdown, bandwidth, upload cap
    churn_path: Path | None = None  # a churn schedule (simulations/churn.py)
    timeout_seconds: float = 600.0
    extra_node_args: tuple[str, ...] = ()
    discovery: str = "hivemind"
    #: Each node in its own network namespace, its links shaped by tbf and nftables from its
    #: profile (``netem.py``; root). Without the means it says so and uses the token bucket.
    netem: bool = False
    #: Where the processes run: "local" (children of this one) or "ray" (actors on a Ray
    #: cluster: ``ray_address``, or a local head when empty; ``launchers.py``).
    launcher: str = "local"
    ray_address: str = ""
    #: Node i's identity derived from (seed, i) instead of drawn at random, so its peer id,
    #: and with it its data stream, is the same in every run with that seed: settings
    #: compared side by side see the same data.
    seed: int | None = None
    #: Local node processes forked from a warm zygote that imported the node's modules once
    #: (``zygote.py``; each start skips ~2.5 CPU-seconds of imports), or each a fresh
    #: interpreter (Ray's processes always do).
    fork_nodes: bool = True
    #: When given, the nodes that finished stay in the swarm (and the DHT) until it is set: a
    #: caller inspecting the live swarm (``swarmgrad status``, Prometheus) is not raced by its
    #: end. ``timeout_seconds`` still bounds the whole run.
    hold: threading.Event | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.rounds < 1:
            raise SimulationError("--nodes and --rounds must be at least 1")
        if self.discovery not in BACKENDS:
            raise SimulationError(f"--discovery must be one of {', '.join(BACKENDS)}")
        if self.launcher not in LAUNCHERS:
            raise SimulationError(f"--launcher must be one of {', '.join(LAUNCHERS)}")
        if self.ray_address and self.launcher != "ray":
            raise SimulationError("--ray-address goes with --launcher ray")
        if self.netem and self.launcher == "ray":
            raise SimulationError("--netem shapes this machine's namespaces: use --launcher local")


def simulate(config: SimulationConfig) -> dict[str, Any]:
    """Run the swarm to ``config.rounds`` epochs (with its churn schedule, if any); return (and
    write to summary.json) its summary."""
    try:
        events = load_schedule(config.churn_path, nodes=config.nodes) if config.churn_path else []
    except ScheduleError as error:
        raise SimulationError(str(error)) from None
    slots = max([config.nodes - 1, *(e.node for e in events)]) + 1
    profiles = load_profile(config.profile_path, slots, seed=config.seed or 0)
    missing = netem_unavailable() if config.netem else []
    if missing:
        log.warning(
            "--netem needs %s: falling back to processes on loopback with a token bucket on "
            "each upload",
            ", ".join(missing),
        )
    netem = config.netem and not missing
    cuts = [e for e in events if e.action in ("partition", "heal")]
    if cuts and not netem:
        raise SimulationError(
            f"{cuts[0].describe()}: partitions need --netem (nodes in network namespaces)"
        )
    unapplied = [i for i, p in enumerate(profiles) if not p.applied_by_processes]
    if unapplied and not netem:
        log.warning(
            "node(s) %s: latency, jitter, download caps, loss, relayed NATs and session lengths "
            "are not applied to processes on loopback (only slowdown, upload cap and bandwidth "
            "are; --netem applies latency, jitter, download caps and loss); the discrete-event "
            "model (--engine des) uses them",
            ", ".join(map(str, unapplied)),
        )
    config.out_dir.mkdir(parents=True, exist_ok=True)
    spec_path = config.spec_path
    if spec_path is None:
        spec_path = config.out_dir / "run.toml"
        spec_path.write_text(DEMO_SPEC)
    spec = RunSpec.load(spec_path)
    run = _SwarmRun(config, events)
    with contextlib.ExitStack() as stack:  # the namespaces go after the processes stopped
        if config.launcher == "ray":
            stack.enter_context(ray_cluster(config.ray_address))
        if netem:
            delays = any(p.latency_ms or p.jitter_ms for p in profiles)
            run.wan = stack.enter_context(Wan(delays=delays))
            prepare_corpus(spec_path)  # the nodes' namespaces reach nothing outside
        try:
            maddrs = run.start_bootstrap()
            run.swarm = [
                _node_slot(config, i, profile, spec_path, maddrs, run.wan)
                for i, profile in enumerate(profiles)
            ]
            for node in run.swarm[: config.nodes]:
                run.start(node)
            run.until_finished()
            finals = [n for n in run.swarm if n.finished]
            statuses = [json.loads(n.status.read_text()) for n in finals]
            attacks = [n.attack for n in finals]
        finally:  # the nodes first (each leaves the DHT gracefully), then the bootstrap node
            stop_all(run.processes)
            stop_all([run.bootstrap] if run.bootstrap is not None else [])
    wall_seconds = time.time() - run.started
    summary = summarize(
        statuses, spec=spec, wall_seconds=wall_seconds, rounds=config.rounds, attacks=attacks
    )
    summary["profiles"] = [asdict(p) for p in profiles]
    summary["netem"] = netem
    if events:
        summary["churn"] = {
            "events": run.fired,
            "rejoin_seconds": {
                f"node-{n.index}": n.rejoin_seconds for n in run.swarm if n.rejoin_seconds
            },
            "finished": [f"node-{n.index}" for n in finals],
        }
    (config.out_dir / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    return summary


def _node_slot(
    config: SimulationConfig,
    i: int,
    profile: PeerProfile,
    spec_path: Path,
    maddrs: list[str],
    wan: Wan | None,
) -> _Node:
    """Node slot ``i``: its files cleared (a new simulation starts fresh), its command line."""
    out_dir = config.out_dir
    status, log_path = out_dir / f"node-{i}.json", out_dir / f"node-{i}.log"
    status.unlink(missing_ok=True)
    log_path.unlink(missing_ok=True)
    checkpoints = out_dir / "checkpoints" / f"node-{i}"
    shutil.rmtree(checkpoints, ignore_errors=True)
    key = out_dir / f"node-{i}.key"
    if config.seed is not None:
        simulation_identity(config.seed, i).save(key)
    args = [
        "node",
        str(spec_path),
        *(a for m in maddrs for a in ("--bootstrap", m)),
        "--identity", str(key),
        "--cache-dir", str(node_config.home() / "cache"),
        "--max-epochs", str(config.rounds),
        "--linger",  # a node done early serves state until all are (latecomers catch up)
        "--slowdown", str(profile.slowdown),
        "--bandwidth", str(profile.bandwidth),
        "--status-file", str(status),
        "--display", "log",
        "--threads", "1",
        "--checkpoint-dir", str(checkpoints),
        "--metrics-address", "127.0.0.1:0",
        "--discovery", config.discovery,
        *config.extra_node_args,
    ]  # fmt: skip
    host = None
    if wan is not None:  # its links are shaped by its namespace, not by a token bucket
        host = wan.host(profile)
        args += ["--host", host.address]
        if wan.delays:  # the port its delay proxy stands in front of
            args += ["--port", str(GRPC_PORT)]
    elif profile.upload_bytes_per_second is not None:
        args += ["--upload-limit", str(profile.upload_bytes_per_second)]
    attack = "" if profile.attack is None else str(profile.attack)
    return _Node(index=i, args=args, status=status, log=log_path, attack=attack, host=host)


class _SwarmRun:
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
        self.swarm: list[_Node] = []
        self.started = time.time()
        self.fired: list[dict[str, Any]] = []
        self.wan: Wan | None = None

    def spawn(self, name: str, command: list[str], log_path: Path, host: Host | None) -> Process:
        """A process here, or (``--launcher ray``) on the Ray cluster."""
        if self.config.launcher == "ray":
            return RayProcess(name, command, log_path, self.env)
        return LocalProcess(name, command, log_path, self.env, host, warm=self.config.fork_nodes)

    def start_bootstrap(self) -> list[str]:
        maddrs_file = self.config.out_dir / "bootstrap.json"
        maddrs_file.unlink(missing_ok=True)
        command = node_command(
            "bootstrap", "--maddrs-file", str(maddrs_file), "--discovery", self.config.discovery
        )
        host = self.wan.host() if self.wan is not None else None
        if host is not None:
            command += ["--host", host.address]
        log_path = self.config.out_dir / "bootstrap.log"
        boot = self.spawn("bootstrap", command, log_path, host)
        self.bootstrap = boot
        return list(_wait_for_file(maddrs_file, boot, self.deadline)["maddrs"])

    def start(self, node: _Node) -> None:
        node.log_offset = node.log_size()
        node.process = self.spawn(f"node-{node.index}", node.command(), node.log, node.host)
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
            elif event.action in ("partition", "heal"):
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
            self._fired(event)

    def _fire_armed(self) -> None:
        armed = self.armed
        if armed is None:
            return
        target = self.swarm[armed.node]
        if MARKERS[armed.during] in target.log_since(self.armed_offset):
            assert target.process is not None
            target.process.kill()
            target.running = target.waiting_rejoin = False
            self._fired(armed)
            self.armed = None
        elif not target.running:
            raise SimulationError(f"node-{armed.node} exited before {armed.describe()}")

    def _fired(self, event: ChurnEvent) -> None:
        self.fired.append({"event": event.describe(), "time": time.time() - self.started})
        log.info("churn: %s", event.describe())


def _show_progress(swarm: list[_Node], shown: int, rounds: int) -> int:
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
