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
from typing import Literal, Protocol, Self, get_args

from swarmgrad.node.discovery.envelope import (
    MAX_TTL_SECONDS,
    RUNS_KEY,
    Envelope,
    Kind,
    Sealer,
    seal,
)
from swarmgrad.node.discovery.records import (
    MAX_SPEC_BYTES,
    PeerRecord,
    ReadyRecord,
    RecordError,
    open_checked,
)
from swarmgrad.node.identity import Identity
from swarmgrad.protocol.errors import PeerUnavailable
from swarmgrad.protocol.keys import peer_id_of

log = logging.getLogger(__name__)

#: The DHT backends a run may use (a command's ``--discovery`` choices).
BackendName = Literal["hivemind", "libp2p"]
BACKENDS: tuple[BackendName, ...] = get_args(BackendName)
STORE_BACKOFF_SECONDS = (0.25, 0.5, 1.0, 2.0)  # between tries of a store nobody took


class DiscoveryError(PeerUnavailable):
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

    @property
    def call_timeout_seconds(self) -> float:
        """The deadline of each call into the DHT."""
        ...

    def for_spec(self, spec_hash: bytes) -> Discovery:
        """A view of the same DHT for another spec of this run (closing either closes both)."""
        ...

    def for_run(self, run_id: str, spec_hash: bytes) -> Discovery:
        """A view of the same DHT for another run and spec."""
        ...

    def visible_maddrs(self) -> list[str]:
        """Multiaddrs other nodes can bootstrap from."""
        ...

    async def announce(self, record: PeerRecord) -> None:
        """Publish (or refresh) this node's record in the run's directory (``peers``) until its
        ``expires_at``."""
        ...

    async def find(self) -> list[PeerRecord]:
        """The run's valid, unexpired peer records (this node's own included), by peer id."""
        ...

    async def announce_ready(self, record: ReadyRecord) -> None:
        """Publish this node's readiness for ``record.round`` (under ``round/<r>``)."""
        ...

    async def find_ready(self, round_: int) -> list[ReadyRecord]:
        """The valid, unexpired readiness records for ``round_``, by peer id."""
        ...

    async def announce_spec(self, canonical: bytes, *, expires_at: float) -> None:
        """Publish the canonical run spec under the run id alone (not under its hash), in this
        node's own slot."""
        ...

    async def find_specs(self) -> dict[str, bytes]:
        """Every spec announced for the run id, by SHA-256 hex."""
        ...

    async def find_spec_announcements(self) -> list[Envelope]:
        """Every spec announced for the run id, each with its announcer (``signer``)."""
        ...

    async def publish_run(self, run_key: Sealer, body: bytes, *, expires_at: float) -> None:
        """Publish a run (``node/published.py``) in its run key's slot under ``runs``."""
        ...

    async def find_runs(self) -> list[Envelope]:
        """Every run published under ``runs`` whose seal holds."""
        ...

    async def publish_allowlist(self, run_key: Sealer, body: bytes, *, expires_at: float) -> None:
        """Publish this run and spec's allowlist in its run key's slot."""
        ...

    async def find_allowlists(self) -> list[Envelope]:
        """Every allowlist under this run and spec whose seal holds (by any signer)."""
        ...

    async def publish_bans(self, body: bytes, *, expires_at: float) -> None:
        """Publish this node's ban records (``node/trust/board.py``) in its slot under this
        run and spec's ``bans``."""
        ...

    async def find_bans(self) -> list[Envelope]:
        """Every node's ban records under this run and spec whose seal holds."""
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
    sits above the hash, ``run/<run id>/specs``, where each node announces the spec it trains in
    its own slot, so a node whose spec differs can say which fields differ.

    Every value is sealed (:mod:`.envelope`) to its key, its signer's slot and its expiry; the
    DHT nodes of both backends refuse anything else before storing it, and a read checks each
    value again (what it drops is counted in ``rejected``). A leave is a sealed, empty value.

    A backend implements the two raw operations, ``_store`` and ``_get``, with deadlines.
    """

    def __init__(
        self, identity: Identity, *, run_id: str, spec_hash: bytes, call_timeout_seconds: float
    ) -> None:
        self._identity = identity
        self.run_id, self.spec_hash = run_id, spec_hash
        self._prefix = f"run/{run_id}/{spec_hash.hex()}"
        self._timeout = call_timeout_seconds
        #: The latest expiry this node stored under each key (its withdrawal must outlive it).
        self._announced_until: dict[str, float] = {}
        #: Records dropped on read, by reason.
        self.rejected: Counter[str] = Counter()

    @abc.abstractmethod
    async def _store(self, key: str, subkey: str, value: bytes, expires: float) -> bool:
        """Store one value; whether any DHT node took it."""

    @abc.abstractmethod
    async def _get(self, key: str) -> dict[str, tuple[bytes | None, float]]:
        """The unexpired values under ``key`` by subkey, with their expiry (None: a value that
        is not bytes)."""

    @property
    def call_timeout_seconds(self) -> float:
        """The deadline of each call into the DHT."""
        return self._timeout

    def for_spec(self, spec_hash: bytes) -> Self:
        """A view of the same DHT for another spec of this run (closing either closes both)."""
        return self.for_run(self.run_id, spec_hash)

    def for_run(self, run_id: str, spec_hash: bytes) -> Self:
        """A view of the same DHT for another run and spec (closing either closes both)."""
        view = copy.copy(self)
        view.run_id, view.spec_hash = run_id, spec_hash
        view._prefix = f"run/{run_id}/{spec_hash.hex()}"
        view._announced_until, view.rejected = {}, Counter()
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
            if await self._store(key, subkey, value, expires) or await self._holds(
                key, subkey, value
            ):
                return
        raise DiscoveryError("no DHT node accepted the record")

    async def _holds(self, key: str, subkey: str, value: bytes) -> bool:
        """Whether the DHT already holds ``value`` under (key, subkey). hivemind reports a store
        by the last replica's answer: one replica refusing (it holds this value already, from a
        try whose answer was lost) hides the others' yes, and a retry of the same value is then
        refused by all of them."""
        try:
            found = await self._get(key)
        except DiscoveryError:
            return False
        return found.get(subkey, (None, 0.0))[0] == value

    async def _seal_and_put(
        self, key: str, kind: Kind, body: bytes, *, issued_at: float, expires_at: float
    ) -> None:
        if expires_at - issued_at > MAX_TTL_SECONDS:
            raise ValueError(f"a DHT value may live at most {MAX_TTL_SECONDS:g} s")
        value = seal(
            self._identity,
            key=key,
            kind=kind,
            body=body,
            issued_at=issued_at,
            expires_at=expires_at,
        )
        await self._put(key, self._identity.peer_id, value, expires_at)
        self._announced_until[key] = max(self._announced_until.get(key, 0.0), expires_at)

    async def announce(self, record: PeerRecord) -> None:
        await self._announce(record, "peers", Kind.PEER)

    async def announce_ready(self, record: ReadyRecord) -> None:
        await self._announce(record, f"round/{record.round}", Kind.READY)

    async def _announce(self, record: PeerRecord | ReadyRecord, topic: str, kind: Kind) -> None:
        if record.peer_id != self._identity.peer_id:
            raise ValueError("a node announces its own record only")
        await self._seal_and_put(
            self._topic_key(topic),
            kind,
            record.body(),
            issued_at=record.issued_at,
            expires_at=record.expires_at,
        )

    async def announce_spec(self, canonical: bytes, *, expires_at: float) -> None:
        if len(canonical) > MAX_SPEC_BYTES:
            raise ValueError("the canonical run spec is too large to announce")
        await self._seal_and_put(
            self._specs_key, Kind.SPEC, canonical, issued_at=dht_time(), expires_at=expires_at
        )

    @property
    def _specs_key(self) -> str:
        return f"run/{self.run_id}/specs"

    async def _valid(self, key: str) -> list[tuple[Envelope, PeerRecord | ReadyRecord | None]]:
        """The values under ``key`` that pass the check of :func:`validate`, leaves left out,
        each with the record it carries (peers, readiness); what fails is counted in
        ``rejected``, by reason."""
        now = dht_time()
        found = []
        for subkey, (data, expires) in (await self._get(key)).items():
            try:
                envelope, record = open_checked(key, subkey, data, expires, now)
            except RecordError as error:
                self.rejected[str(error)[:48]] += 1
                log.debug("dropped a value under %r: %s", subkey[:64], error)
                continue
            if envelope.kind != Kind.LEAVE:
                found.append((envelope, record))
        return found

    async def publish_run(self, run_key: Sealer, body: bytes, *, expires_at: float) -> None:
        """Publish a run under ``runs``, sealed by its organizer's ``run_key`` (its slot)."""
        await self._put_sealed_by(run_key, RUNS_KEY, Kind.RUN, body, expires_at=expires_at)

    async def find_runs(self) -> list[Envelope]:
        """The runs published under ``runs`` whose seals hold (the body is the reader's to
        check)."""
        return [envelope for envelope, _ in await self._valid(RUNS_KEY)]

    async def publish_allowlist(self, run_key: Sealer, body: bytes, *, expires_at: float) -> None:
        """This run and spec's allowlist, sealed by ``run_key`` in its slot."""
        await self._put_sealed_by(run_key, self._topic_key("allowlist"), Kind.ALLOWLIST, body,
                                  expires_at=expires_at)  # fmt: skip

    async def find_allowlists(self) -> list[Envelope]:
        return [envelope for envelope, _ in await self._valid(self._topic_key("allowlist"))]

    async def publish_bans(self, body: bytes, *, expires_at: float) -> None:
        if len(body) > MAX_SPEC_BYTES:
            raise ValueError("the ban records are too large to publish")
        await self._seal_and_put(
            self._topic_key("bans"), Kind.BANS, body, issued_at=dht_time(), expires_at=expires_at
        )

    async def find_bans(self) -> list[Envelope]:
        return [envelope for envelope, _ in await self._valid(self._topic_key("bans"))]

    async def _put_sealed_by(
        self, sealer: Sealer, key: str, kind: Kind, body: bytes, *, expires_at: float
    ) -> None:
        """Store ``body`` sealed by another key than this node's (a run key) in its slot."""
        if len(body) > MAX_SPEC_BYTES:
            raise ValueError("the value is too large")
        now = dht_time()
        if expires_at - now > MAX_TTL_SECONDS:
            raise ValueError(f"a DHT value may live at most {MAX_TTL_SECONDS:g} s")
        value = seal(sealer, key=key, kind=kind, body=body, issued_at=now, expires_at=expires_at)
        await self._put(key, peer_id_of(sealer.public_key), value, expires_at)

    async def find_specs(self) -> dict[str, bytes]:
        return {
            hashlib.sha256(envelope.body).hexdigest(): envelope.body
            for envelope, _ in await self._valid(self._specs_key)
        }

    async def find_spec_announcements(self) -> list[Envelope]:
        return [envelope for envelope, _ in await self._valid(self._specs_key)]

    async def leave(self, topic: str = "peers") -> None:
        """Overwrite this node's record under ``topic`` with a sealed, empty value.

        The DHT keeps the value with the latest expiry, so the withdrawal must outlive the last
        record announced under ``topic``, and only that one: a later record there (another
        attempt at the same round) must in turn outlive the withdrawal.
        """
        now = dht_time()
        key = self._topic_key(topic)
        expires = max(self._announced_until.get(key, 0.0), now) + 1.0
        await self._seal_and_put(key, Kind.LEAVE, b"", issued_at=now, expires_at=expires)

    async def find(self) -> list[PeerRecord]:
        found = await self._valid(self._topic_key("peers"))
        return sorted((r for _, r in found if isinstance(r, PeerRecord)), key=lambda r: r.peer_id)

    async def find_ready(self, round_: int) -> list[ReadyRecord]:
        found = await self._valid(self._topic_key(f"round/{round_}"))
        return sorted((r for _, r in found if isinstance(r, ReadyRecord)), key=lambda r: r.peer_id)
