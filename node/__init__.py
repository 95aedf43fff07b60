"""swarmgrad node daemon: the public Python API, and the rooms the daemon is built from.

``from swarmgrad.node import Swarm, SwarmConfig, DiLoCo, SyncDataParallel, RunSpec, Identity``
is the API a researcher's own training loop uses (docs/python-api.md shows it); everything else is
reached through its subpackage: ``transport/`` (the gRPC server and channels), ``discovery/``
(the DHT and the run's directory), ``reachability/``, ``averaging/``, ``state/``, ``training/``.

The names resolve on first use: the libp2p sidecar runs as ``swarmgrad.node.discovery...`` and
must not pay for (or clash with) what the node process imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarmgrad.node.identity import Identity
    from swarmgrad.node.runspec import RunSpec
    from swarmgrad.node.swarm import Swarm
    from swarmgrad.node.swarm_config import SwarmConfig
    from swarmgrad.node.training.api import DiLoCo, SyncDataParallel

_EXPORTS = {
    "Identity": "swarmgrad.node.identity",
    "RunSpec": "swarmgrad.node.runspec",
    "Swarm": "swarmgrad.node.swarm",
    "SwarmConfig": "swarmgrad.node.swarm_config",
    "DiLoCo": "swarmgrad.node.training.api",
    "SyncDataParallel": "swarmgrad.node.training.api",
}
__all__ = ["DiLoCo", "Identity", "RunSpec", "Swarm", "SwarmConfig", "SyncDataParallel"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
