"""What a local simulation runs (``swarm.py``): its nodes, rounds, files, launcher and links."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from swarmgrad.node.discovery.base import BACKENDS
from swarmgrad.simulations.launchers import (
    LAUNCHERS,
)
from swarmgrad.simulations.profiles import SimulationError
from swarmgrad.simulations.simulate_options import DISCOVERY, FORK_NODES, TIMEOUT_SECONDS


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationConfig:
    """A local swarm: ``nodes`` node processes (and a bootstrap) training to ``rounds`` epochs."""

    nodes: int
    rounds: int
    out_dir: Path
    spec_path: Path | None = None  # None: the demo spec
    profile_path: Path | None = None  # per-node slowdown, bandwidth, upload cap
    churn_path: Path | None = None  # a churn schedule (simulations/churn.py)
    timeout_seconds: float = TIMEOUT_SECONDS
    extra_node_args: tuple[str, ...] = ()
    discovery: str = DISCOVERY
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
    fork_nodes: bool = FORK_NODES
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
