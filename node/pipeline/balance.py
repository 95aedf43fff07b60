"""Where a stage server should serve: ``--stage auto`` on joining, and rebalancing afterwards.

A pipeline runs as fast as its slowest stage, and a stage's capacity is the sum of its replicas'
throughputs (samples/s, from their signed DHT records). ``auto`` joins the stage with the least
capacity (then the fewest replicas, then the lowest index: an empty swarm fills evenly).

Rebalancing (Petals' rule, applied per stage): every replica looks at all stages from time to
time and computes the same plan from the same records: move one replica of the strongest stage
(the lowest peer id: a choice that holds while measured throughputs wobble) to the weakest one,
once every replica has measured its throughput where it serves, if that raises the pipeline's
capacity (its weakest stage's) by more than ``1 / hysteresis`` and leaves the source stage a
replica. Only the replica the plan names moves, and only once two consecutive checks agree and
saw the same replicas (records settle between them), so two replicas never move at once; a
replica behind a relay never moves. After a move the weakest stage is no longer the same, so the
plan is empty: there is no thrash.

A move takes a while: the replica drains, leaves its stage's group (its record is withdrawn),
starts again in the other stage and downloads that group's state. While it is on its way it is
in no stage, and the others' plans would count its source stage short and move a second replica
after it (a loaded machine's CI once saw three moves where one was due). So a replica that
leaves (or starts draining) is waited for (:class:`Settling`): no plan until it serves again,
in any stage, or :data:`SETTLE_CHECKS` checks have passed without it (it died).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

#: Move only if the pipeline's capacity would grow by more than 1 / HYSTERESIS (Petals: 0.75).
HYSTERESIS = 0.75
#: Checks a replica that left its stage is waited for (it may be moving) before plans go on.
SETTLE_CHECKS = 5


@dataclass(frozen=True, slots=True)
class Replica:
    peer_id: str
    throughput: float  # samples per second


@dataclass(frozen=True, slots=True)
class Move:
    peer_id: str
    source: int
    target: int


def capacity(replicas: list[Replica]) -> float:
    return sum(r.throughput for r in replicas)


def choose_stage(stages: list[list[Replica]]) -> int:
    """The stage a joining replica should serve."""
    return min(range(len(stages)), key=lambda k: (capacity(stages[k]), len(stages[k]), k))


def plan_move(stages: list[list[Replica]], *, hysteresis: float = HYSTERESIS) -> Move | None:
    """The move that raises the weakest stage's capacity past the hysteresis, if any; none
    while a replica has not measured its throughput yet (a stage with no replica is empty)."""
    if any(r.throughput <= 0 for stage in stages for r in stage):
        return None
    capacities = [capacity(s) for s in stages]
    target = min(range(len(stages)), key=lambda k: (capacities[k], len(stages[k]), k))
    source = max(range(len(stages)), key=lambda k: (capacities[k], len(stages[k]), -k))
    if source == target or len(stages[source]) < 2:
        return None
    mover = min(stages[source], key=lambda r: r.peer_id)  # stable while throughputs wobble
    after = list(capacities)
    after[source] -= mover.throughput
    after[target] += mover.throughput
    if not min(after) * hysteresis > min(capacities):
        return None
    return Move(mover.peer_id, source, target)


class Settling:
    """Whether any replica is on its way between stages, from one check's view to the next: a
    replica seen serving that is no longer (draining, or gone) is waited for until it serves
    again, in any stage, or ``checks`` more checks have passed without it."""

    def __init__(self, checks: int = SETTLE_CHECKS) -> None:
        self._checks = checks
        self._serving: frozenset[str] = frozenset()
        #: Replicas waited for, with the checks left to wait.
        self.away: dict[str, int] = {}

    def settled(self, serving: Iterable[str]) -> bool:
        """Take one check's view (the replicas serving now, in every stage); whether nobody is
        away."""
        now = frozenset(serving)
        for peer in list(self.away):
            self.away[peer] -= 1
            if peer in now or self.away[peer] <= 0:
                del self.away[peer]
        for peer in self._serving - now:
            self.away[peer] = self._checks
        self._serving = now
        return not self.away
