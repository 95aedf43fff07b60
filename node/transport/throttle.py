"""A token bucket on the node's uploads (averaging and state): slow links for simulations."""

from __future__ import annotations

import asyncio


class TokenBucket:
    """Let ``rate_bytes_per_second`` through on average, in bursts of at most ``burst_seconds``
    worth (a small bucket, as a shaped home uplink has: a long transfer runs at the rate).

    Used as the all-reduce's ``RoundHooks``: each outgoing chunk waits for its bytes' tokens.
    """

    def __init__(self, rate_bytes_per_second: float, *, burst_seconds: float = 0.1) -> None:
        if not rate_bytes_per_second > 0 or not burst_seconds > 0:
            raise ValueError("rate_bytes_per_second and burst_seconds must be positive")
        self.rate = rate_bytes_per_second
        self.burst = rate_bytes_per_second * burst_seconds
        self._tokens = self.burst
        self._updated: float | None = None
        self._lock = asyncio.Lock()

    async def take(self, num_bytes: int) -> None:
        async with self._lock:  # one waiter at a time: first come, first served
            loop = asyncio.get_running_loop()
            now = loop.time()
            if self._updated is not None:
                self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.rate)
            self._updated = now
            self._tokens -= num_bytes
            if self._tokens < 0:  # in debt: wait until it is paid off
                await asyncio.sleep(-self._tokens / self.rate)
                self._updated, self._tokens = loop.time(), 0.0

    async def before_send(self, owner: int, index: int, payload: bytes) -> bytes:
        await self.take(len(payload))
        return payload
