"""The discovery interface every backend implements (hivemind DHT now, py-libp2p later)."""

from __future__ import annotations

from typing import Protocol

from swarmgrad.node.discovery.records import PeerRecord


class DiscoveryError(Exception):
    """Discovery itself failed: the bootstrap peers could not be reached, the DHT died."""


class Discovery(Protocol):
    """Publish this node's signed record and read the run's others. Every call has a deadline."""

    async def announce(self, record: PeerRecord, topic: str = "peers") -> None:
        """Publish (or refresh) this node's record under ``topic`` until its ``expires_at``.

        ``peers`` is the swarm's directory; ``round/<r>`` is readiness for round r.
        """
        ...

    async def find(self, topic: str = "peers") -> list[PeerRecord]:
        """Valid, unexpired records under ``topic`` (this node's own included), by peer id."""
        ...

    async def announce_spec(self, canonical: bytes, *, expires_at: float) -> None:
        """Publish the canonical run spec under the run id alone (not under its hash)."""
        ...

    async def find_specs(self) -> dict[str, bytes]:
        """Every spec announced for the run id, by SHA-256 hex, each checked against its hash."""
        ...

    async def leave(self, topic: str = "peers") -> None:
        """Withdraw this node's record under ``topic`` at once (``peers``: a graceful leave)."""
        ...

    async def close(self) -> None: ...
