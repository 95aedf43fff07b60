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
    cpu_cores = 0.25                # its CPU share, by a cgroup quota (omit: not limited)
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from swarmgrad.node import config as node_config
from swarmgrad.node.identity import Identity
from swarmgrad.node.runspec import RunSpec
from swarmgrad.simulations.churn import ScheduleError, load_schedule
from swarmgrad.simulations.cpushare import cpu_shares
from swarmgrad.simulations.lab_nodes import prepare_corpus
from swarmgrad.simulations.launchers import (
    ray_cluster,
    stop_all,
)
from swarmgrad.simulations.netem import GRPC_PORT, Wan
from swarmgrad.simulations.netem import unavailable as netem_unavailable
from swarmgrad.simulations.profiles import PeerProfile, SimulationError, load_profile
from swarmgrad.simulations.summary import summarize
from swarmgrad.simulations.swarm_config import SimulationConfig
from swarmgrad.simulations.swarm_run import SwarmNode, SwarmRun

log = logging.getLogger(__name__)

DEMO_SPEC = """\
# The demo run: a small GPT on Shakespeare's plays, DiLoCo with 8-bit averaging. On a run this
# short from scratch, plain model averaging (outer lr 1, no momentum) measured best; the paper's
# Nesterov 0.7/0.9 is for long runs (see docs/benchmarks.md). Groups of up to 256: a swarm of
# that size averages as one group each round (groups smaller than the swarm average apart, and
# all but one group's work is then replaced: docs/benchmarks.md, "Rounds for volunteers").
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
group_size = 256
matchmaking_timeout_seconds = 20.0
"""


def simulation_identity(seed: int, index: int) -> Identity:
    """Node ``index``'s key in a simulation run with ``--seed seed``."""
    return Identity.from_seed(f"swarmgrad-simulation:{seed}:{index}")


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
    run = SwarmRun(config, events)
    with contextlib.ExitStack() as stack:  # the namespaces go after the processes stopped
        shared = any(p.cpu_cores is not None for p in profiles)
        if shared and config.launcher == "ray":
            raise SimulationError("cpu_cores shares this machine's CPU: use --launcher local")
        shares = stack.enter_context(cpu_shares()) if shared else None
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
            for node, profile in zip(run.swarm, profiles, strict=True):
                if shares is not None and profile.cpu_cores is not None:
                    node.cgroup = str(shares.group(f"node-{node.index}", profile.cpu_cores))
            for node in run.swarm[: config.nodes]:
                run.start(node)
            run.until_finished()
            finals = [n for n in run.swarm if n.finished]
            statuses = [json.loads(n.status.read_text()) for n in finals]
            attacks = [n.attack for n in finals]
        finally:  # the nodes first (each leaves the DHT gracefully), then the bootstrap node
            stop_all(run.processes)
            stop_all([run.bootstrap] if run.bootstrap is not None else [])
        throttled = shares.throttled() if shares is not None else {}
    wall_seconds = time.time() - run.started
    summary = summarize(
        statuses, spec=spec, wall_seconds=wall_seconds, rounds=config.rounds, attacks=attacks
    )
    summary["profiles"] = [asdict(p) for p in profiles]
    summary["netem"] = netem
    if throttled:  # how often each node wanted more CPU than its share
        summary["cpu_throttled"] = throttled
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
) -> SwarmNode:
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
    return SwarmNode(index=i, args=args, status=status, log=log_path, attack=attack, host=host)


__all__ = ["DEMO_SPEC", "SimulationConfig", "simulate", "simulation_identity"]
