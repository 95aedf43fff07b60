"""Whom a node's relay serves: a peer with a live record in the node's run (read again, within
limits, when its record is not known yet) and, in a private run, a place on the allowlist."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.discovery.records import PeerRecord

log = logging.getLogger(__name__)


class RelayAdmission:
    """A node's :data:`Admit`: peers with a live record in its run, and on its allowlist if the run
    is private (``allowed``; None: an open run).

    A NAT'd node announces its record (its LAN address, reachability unknown) when it joins,
    before its dial-back checks find it needs a relay; but ``peers``, the node's table of the
    run, may be older than that. So a peer not in it waits for the table to be read again
    (``reread``), one read every ``reread_seconds`` at most, shared by every hello waiting: a
    stranger's hellos cost the DHT one read every few seconds, not one each. Any record will do,
    whatever reachability it announces."""

    def __init__(
        self,
        *,
        peers: Callable[[], Sequence[PeerRecord]],
        reread: Callable[[], Awaitable[object]],
        allowed: Callable[[str], bool] | None = None,
        reread_seconds: float = 2.0,
    ) -> None:
        self._peers, self._reread, self._allowed = peers, reread, allowed
        self._reread_seconds = reread_seconds
        self._read_started = float("-inf")  # loop time
        self._reading: asyncio.Future[object] | None = None

    async def __call__(self, peer_id: str) -> str | None:
        if self._allowed is not None and not self._allowed(peer_id):
            return "not on this run's allowlist"
        if self._live(peer_id):
            return None
        await self._read_since(asyncio.get_running_loop().time())
        return None if self._live(peer_id) else "no live record in this run"

    def _live(self, peer_id: str) -> bool:
        now = dht_time()
        return any(p.peer_id == peer_id and p.expires_at > now for p in self._peers())

    async def _read_since(self, asked_at: float) -> None:
        """Until a read of the table that began at ``asked_at`` or later has ended."""
        loop = asyncio.get_running_loop()
        while True:
            began_after = self._read_started >= asked_at
            if self._reading is not None:
                # Shielded: one waiter's deadline does not cancel the read others wait on.
                await asyncio.shield(self._reading)
                if began_after:
                    return
            elif began_after:
                return
            else:
                wait = self._read_started + self._reread_seconds - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                else:
                    self._read_started = loop.time()
                    self._reading = asyncio.ensure_future(self._read())

    async def _read(self) -> object:
        try:
            return await self._reread()
        finally:
            self._reading = None
