"""Starting a DHT node of the configured backend (the one place that picks it).

``start_discovery`` imports the backend it starts and no other: hivemind's in the node's process
(it forks its own DHT process), libp2p's node side (its DHT runs in a sidecar process).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swarmgrad.node.discovery.base import BACKENDS, Discovery, DiscoveryError
from swarmgrad.node.identity import Identity


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscoveryConfig:
    """Which DHT, where it listens, whom it joins through, and its deadlines."""

    backend: str = "hivemind"
    initial_peers: tuple[str, ...] = ()  # bootstrap multiaddrs (none: a new DHT)
    host: str = "127.0.0.1"
    port: int = 0
    #: libp2p only: a private run's DHT key; its DHT then never merges with any other.
    network_secret: str = ""
    start_timeout_seconds: float = 60.0
    #: hivemind: the DHT's libp2p peer id is the node identity's, the same at every start (a
    #: bootstrap's, whose multiaddr others hold); else a new one each start. The libp2p backend
    #: always takes the identity's.
    keep_peer_id: bool = False
    #: Each call into the DHT (store, get) ends by then.
    call_timeout_seconds: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "initial_peers", tuple(self.initial_peers))  # a list is fine
        if self.backend not in BACKENDS:
            raise ValueError(
                f"unknown discovery backend {self.backend!r} (one of {', '.join(BACKENDS)})"
            )
        if self.network_secret and self.backend != "libp2p":
            raise ValueError("a DHT secret needs --discovery libp2p (hivemind's DHT has none)")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.start_timeout_seconds > 0 or not self.call_timeout_seconds > 0:
            raise ValueError("start_timeout_seconds and call_timeout_seconds must be positive")


async def start_discovery(
    config: DiscoveryConfig, identity: Identity, *, run_id: str, spec_hash: bytes
) -> Discovery:
    """A started node of ``config.backend``'s DHT for ``run_id`` and ``spec_hash``."""
    if config.backend == "hivemind":
        try:
            from swarmgrad.node.discovery.hivemind_dht import HivemindDiscovery
        except ImportError as error:  # not installed: its wheel is Linux x86_64 only
            raise DiscoveryError(
                f"the hivemind discovery backend is unavailable here ({error}); "
                "use --discovery libp2p"
            ) from None
        return await HivemindDiscovery.start(identity, config, run_id=run_id, spec_hash=spec_hash)
    from swarmgrad.node.discovery.libp2p_dht import Libp2pDiscovery

    return await Libp2pDiscovery.start(identity, config, run_id=run_id, spec_hash=spec_hash)


async def start_reader(
    bootstrap: Sequence[str],
    *,
    backend: str,
    network_secret: str,
    timeout_seconds: float,
    run_id: str = "reader",
    spec_hash: bytes = bytes(32),
) -> Discovery:
    """A short-lived DHT client with a throwaway identity, for commands that only read
    (``status``, ``runs``, ``join``) or publish under another key (``publish``)."""
    return await start_discovery(
        DiscoveryConfig(
            backend=backend,
            initial_peers=tuple(bootstrap),
            network_secret=network_secret,
            start_timeout_seconds=timeout_seconds,
        ),
        Identity.generate(),
        run_id=run_id,
        spec_hash=spec_hash,
    )
