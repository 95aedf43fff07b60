"""A stage replica's round barrier, shared by the run's trainers.

Every trainer asks every stage replica for round ``r`` (``Sync``) after its ``r x inner_steps``
steps. Were the first request to start the round, the microbatches another trainer still has in
flight would land after it: their samples go into the next round, and after the last round
they are never applied. So a replica starts round ``r`` once every trainer it has heard from
lately (any request within ``active_seconds``) has asked for it. A trainer that went quiet
(killed, or done with its run) stops being waited for after ``active_seconds``; no wait lasts
beyond ``wait_seconds`` (the trainers' Sync deadline leaves room for it), after which the round
runs with whoever arrived: the barrier degrades to "the first starts it", never to a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

#: A trainer heard from within this long is one a round waits for.
ACTIVE_SECONDS = 10.0
#: The longest a round waits for trainers (the trainer's Sync deadline allows 30 s beyond the
#: round's own matchmaking and all-reduce).
WAIT_SECONDS = 20.0
#: How often a waiting round looks again at trainers that might have gone quiet.
_POLL_SECONDS = 0.25


class RoundBarrier:
    """Which trainers are active, and which have asked for which round."""

    def __init__(
        self,
        *,
        active_seconds: float = ACTIVE_SECONDS,
        wait_seconds: float = WAIT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.active_seconds, self.wait_seconds = active_seconds, wait_seconds
        self._clock = clock
        self._heard: dict[str, float] = {}
        self._arrived: dict[int, set[str]] = {}
        self._changed = asyncio.Event()
        #: Rounds that ran without a trainer that was still active when the wait gave up.
        self.timed_out = 0

    def heard(self, trainer: str) -> None:
        """``trainer`` sent a request now."""
        self._heard[trainer] = self._clock()

    def missing(self, round_: int) -> set[str]:
        """Active trainers that have not asked for ``round_`` yet."""
        now, arrived = self._clock(), self._arrived.get(round_, set())
        return {
            trainer
            for trainer, at in self._heard.items()
            if now - at <= self.active_seconds and trainer not in arrived
        }

    async def wait(self, round_: int, trainer: str) -> None:
        """Until every active trainer has asked for ``round_`` (``trainer`` just did), or the
        wait's deadline."""
        self.heard(trainer)
        self._arrived.setdefault(round_, set()).add(trainer)
        for old in [r for r in self._arrived if r < round_ - 1]:
            del self._arrived[old]
        self._changed.set()
        self._changed = asyncio.Event()
        deadline = self._clock() + self.wait_seconds
        while self.missing(round_):
            left = deadline - self._clock()
            if left <= 0:
                self.timed_out += 1
                return
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, _POLL_SECONDS))
