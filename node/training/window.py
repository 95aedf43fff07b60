"""When a DiLoCo replica's round is due, if not every ``inner_steps`` steps: a time window
(``algorithm.round_seconds``).

A round of a fixed step count ends minutes apart on machines of different speeds: the fast ones
wait for the slow ones in matchmaking (at most its timeout), or the slow ones miss the round.
With a window, every replica trains until the same moment and comes to the round with its own
samples as its weight. The window ends at a slot boundary of the DHT clock
(``averaging/slots.py``), so that a replica that restarted, resynced or missed a round comes to
the next round with the rest; it takes the last step that ends before the boundary (one at the
least). At every quarter slot a window is checked: a replica that missed the last round
downloads its outcome as soon as the swarm has it (``catch_up``), and still comes to the next
round in time, where at the boundary it would have been late for it. The discrete-event model
computes a window's steps with :func:`steps_in_window`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from swarmgrad.node.averaging.slots import checks, window_end
from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.training.diloco import DiLoCo

if TYPE_CHECKING:
    from swarmgrad.node.training.replica import RoundReport
    from swarmgrad.node.training.sync import SyncDataParallel


def steps_in_window(window_seconds: float, step_seconds: float) -> int:
    """The inner steps a replica whose steps take ``step_seconds`` trains in a window: as many as
    end within it (one at the least)."""
    return max(1, math.floor(window_seconds / step_seconds + 1e-9))


class RoundWindow:
    """A replica's time window: it ends at the slot boundary :func:`window_end` gives from the
    moment it opened (:meth:`restart`); :meth:`due` once one more step, as long as the last,
    would end past it; :meth:`check_due` at each of its :func:`checks`."""

    def __init__(self, seconds: float, clock: Callable[[], float] = dht_time) -> None:
        if not seconds > 0:
            raise ValueError(f"a round's window must be positive, got {seconds}")
        self.seconds, self._clock = seconds, clock
        self._step = 0.0  # the last step's time
        self.restart()

    def restart(self) -> None:
        """A round just ended (or a resync): the next window starts now, and ends at the first
        boundary that leaves room for a step as long as the last."""
        now = self._clock()
        self.ends_at = window_end(now, self.seconds, self._step)
        self._checks = checks(now, self.ends_at, self.seconds)
        self._last = now

    def due(self, step_seconds: float | None = None) -> bool:
        """A step just ended: whether the round is due (the next step would end past the
        boundary). ``step_seconds``: how long the step itself took, as its caller timed it;
        else the time since the last step (or the window's start), which after a round also
        holds the trainer's evaluation and checkpoint, and would end the window early."""
        now = self._clock()
        self._step = now - self._last if step_seconds is None else step_seconds
        self._last = now
        return now + self._step > self.ends_at

    def check_due(self) -> bool:
        """Whether one of the window's checks (``catch_up``) is due now (each once)."""
        now, due = self._clock(), False
        while self._checks and self._checks[0] <= now:
            self._checks.pop(0)
            due = True
        return due


def take_step(
    replica: DiLoCo | SyncDataParallel,
    window: RoundWindow | None,
    *,
    samples: int,
    step_seconds: float | None = None,
) -> RoundReport | None:
    """One inner step of ``samples`` (that took ``step_seconds``, if timed) counted: the round,
    if one is due (every ``inner_steps`` steps, or at the end of ``window``, which then starts
    again); in a window, a resync at its check if the replica is behind the swarm."""
    if window is None:
        return replica.step(samples=samples)
    assert isinstance(replica, DiLoCo)  # the spec allows windows for DiLoCo only
    replica.count(samples)
    if not window.due(step_seconds):
        if window.check_due() and not replica.overlap:  # overlapped: boundary() resyncs
            return replica.catch_up()
        return None
    report = replica.boundary()
    window.restart()  # the round (or resync) just ended, or an overlapped one started
    return report
