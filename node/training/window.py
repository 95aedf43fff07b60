"""When a DiLoCo replica's round is due, if not every ``inner_steps`` steps: a time window
(``algorithm.round_seconds``).

A round of a fixed step count ends minutes apart on machines of different speeds: the fast ones
wait for the slow ones in matchmaking (at most its timeout), or the slow ones miss the round.
With a window, every replica trains for the same wall-clock time since its last round (as many
inner steps as fit, at least one) and comes to the round with its own samples as its weight.
Members of one group leave a round within moments of each other, so their next windows end
together; a replica that resynced or missed a round starts its window then. The discrete-event
model computes a window's steps with :func:`steps_in_window`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from swarmgrad.node.training.diloco import DiLoCo

if TYPE_CHECKING:
    from swarmgrad.node.training.replica import RoundReport
    from swarmgrad.node.training.sync import SyncDataParallel


def steps_in_window(window_seconds: float, step_seconds: float) -> int:
    """The inner steps a replica whose steps take ``step_seconds`` trains in a window: it steps
    until the window has passed, so the last one may end after it (and one at the least)."""
    return max(1, math.ceil(window_seconds / step_seconds - 1e-9))


class RoundWindow:
    """A replica's time window: :meth:`due` once ``seconds`` have passed since :meth:`restart`
    (made: restarted)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not seconds > 0:
            raise ValueError(f"a round's window must be positive, got {seconds}")
        self.seconds, self._clock = seconds, clock
        self._started = clock()

    def restart(self) -> None:
        """A round just ended (or a resync): the next window starts now."""
        self._started = self._clock()

    def due(self) -> bool:
        return self._clock() - self._started >= self.seconds


def take_step(
    replica: DiLoCo | SyncDataParallel, window: RoundWindow | None, *, samples: int
) -> RoundReport | None:
    """One inner step of ``samples`` counted: the round, if one is due (every ``inner_steps``
    steps, or at the end of ``window``, which then starts again)."""
    if window is None:
        return replica.step(samples=samples)
    assert isinstance(replica, DiLoCo)  # the spec allows windows for DiLoCo only
    replica.count(samples)
    if not window.due():
        return None
    report = replica.boundary()
    window.restart()  # the round (or resync) just ended, or an overlapped one started
    return report
