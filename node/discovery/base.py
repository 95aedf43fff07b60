"""The discovery interface every backend implements, and the one place a backend is chosen.

Two backends (../DESIGN.md section 5): ``hivemind`` (:mod:`.hivemind_dht`, hivemind's DHT over its
go-libp2p daemon, Linux x86_64 only) and ``libp2p`` (:mod:`.libp2p_dht`, py-libp2p's Kademlia in
a supervised sidecar process). Each is imported only when chosen: hivemind and libp2p cannot be
imported into one process, and the libp2p backend keeps libp2p out of the node's process anyway.
"""

from __future__ import annotations

import abc
import asyncio
import copy
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol, Self

from swarmgrad.node.discovery.records import PeerRecord, RecordError
from swarmgrad.node.identity import Identity

log = logging.getLogger(__name__)

BACKENDS = ("hivemind", "libp2p")
MAX_SPEC_BYTES = 16 * 1024
STORE_BACKOFF_SECONDS = (0.25, 0.5, 1.0, 2.0)  # between tries of a store nobody took


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


class SignedDirectory(abc.ABC):
    """The interface over a DHT that keeps, per key, one value per subkey (the latest expiry
    wins): what both backends share. Records of a run live under ``run/<run id>/<spec
    hash>/<topic>`` (``peers`` for the swarm, ``round/<r>`` for matchmaking), one subkey per peer
    id, so one read returns a whole topic and nodes of another spec never see each other; one key
    sits above the hash, ``run/<run id>/specs``, each spec in use under its SHA-256, so a node
    whose spec differs can say which fields differ. The DHT stores what anyone sends: every
    record is verified on read, and what is dropped is counted in ``rejected``.

    A backend implements the two raw operations, ``_store`` and ``_get``, with deadlines.
    """

    def __init__(
        self, identity: Identity, *, run_id: str, spec_hash: bytes, call_timeout_seconds: float
    ) -> None:
        self._identity = identity
        self.run_id, self.spec_hash = run_id, spec_hash
        self._prefix = f"run/{run_id}/{spec_hash.hex()}"
        self._timeout = call_timeout_seconds
        self._announced_until = 0.0
        #: Records dropped on read, by reason.
        self.rejected: Counter[str] = Counter()

    @abc.abstractmethod
    async def _store(self, key: str, subkey: str, value: bytes, expires: float) -> bool:
        """Store one value; whether any DHT node took it."""

    @abc.abstractmethod
    async def _get(self, key: str) -> dict[str, bytes | None]:
        """The unexpired values under ``key`` by subkey (None: a value that is not bytes)."""

    def for_spec(self, spec_hash: bytes) -> Self:
        """A view of the same DHT for another spec of this run (closing either closes both)."""
        view = copy.copy(self)
        view.spec_hash, view._prefix = spec_hash, f"run/{self.run_id}/{spec_hash.hex()}"
        view._announced_until, view.rejected = 0.0, Counter()
        return view

    @abc.abstractmethod
    def visible_maddrs(self) -> list[str]: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    def _topic_key(self, topic: str) -> str:
        return f"{self._prefix}/{topic}"

    async def _put(self, key: str, subkey: str, value: bytes, expires: float) -> None:
        # Now and then no replica takes a store (seen with hivemind, ~1 in 200, more on an
        # overloaded machine right after a node joined; with libp2p while replicas are busy);
        # a try a moment later goes through.
        for delay in (0.0, *STORE_BACKOFF_SECONDS):
            if delay:
                log.info("DHT store under %s not accepted; trying again", key)
                await asyncio.sleep(delay)
            if await self._store(key, subkey, value, expires):
                return
        raise DiscoveryError("no DHT node accepted the record")

    async def announce(self, record: PeerRecord, topic: str = "peers") -> None:
        if record.peer_id != self._identity.peer_id:
            raise ValueError("a node announces its own record only")
        await self._put(
            self._topic_key(topic), record.peer_id, record.sign(self._identity), record.expires_at
        )
        self._announced_until = max(self._announced_until, record.expires_at)

    async def announce_spec(self, canonical: bytes, *, expires_at: float) -> None:
        if len(canonical) > MAX_SPEC_BYTES:
            raise ValueError("the canonical run spec is too large to announce")
        await self._put(f"run/{self.run_id}/specs", self.spec_hash.hex(), canonical, expires_at)

    async def find_specs(self) -> dict[str, bytes]:
        specs = {}
        for subkey, data in (await self._get(f"run/{self.run_id}/specs")).items():
            if (
                data is not None
                and len(data) <= MAX_SPEC_BYTES
                and hashlib.sha256(data).hexdigest() == subkey
            ):
                specs[subkey] = data
            else:
                self.rejected["bad spec"] += 1
        return specs

    async def leave(self, topic: str = "peers") -> None:
        """Overwrite this node's record under ``topic`` with an empty value (readers skip it).

        The DHT keeps the value with the latest expiry, so the tombstone must outlive the last
        record announced.
        """
        expires = max(self._announced_until, dht_time()) + 1.0
        await self._put(self._topic_key(topic), self._identity.peer_id, b"", expires)

    async def find(self, topic: str = "peers") -> list[PeerRecord]:
        found = await self._get(self._topic_key(topic))
        now = dht_time()
        records = []
        for subkey, data in found.items():
            if data == b"":  # a graceful leave, not an attack
                continue
            try:
                record = PeerRecord.verify(
                    data if data is not None else b"",
                    run_id=self.run_id,
                    spec_hash=self.spec_hash,
                    now=now,
                )
            except RecordError as error:
                self.rejected[type(error).__name__] += 1
                log.debug("dropped record under %r: %s", subkey, error)
                continue
            if record.peer_id != subkey:
                self.rejected["subkey mismatch"] += 1
                continue
            records.append(record)
        return sorted(records, key=lambda r: r.peer_id)


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
    common: dict[str, Any] = {
        "run_id": run_id,
        "spec_hash": spec_hash,
        "initial_peers": initial_peers,
        "host": host,
        "port": port,
        "start_timeout_seconds": start_timeout_seconds,
    }
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
        return await HivemindDiscovery.start(identity, **common)
    if backend == "libp2p":
        from swarmgrad.node.discovery.libp2p_dht import Libp2pDiscovery

        return await Libp2pDiscovery.start(identity, network_secret=network_secret, **common)
    raise ValueError(f"unknown discovery backend {backend!r} (one of {', '.join(BACKENDS)})")
