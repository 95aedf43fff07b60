"""Per-peer profiles for a simulated swarm: compute slowdown, upload cap and bandwidth share,
and, for open runs, an attack the peer makes (``simulations/attacks.py``), read from a TOML file
of ``[[peer]]`` tables (cycled over the nodes)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from swarmgrad.simulations.attacks import Attack


class SimulationError(RuntimeError):
    """The simulation could not run (bad profile, a node that failed to start); says why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerProfile:
    slowdown: float = 1.0
    upload_bytes_per_second: float | None = None
    bandwidth: float = 1.0
    attack: Attack | None = None  # a malicious peer: what it sends instead of its update


def load_profile(path: Path | None, nodes: int) -> list[PeerProfile]:
    if path is None:
        return [PeerProfile() for _ in range(nodes)]
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise SimulationError(f"cannot read profile {path}: {error}") from None
    peers = raw.get("peer")
    if set(raw) != {"peer"} or not isinstance(peers, list) or not peers:
        raise SimulationError(f"{path}: expected one or more [[peer]] tables and nothing else")
    known = {"slowdown", "upload_bytes_per_second", "bandwidth", "attack"}
    profiles = []
    for i, table in enumerate(peers):
        unknown = set(table) - known
        if unknown:
            raise SimulationError(f"{path}: peer {i}: unknown key(s) {', '.join(sorted(unknown))}")
        table = dict(table)
        attack = table.pop("attack", None)
        try:
            numbers = {k: float(v) for k, v in table.items()}
        except (TypeError, ValueError):
            raise SimulationError(f"{path}: peer {i}: values must be numbers") from None
        usable = [a for a in Attack if a is not Attack.ALIE]  # ALIE reads the others' updates
        if attack is not None and attack not in usable:
            raise SimulationError(
                f"{path}: peer {i}: attack {attack!r} is not one a node can make; choose one of "
                f"{', '.join(usable)} (alie needs the honest updates: benchmarks/byzantine.py)"
            )
        chosen = None if attack is None else Attack(attack)
        profiles.append(PeerProfile(**numbers, attack=chosen))
    return [profiles[i % len(profiles)] for i in range(nodes)]
