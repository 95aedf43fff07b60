"""Open runs: ban records in the DHT, each carrying evidence that every reader checks for itself.

A node that convicts a peer on evidence (``node/averaging/open/evidence.py``: equivocation, a forged
commitment, a false secret) publishes it under ``run/<id>/<spec hash>/bans``, in its own slot,
with the evidence of every ban it holds (its own and those it adopted), newest first, as many as
fit one DHT value. Every node of the run reads the others' records every
:data:`REFRESH_SECONDS` and checks each piece of evidence itself against the run and spec; what
holds bans the peer it convicts (:meth:`TrustLedger.adopt`), and what does not is counted and
ignored. The publisher's word counts for nothing: a record is only a carrier, so a liar can file
records but cannot make anyone ban an honest peer. A node never bans itself on anyone's evidence.

Records are re-published every round of refresh (a DHT value lives :data:`TTL_SECONDS`), so a
ban's evidence stays findable while any node that holds it runs; a node that joins later reads
it then. A body already checked is not checked again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

from google.protobuf.message import DecodeError

from swarmgrad.node.discovery.base import DiscoveryError, dht_time
from swarmgrad.node.discovery.envelope import Envelope
from swarmgrad.node.discovery.records import MAX_SPEC_BYTES
from swarmgrad.node.trust.ledger import Flag, TrustLedger
from swarmgrad.protocol.v1 import averaging_pb2

log = logging.getLogger(__name__)

#: How often a node publishes its records and reads the others'.
REFRESH_SECONDS = 10.0
#: How long a published record lives in the DHT (it is refreshed long before).
TTL_SECONDS = 60.0
#: The most evidence read from one node's record, and new records checked per refresh (a
#: flood of records from throwaway keys costs a bounded amount of checking each time).
MAX_ITEMS = 64
MAX_RECORDS = 64
#: Record bodies already checked (by SHA-256), not checked again.
_MEMORY = 4096

#: Checks one piece of serialized evidence; (the peer it convicts, of what, the round), or
#: raises ValueError.
Verify = Callable[[bytes], tuple[str, Flag, int]]


class Channel(Protocol):
    """Where ban records are filed (:class:`~swarmgrad.node.discovery.base.Discovery`)."""

    async def publish_bans(self, body: bytes, *, expires_at: float) -> None: ...

    async def find_bans(self) -> list[Envelope]: ...


class BanBoard:
    """This node's side of the run's published bans."""

    def __init__(self, ledger: TrustLedger, *, me: str, verify: Verify, channel: Channel) -> None:
        self.ledger, self.me, self.verify = ledger, me, verify
        #: Where every node's records are read and this node's published (the run's DHT).
        self.channel = channel
        #: Evidence read, by outcome: "adopted", "known" (already banned on evidence),
        #: "rejected", "against_me"; and records "published".
        self.counts: Counter[str] = Counter()
        self._seen: dict[bytes, None] = {}
        self._published = b""

    def body(self) -> bytes:
        """This node's records: the evidence of its bans, newest first, as many as fit."""
        records = averaging_pb2.EvidenceList()
        size = 0
        for data in self.ledger.evidence()[:MAX_ITEMS]:
            item = averaging_pb2.Evidence.FromString(data)
            grown = size + len(data) + 8  # the field's tag and length
            if grown > MAX_SPEC_BYTES:
                break
            records.items.append(item)
            size = grown
        return records.SerializeToString(deterministic=True) if records.items else b""

    def take(self, envelopes: Sequence[Envelope]) -> int:
        """Check the evidence in other nodes' records and adopt what holds; the bans adopted."""
        adopted = checked = 0
        for envelope in envelopes:
            if envelope.signer == self.me:
                continue
            digest = hashlib.sha256(envelope.body).digest()
            if digest in self._seen:
                continue
            if checked == MAX_RECORDS:
                break  # the rest next time
            checked += 1
            self._remember(digest)
            try:
                records = averaging_pb2.EvidenceList.FromString(envelope.body)
            except DecodeError:
                self.counts["rejected"] += 1
                log.info("ban records of %s do not parse", envelope.signer)
                continue
            for item in records.items[:MAX_ITEMS]:
                adopted += self._check(item, envelope.signer)
        return adopted

    def _check(self, item: averaging_pb2.Evidence, source: str) -> bool:
        data = item.SerializeToString(deterministic=True)
        try:
            accused, flag, round_ = self.verify(data)
        except ValueError as error:
            self.counts["rejected"] += 1
            log.info("evidence published by %s proves nothing: %s", source, error)
            return False
        if accused == self.me:
            self.counts["against_me"] += 1
            log.error("evidence published by %s convicts this node of %s in round %d: its key "
                      "signed contradicting statements", source, flag, round_)  # fmt: skip
            return False
        if self.ledger.adopt(accused, flag, round_, data, source):
            self.counts["adopted"] += 1
            return True
        self.counts["known"] += 1
        return False

    def _remember(self, digest: bytes) -> None:
        self._seen[digest] = None
        while len(self._seen) > _MEMORY:
            self._seen.pop(next(iter(self._seen)))

    async def refresh(self) -> int:
        """Publish this node's records (if it has any), then read and check the others'."""
        body = self.body()
        try:
            if body or self._published:
                await self.channel.publish_bans(body, expires_at=dht_time() + TTL_SECONDS)
                self._published = body
                self.counts["published"] += bool(body)
            envelopes = await self.channel.find_bans()
            return await asyncio.to_thread(self.take, envelopes)  # signatures: off the loop
        except DiscoveryError as error:
            log.warning("could not exchange ban records: %s", error)
            return 0

    async def run(self, changed: Callable[[], None] = lambda: None) -> None:
        """:meth:`refresh` every :data:`REFRESH_SECONDS` (``changed`` after new bans)."""
        while True:
            if await self.refresh():
                changed()
            await asyncio.sleep(REFRESH_SECONDS)
