"""Per-peer profiles for a simulated swarm, read from a TOML file of ``[[peer]]`` tables (cycled
over the nodes): compute slowdown, link speeds, latency, NAT, session lengths and, for open runs,
an attack the peer makes (``simulations/attacks.py``).

Any value may be a distribution instead of a number (``simulations/distributions.py``); each node
draws its own from its table, from the simulation's seed. The real-process ``simulate`` applies
``slowdown``, ``upload_bytes_per_second``, ``bandwidth`` and ``attack`` itself; ``--netem`` adds
download caps and loss (``netem.py``); the discrete-event model (``--engine des``) uses them all.
"""

from __future__ import annotations

import math
import random
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from swarmgrad.node.averaging.group import MAX_BANDWIDTH
from swarmgrad.simulations.attacks import Attack
from swarmgrad.simulations.distributions import DistributionError, parse


class SimulationError(RuntimeError):
    """The simulation could not run (bad profile, a node that failed to start); says why."""


#: The shortest mean session a profile may ask for: every crash and restart is work for the
#: simulation (the discrete-event model steps through each one), and sessions shorter than a
#: second would make a run of any length mostly restarts.
MIN_SESSION_SECONDS = 1.0


NATS = ("direct", "relayed")


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerProfile:
    slowdown: float = 1.0  # compute time factor (2.0: steps take twice as long)
    upload_bytes_per_second: float | None = None  # None: not capped
    download_bytes_per_second: float | None = None
    bandwidth: float = 1.0  # relative share of each vector this peer owns
    latency_ms: float = 0.0  # one way, from the peer to the internet's core
    jitter_ms: float = 0.0  # +- this much, uniformly, on each chunk's delay (--netem)
    loss: float = 0.0  # share of the packets it receives that are lost
    nat: str = "direct"  # "relayed": unreachable, its streams go through a relay
    session_seconds: float | None = None  # online this long, then it crashes (None: stays)
    offline_seconds: float = 60.0  # and comes back (with its checkpoints) this much later
    attack: Attack | None = None  # a malicious peer: what it sends instead of its update
    #: The CPU its node may use, in cores (0.25: a quarter of one), by a cgroup quota
    #: (``cpushare.py``; None: as much as the machine gives it). The model scales the node's
    #: inner steps and codec work by it (a node's training uses at most one core).
    cpu_cores: float | None = None

    def __post_init__(self) -> None:
        for name in (f.name for f in fields(self) if f.name not in ("nat", "attack")):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise SimulationError(f"{name} must be finite, got {value}")
        if self.bandwidth > MAX_BANDWIDTH:
            raise SimulationError(
                f"bandwidth must be at most {MAX_BANDWIDTH:g}, got {self.bandwidth}"
            )
        positive = {
            "slowdown": self.slowdown,
            "upload_bytes_per_second": self.upload_bytes_per_second,
            "download_bytes_per_second": self.download_bytes_per_second,
            "session_seconds": self.session_seconds,
            "cpu_cores": self.cpu_cores,
        }
        for name, value in positive.items():
            if value is not None and not value > 0:
                raise SimulationError(f"{name} must be positive, got {value}")
        for name in ("bandwidth", "latency_ms", "jitter_ms", "offline_seconds"):
            if not getattr(self, name) >= 0:
                raise SimulationError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.session_seconds is not None and not self.session_seconds >= MIN_SESSION_SECONDS:
            raise SimulationError(
                f"session_seconds must be at least {MIN_SESSION_SECONDS:g}, "
                f"got {self.session_seconds}"
            )
        if not 0 <= self.loss < 1:
            raise SimulationError(f"loss must be in [0, 1), got {self.loss}")
        if self.nat not in NATS:
            raise SimulationError(f"nat must be one of {', '.join(NATS)}, got {self.nat!r}")

    @property
    def cpu_share(self) -> float:
        """The share of one core its node's work (training, the codec: one thread) gets."""
        return min(self.cpu_cores or 1.0, 1.0)

    @property
    def compute_factor(self) -> float:
        """How many times longer its compute takes than one inner step's time on a whole core:
        its slowdown, over its CPU share."""
        return self.slowdown / self.cpu_share

    @property
    def applied_by_processes(self) -> bool:
        """Whether real processes on loopback (no --netem) apply all of this profile."""
        return (
            self.download_bytes_per_second is None
            and self.latency_ms == 0
            and self.jitter_ms == 0
            and self.loss == 0
            and self.nat == "direct"
            and self.session_seconds is None
        )


def load_profile(path: Path | None, nodes: int, *, seed: int = 0) -> list[PeerProfile]:
    """Node i's profile, i < ``nodes``: table i mod the number of tables, its distributions
    drawn for that node (the same draws for the same seed)."""
    if path is None:
        return [PeerProfile() for _ in range(nodes)]
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise SimulationError(f"cannot read profile {path}: {error}") from None
    peers = raw.get("peer")
    if set(raw) != {"peer"} or not isinstance(peers, list) or not peers:
        raise SimulationError(f"{path}: expected one or more [[peer]] tables and nothing else")
    known = [f.name for f in fields(PeerProfile)]
    tables = []
    for i, table in enumerate(peers):
        if not isinstance(table, dict):
            raise SimulationError(f"{path}: peer {i} is not a table: write [[peer]] sections")
        unknown = set(table) - set(known)
        if unknown:
            raise SimulationError(f"{path}: peer {i}: unknown key(s) {', '.join(sorted(unknown))}")
        try:
            tables.append({k: parse(v, f"{path}: peer {i}: {k}") for k, v in table.items()})
        except DistributionError as error:
            raise SimulationError(str(error)) from None
    rng = random.Random(f"swarmgrad-profile:{seed}")
    profiles = []
    for node in range(nodes):
        i = node % len(tables)
        drawn = {k: d.sample(rng) for k, d in tables[i].items()}
        try:
            profiles.append(_profile(drawn))
        except SimulationError as error:
            raise SimulationError(f"{path}: peer {i} (node {node}): {error}") from None
    if not any(p.bandwidth > 0 for p in profiles):
        raise SimulationError(f"{path}: every node has bandwidth 0: nobody could own a part")
    return profiles


def _profile(drawn: dict[str, Any]) -> PeerProfile:
    attack = drawn.pop("attack", None)
    nat = drawn.pop("nat", "direct")
    usable = [a for a in Attack if a is not Attack.ALIE]  # ALIE reads the others' updates
    if attack is not None and attack not in usable:
        raise SimulationError(
            f"attack {attack!r} is not one a node can make; choose one of "
            f"{', '.join(usable)} (alie needs the honest updates: benchmarks/byzantine.py)"
        )
    try:
        numbers = {k: float(v) for k, v in drawn.items()}
    except (TypeError, ValueError):
        raise SimulationError("values must be numbers (or distributions of numbers)") from None
    chosen = None if attack is None else Attack(attack)
    return PeerProfile(**numbers, nat=str(nat), attack=chosen)
