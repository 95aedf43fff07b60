"""A token bucket on the node's averaging uploads: slow links for ``swarmgrad simulate``."""

from __future__ import annotations

import asyncio


class TokenBucket:
    """Let ``rate_bytes_per_second`` through on average, in bursts of at most one second's worth.

    Used as the all-reduce's ``RoundHooks``: each outgoing chunk waits for its bytes' tokens.
    """

    def __init__(self, rate_bytes_per_second: float) -> None:
        if not rate_bytes_per_second > 0:
            raise ValueError("rate_bytes_per_second must be positive")
        self.rate = rate_bytes_per_second
        self._tokens = rate_bytes_per_second
        self._updated: float | None = None
        self._lock = asyncio.Lock()

    async def take(self, num_bytes: int) -> None:
        async with self._lock:  # one waiter at a time: first come, first served
            loop = asyncio.get_running_loop()
            now = loop.time()
            if self._updated is not None:
                self._tokens = min(self.rate, self._tokens + (now - self._updated) * self.rate)
            self._updated = now
            self._tokens -= num_bytes
            if self._tokens < 0:  # in debt: wait until it is paid off
                await asyncio.sleep(-self._tokens / self.rate)
                self._updated, self._tokens = loop.time(), 0.0

    async def before_send(self, owner: int, index: int, payload: bytes) -> bytes:
        await self.take(len(payload))
        return payload
