"""Which replica of a stage gets a pipeline trainer's next microbatch.

The :class:`Router` picks, per microbatch per stage, the replica with the earliest projected
finish (the work already routed to it, and an EMA of the compute seconds per sample its replies
report); UNAVAILABLE bans a replica with exponential backoff (DRAINING, a replica joining or
leaving, pauses it for a second), DEADLINE_EXCEEDED doubles its EMA, RESOURCE_EXHAUSTED only
retries elsewhere.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: First ban of a replica that was unreachable; doubled at each further failure.
BAN_SECONDS = 15.0
#: A replica that answers DRAINING (joining, or leaving) is left alone this long.
DRAINING_PAUSE_SECONDS = 1.0
#: Weight of the newest measurement in a replica's seconds-per-sample average.
EMA_ALPHA = 0.3
#: A projection is an estimate, off by more the slower the replica: new work is projected at
#: this much more than its pace, so a slower replica gets it only if clearly done sooner (on a
#: tie, the faster one takes it).
PROJECTION_MARGIN = 0.25


@dataclass(slots=True)
class StageReplica:
    """What the trainer knows of one replica of one stage."""

    peer_id: str
    endpoint: str
    stage: int
    seconds_per_sample: float | None = None  # an EMA of its compute seconds per sample
    reserved: float = 0.0  # seconds of work routed to it and not answered yet (estimated)
    banned_until: float = 0.0
    ban_seconds: float = BAN_SECONDS
    calls: int = 0
    samples: int = 0
    failures: int = 0


#: The most compute seconds a replica's report counts for, unless its calls' deadline is less.
MAX_REPORTED_SECONDS = 3600.0


class Router:
    """Per stage, the replicas known and how fast they answer."""

    def __init__(
        self,
        stages: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_seconds: float = MAX_REPORTED_SECONDS,
    ) -> None:
        """``max_seconds``: the most a replica's reported compute time counts for (a call's
        deadline: a longer one would have missed it)."""
        self.replicas: list[dict[str, StageReplica]] = [{} for _ in range(stages)]
        self._clock = clock
        self._max_seconds = max_seconds

    def update(self, stage: int, records: list[tuple[str, str]]) -> None:
        """The stage's replicas as its DHT records say (peer id, endpoint): new ones are added,
        ones whose records are gone dropped (a banned one keeps its ban if it comes back at the
        same endpoint; at another, it is a restarted process, and starts afresh)."""
        known = self.replicas[stage]
        live = dict(records)
        for peer_id in list(known):
            if peer_id not in live and known[peer_id].banned_until <= self._clock():
                del known[peer_id]
        for peer_id, endpoint in live.items():
            if not endpoint:
                continue
            replica = known.get(peer_id)
            if replica is None or replica.endpoint != endpoint:  # new, or a restarted process:
                known[peer_id] = StageReplica(peer_id, endpoint, stage)  # its ban is lifted

    def live(self, stage: int) -> list[StageReplica]:
        now = self._clock()
        return [r for r in self.replicas[stage].values() if r.banned_until <= now]

    def pick(
        self, stage: int, samples: int, *, exclude: frozenset[str] = frozenset()
    ) -> StageReplica | None:
        """The replica with the earliest projected finish: the work already routed to it, then
        ``samples`` at its pace (with :data:`PROJECTION_MARGIN`); on a tie, the faster; None if
        the stage has none live."""
        candidates = [r for r in self.live(stage) if r.peer_id not in exclude]
        if not candidates:
            return None
        fastest = self._fastest(candidates)

        def projected(replica: StageReplica) -> tuple[float, float]:
            pace = self._pace(replica, fastest)
            return replica.reserved + samples * pace * (1 + PROJECTION_MARGIN), pace

        return min(candidates, key=projected)

    def _fastest(self, replicas: list[StageReplica]) -> float:
        known = [r.seconds_per_sample for r in replicas if r.seconds_per_sample is not None]
        return min(known) if known else 0.0  # a new replica is tried as if it were fastest

    def _pace(self, replica: StageReplica, fastest: float) -> float:
        pace = replica.seconds_per_sample
        return fastest if pace is None else pace

    def reserve(self, replica: StageReplica, samples: int) -> float:
        """Count ``samples`` of work routed to ``replica``; the seconds reserved (to release)."""
        estimate = samples * self._pace(replica, self._fastest(self.live(replica.stage)))
        replica.reserved += estimate
        return estimate

    def release(self, replica: StageReplica, reserved: float) -> None:
        replica.reserved = max(0.0, replica.reserved - reserved)

    def done(
        self, replica: StageReplica, compute_seconds: float, samples: int, *, forward: bool
    ) -> None:
        """A call of ``samples`` that took the replica ``compute_seconds`` (as it says; its
        queue is not its pace) was answered (``forward``: counted in the replica's share).
        The replica's word is kept to a non-negative finite number: a negative pace would win
        it every pick."""
        if math.isnan(compute_seconds):
            compute_seconds = self._max_seconds
        per_sample = min(max(compute_seconds, 0.0), self._max_seconds) / max(samples, 1)
        ema = replica.seconds_per_sample
        replica.seconds_per_sample = (
            per_sample if ema is None else EMA_ALPHA * per_sample + (1 - EMA_ALPHA) * ema
        )
        replica.calls += 1
        replica.samples += samples if forward else 0
        replica.ban_seconds = BAN_SECONDS

    def penalize(self, replica: StageReplica) -> None:
        """It missed a deadline: route less to it, but keep it."""
        replica.failures += 1
        replica.seconds_per_sample = 2 * (replica.seconds_per_sample or 1.0)

    def pause(self, replica: StageReplica, seconds: float) -> None:
        """It is joining or leaving (DRAINING): none of its work for ``seconds``, no backoff."""
        replica.banned_until = max(replica.banned_until, self._clock() + seconds)

    def ban(self, replica: StageReplica) -> None:
        """It is unreachable: none of its work for a while (longer each time it fails again
        after a ban; the calls in flight when it failed count once)."""
        replica.failures += 1
        if replica.banned_until > self._clock():
            return
        replica.banned_until = self._clock() + replica.ban_seconds
        replica.ban_seconds *= 2
