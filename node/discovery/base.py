"""The discovery interface every backend implements, and the one place a backend is chosen.

Two backends (../DESIGN.md section 5): ``hivemind`` (:mod:`.hivemind_dht`, hivemind's DHT over its
go-libp2p daemon, Linux x86_64 only) and ``libp2p`` (:mod:`.libp2p_dht`, py-libp2p's Kademlia in
a supervised sidecar process). Each is imported only when chosen: hivemind and libp2p cannot be
imported into one process, and the libp2p backend keeps libp2p out of the node's process anyway.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.identity import Identity

BACKENDS = ("hivemind", "libp2p")


class DiscoveryError(Exception):
    """Discovery itself failed: the bootstrap peers could not be reached, the DHT died."""


def dht_time() -> float:
    """The clock records are stamped with: the wall clock (hivemind's DHT time is too)."""
    return time.time()


class Discovery(Protocol):
    """Publish this node's signed record and read the run's others. Every call has a deadline."""

    run_id: str
    spec_hash: bytes
    #: Records dropped on read, by reason.
    rejected: Counter[str]

    def for_spec(self, spec_hash: bytes) -> Discovery:
        """A view of the same DHT for another spec of this run (closing either closes both)."""
        ...

    def visible_maddrs(self) -> list[str]:
        """Multiaddrs other nodes can bootstrap from."""
        ...

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


async def start_discovery(
    backend: str,
    identity: Identity,
    *,
    run_id: str,
    spec_hash: bytes,
    initial_peers: Sequence[str] = (),
    host: str = "127.0.0.1",
    port: int = 0,
    network_secret: str = "",
    start_timeout_seconds: float = 60.0,
) -> Discovery:
    """A started node of ``backend``'s DHT, joined through ``initial_peers`` if any.

    ``network_secret`` (libp2p only) keeps a private run's DHT apart from every other.
    """
    if backend == "hivemind":
        if network_secret:
            raise ValueError("a DHT secret needs --discovery libp2p (hivemind's DHT has none)")
        try:
            from swarmgrad.node.discovery.hivemind_dht import HivemindDiscovery
        except ImportError as error:  # not installed: its wheel is Linux x86_64 only
            raise DiscoveryError(
                f"the hivemind discovery backend is unavailable here ({error}); "
                "use --discovery libp2p"
            ) from None

        return await HivemindDiscovery.start(
            identity,
            run_id=run_id,
            spec_hash=spec_hash,
            initial_peers=initial_peers,
            host=host,
            port=port,
            start_timeout_seconds=start_timeout_seconds,
        )
    if backend == "libp2p":
        from swarmgrad.node.discovery.libp2p_dht import Libp2pDiscovery

        return await Libp2pDiscovery.start(
            identity,
            run_id=run_id,
            spec_hash=spec_hash,
            initial_peers=initial_peers,
            host=host,
            port=port,
            network_secret=network_secret,
            start_timeout_seconds=start_timeout_seconds,
        )
    raise ValueError(f"unknown discovery backend {backend!r} (one of {', '.join(BACKENDS)})")
