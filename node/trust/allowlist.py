"""A private run's allowlist: the peers its run key lets in, read from the DHT and kept fresh.

The organizer's ``swarmgrad publish --allowlist FILE`` seals ``{version, peers}`` by the run key
under ``run/<id>/<spec hash>/allowlist`` and publishes a new version whenever the file changes.
Every node of the run reads it every few seconds, believes only the run key the spec names
(``trust.run_key``), and moves to a higher version only: an old copy replayed into the DHT
changes nothing. Until a node has read one, it admits nobody (a private run fails closed); if
the publisher stops, nodes keep the last version they read.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from swarmgrad.node.discovery.base import DiscoveryError
from swarmgrad.node.discovery.envelope import Envelope

log = logging.getLogger(__name__)

#: How often a node reads the allowlist again.
REFRESH_SECONDS = 5.0
PEER_ID = re.compile(r"sg[a-z2-7]{20,62}")


class AllowlistError(ValueError):
    """An allowlist that does not parse."""


@dataclass(frozen=True, slots=True)
class Allowlist:
    version: int
    peers: frozenset[str]

    def body(self) -> bytes:
        raw = {"version": self.version, "peers": sorted(self.peers)}
        return json.dumps(raw, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, body: bytes) -> Allowlist:
        try:
            raw = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise AllowlistError("not JSON") from None
        except RecursionError:  # "[[[[..." is deeper than the parser's stack allows
            raise AllowlistError("nested too deeply") from None
        if not isinstance(raw, dict) or set(raw) != {"version", "peers"}:
            raise AllowlistError("not an allowlist")
        version, peers = raw["version"], raw["peers"]
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise AllowlistError("a bad version")
        if not isinstance(peers, list) or not all(
            isinstance(p, str) and PEER_ID.fullmatch(p) for p in peers
        ):
            raise AllowlistError("peers must be peer ids")
        return cls(version=version, peers=frozenset(peers))


#: Reads the allowlists filed under the run (the run's DHT).
Read = Callable[[], Awaitable[list[Envelope]]]


class AllowlistWatcher:
    """This node's view of its private run's allowlist."""

    def __init__(self, run_key_id: str, me: str) -> None:
        self.run_key_id, self.me = run_key_id, me
        self.current: Allowlist | None = None

    def allowed(self, peer_id: str) -> bool:
        current = self.current
        return current is not None and peer_id in current.peers

    def take(self, envelopes: Sequence[Envelope]) -> bool:
        """Adopt the newest valid allowlist the run key sealed; whether it changed."""
        best: Allowlist | None = None
        for envelope in envelopes:
            if envelope.signer != self.run_key_id:
                continue  # anyone may file a value there; only the run key's counts
            try:
                candidate = Allowlist.parse(envelope.body)
            except AllowlistError as error:
                log.warning("an allowlist sealed by the run key does not parse: %s", error)
                continue
            if best is None or candidate.version > best.version:
                best = candidate
        if best is None or (self.current is not None and best.version <= self.current.version):
            return False
        before = self.current.peers if self.current is not None else frozenset()
        self.current = best
        log.info(
            "allowlist version %d: %d peer(s) (+%d, -%d)%s",
            best.version,
            len(best.peers),
            len(best.peers - before),
            len(before - best.peers),
            "" if self.me in best.peers else f"; this node ({self.me}) is NOT on it",
        )
        return True

    async def refresh(self, read: Read) -> bool:
        """Adopt the newest allowlist ``read`` finds (the run's DHT); whether it changed."""
        try:
            return self.take(await read())
        except DiscoveryError as error:
            log.warning("could not read the allowlist (keeping version %s): %s",
                        self.current.version if self.current else "none", error)  # fmt: skip
            return False

    async def run(self, read: Read, changed: Callable[[], None] = lambda: None) -> None:
        """Read the allowlist every :data:`REFRESH_SECONDS` (``changed`` after a new one)."""
        while True:
            if await self.refresh(read):
                changed()
            await asyncio.sleep(REFRESH_SECONDS)
