"""The run's directory as this node sees it: its own record, the run's peers, the spec check.

One ``PeerDirectory`` per node owns everything the node reads and writes under the ``peers``
topic and the run's spec slots. It refuses to join a run whose peers train another spec
(:class:`SpecMismatch`, with the differences spelled out); a node whose spec is tied to a run key
(joined or published under it, or the spec's ``trust.run_key``) heeds only the specs that key
published for the run (``node/published.py``), since anyone may announce a look-alike under a
run id. It keeps this node's signed record fresh
(every ``announce_interval_seconds``, and soon after :meth:`changed`), and holds the one cached
table of the run's peers that matchmaking, reachability, state sync and the metrics read.
Readiness records for rounds are matchmaking's (``averaging/matchmaking.py``), not this table's.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from swarmgrad.node.discovery.base import Discovery, DiscoveryError, dht_time
from swarmgrad.node.discovery.envelope import MAX_TTL_SECONDS
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.kinds import Failure
from swarmgrad.node.published import listings
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.scraped import Tallies
from swarmgrad.protocol.errors import SetupError

log = logging.getLogger(__name__)

#: Room under the DHT's lifetime cap for a leave, which outlives the record it withdraws.
MAX_RECORD_TTL_SECONDS = MAX_TTL_SECONDS - 30.0
#: Ignored specs, and announcers of each, named in the log (a DHT key holds thousands).
MAX_NAMED = 5


class SpecMismatch(SetupError):
    """This node's run spec differs from the one the run's peers use; the message says how."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DirectoryConfig:
    record_ttl_seconds: float = 60.0
    announce_interval_seconds: float = 15.0
    #: The run key (sg...) this node's run was joined or published under ("": none); with the
    #: spec's ``trust.run_key``, the keys whose published specs the spec check heeds.
    run_key_id: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.announce_interval_seconds < self.record_ttl_seconds:
            raise ValueError("announce_interval_seconds must be positive and below the TTL")
        if self.record_ttl_seconds > MAX_RECORD_TTL_SECONDS:
            raise ValueError(
                f"record_ttl_seconds must be at most {MAX_RECORD_TTL_SECONDS:g} (the DHT refuses "
                "longer-lived values)"
            )


class PeerDirectory:
    """This node's record in the run, and the run's peers as last read."""

    def __init__(
        self,
        discovery: Discovery,
        spec: RunSpec,
        config: DirectoryConfig,
        *,
        own_record: Callable[[float, float], PeerRecord],
        tallies: Tallies,
        seen: Callable[[int], None] = lambda num_peers: None,
    ) -> None:
        """``own_record(now, ttl_seconds)`` describes this node as it is now; ``seen`` hears
        how many peers each read found (a metric)."""
        self.discovery = discovery
        self.spec, self.config = spec, config
        self._own_record, self._tallies, self._seen = own_record, tallies, seen
        self._changed = asyncio.Event()
        self._closed = False
        self._ignored: set[str] = set()  # specs no run key of this node's published, logged
        #: The run's trainers as last read from the DHT (this node included).
        self.peers: list[PeerRecord] = []

    @property
    def run_keys(self) -> frozenset[str]:
        """The run keys this node's spec is tied to (empty: none, any announced spec counts)."""
        return frozenset(key for key in (self.config.run_key_id, self.spec.trust.run_key) if key)

    async def check_spec(self) -> None:
        """Refuse to join a run whose peers use another spec (and announce ours); with run keys,
        only another spec one of them published counts, the rest are logged and ignored."""
        mine = self.spec.hash.hex()
        specs: dict[str, bytes] = {}
        announcers: dict[str, list[str]] = {}
        for each in await self.discovery.find_spec_announcements():
            spec_hash = hashlib.sha256(each.body).hexdigest()
            specs[spec_hash] = each.body
            announcers.setdefault(spec_hash, []).append(each.signer)
        others = {h: body for h, body in specs.items() if h != mine}
        signed: dict[str, str] = {}
        if others and self.run_keys:
            signed = await self._signed_specs()
            self._ignore({h: announcers[h] for h in others if h not in signed})
            others = {h: body for h, body in others.items() if h in signed}
        if others and mine not in specs:
            first_hash, first = sorted(others.items())[0]
            diffs = "; ".join(self.spec.differences(first)) or "unknown fields"
            by = f", published by its run key {signed[first_hash]}" if first_hash in signed else ""
            raise SpecMismatch(
                f"run {self.spec.run.id!r} is being trained with a different run spec "
                f"({first_hash[:12]}{by}; yours is {mine[:12]}): {diffs}. Use the run's spec "
                f"file (or pick another run id) to join."
            )
        try:
            await self._announce_spec()
        except DiscoveryError as error:  # the announce loop publishes it again: not fatal
            self._tallies.failed("announce failed", Failure.DISCOVERY)
            log.warning("could not announce the run spec yet: %s", error)

    async def _signed_specs(self) -> dict[str, str]:
        """The specs (hex hash) of this node's run id that its run keys published -> the key;
        a pipeline's published spec vouches for its stages' specs too."""
        keys, run_id = self.run_keys, self.spec.run.id
        ours = [each for each in await self.discovery.find_runs() if each.signer in keys]
        signed = {}
        for listing in listings(ours):
            spec = listing.spec
            pipeline = spec.pipeline
            stages = (
                [spec.stage_spec(k) for k in range(pipeline.stages)] if pipeline.enabled else []
            )
            for each in (spec, *stages):
                if each.run.id == run_id:
                    signed[each.hash.hex()] = listing.run_key_id
        return signed

    def _ignore(self, announcers: dict[str, list[str]]) -> None:
        """Log each spec (hex hash) ignored, with who announced it, once."""
        new = sorted(set(announcers) - self._ignored)
        self._ignored.update(new)
        keys = ", ".join(sorted(self.run_keys))
        for spec_hash in new[:MAX_NAMED]:
            names = sorted(announcers[spec_hash])
            log.warning(
                "ignoring run spec %s announced under run %r by %s%s: no run key of this "
                "node's run (%s) published it",
                spec_hash[:12],
                self.spec.run.id,
                ", ".join(names[:MAX_NAMED]),
                f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "",
                keys,
            )
        if len(new) > MAX_NAMED:
            log.warning(
                "ignoring %d more run specs under run %r: no run key of this node's run (%s) "
                "published them",
                len(new) - MAX_NAMED,
                self.spec.run.id,
                keys,
            )

    async def _announce_spec(self) -> None:
        await self.discovery.announce_spec(
            self.spec.canonical(), expires_at=dht_time() + self.config.record_ttl_seconds
        )

    async def announce(self) -> None:
        """Announce this node's record and the run spec now, then read the run's peers."""
        await self.discovery.announce(self._own_record(dht_time(), self.config.record_ttl_seconds))
        await self._announce_spec()
        self._update(await self.discovery.find())

    def changed(self) -> None:
        """Re-announce soon: something in this node's record changed (call on the loop)."""
        self._changed.set()

    async def join(self) -> None:
        """Announce this node now; a DHT error is counted and left to :meth:`keep_fresh`."""
        try:
            await self.announce()
        except DiscoveryError as error:
            self._tallies.failed("announce failed", Failure.DISCOVERY)
            log.warning("could not announce this node yet: %s", error)

    async def keep_fresh(self) -> None:
        """Re-announce this node's record every interval, or soon after :meth:`changed`."""
        while True:
            try:
                async with asyncio.timeout(self.config.announce_interval_seconds):
                    await self._changed.wait()
            except TimeoutError:
                pass
            self._changed.clear()
            try:
                await self.announce()
            except DiscoveryError as error:
                self._tallies.failed("announce failed", Failure.DISCOVERY)
                log.warning("could not refresh this node's record: %s", error)

    async def refresh(self) -> list[PeerRecord]:
        """Read the run's peers again; on a DHT error, the last table (counted, logged)."""
        try:
            self._update(await self.discovery.find())
        except DiscoveryError as error:
            self._tallies.failed("discovery failed", Failure.DISCOVERY)
            log.warning("could not read the run's peers: %s", error)
        return self.peers

    def _update(self, peers: list[PeerRecord]) -> None:
        self.peers = peers
        self._seen(len(peers))

    async def withdraw(self, topic: str) -> None:
        """Withdraw this node's value under ``topic`` (best effort: it expires anyway)."""
        if self._closed:  # the graceful leave withdrew everything
            return
        try:
            await self.discovery.leave(topic)
        except DiscoveryError as error:
            log.debug("could not withdraw %s: %s", topic, error)

    async def leave(self) -> None:
        """Withdraw this node's record (a graceful leave); nothing is announced after it."""
        self._closed = True
        try:
            await self.discovery.leave()
        except DiscoveryError as error:
            log.warning("could not announce leave: %s", error)
