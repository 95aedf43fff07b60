"""Where a stage server should serve: ``--stage auto`` on joining, and rebalancing afterwards.

A pipeline runs as fast as its slowest stage, and a stage's capacity is the sum of its replicas'
throughputs (samples/s, from their signed DHT records). ``auto`` joins the stage with the least
capacity (then the fewest replicas, then the lowest index: an empty swarm fills evenly).

Rebalancing (Petals' rule, applied per stage): every replica looks at all stages from time to
time and computes the same plan from the same records: move one replica of the strongest stage
(the lowest peer id: a choice that holds while measured throughputs wobble) to the weakest one,
once every replica has measured its throughput where it serves, if that raises the pipeline's
capacity (its weakest stage's) by more than ``1 / hysteresis`` and leaves the source stage a
replica. Unlike Petals' blocks, stages differ in compute per sample: the mover is counted in
the target at what that stage's replicas serve relative to its own (:func:`serving_at`). Only
the replica the plan names moves, and only once two consecutive checks agree and saw the same
replicas (records settle between them), so two replicas never move at once; a replica behind a
relay never moves. After a move the weakest stage is no longer the same, so the plan is empty:
there is no thrash.

A move takes a while: the replica drains, leaves its stage's group (its record is withdrawn),
starts again in the other stage and downloads that group's state. While it is on its way it is
in no stage, and the others' plans would count its source stage short and move a second replica
after it (a loaded machine's CI once saw three moves where one was due). So a replica that
leaves (or starts draining) is waited for (:class:`Settling`): no plan until it serves again,
in any stage, or :data:`SETTLE_CHECKS` checks have passed without it (it died). Nor until the
stages have kept the same replicas, every one measured, for :data:`STEADY_CHECKS` checks: a
replica's first rates, and its neighbours' while it catches up, are not what they serve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Move only if the pipeline's capacity would grow by more than 1 / HYSTERESIS (Petals: 0.75).
HYSTERESIS = 0.75
#: Checks a replica that left its stage is waited for (it may be moving) before plans go on.
SETTLE_CHECKS = 5
#: Checks in a row that must see the same replicas, every one measured, before a plan.
STEADY_CHECKS = 3


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
    after[target] += serving_at(mover, stages[source], stages[target])
    if not min(after) * hysteresis > min(capacities):
        return None
    return Move(mover.peer_id, source, target)


def serving_at(mover: Replica, source: list[Replica], target: list[Replica]) -> float:
    """What ``mover`` would serve in the target stage: stages differ in compute per sample (a
    head stage's loss over the vocabulary), so its throughput in the source is scaled by the
    two stages' mean replica throughputs; into a stage nobody serves, it is taken as it is."""
    if not target:
        return mover.throughput
    return mover.throughput * (capacity(target) / len(target)) / (capacity(source) / len(source))


class Settling:
    """Whether the stages are settled enough to plan from, one check's view after another.

    A replica seen serving that is no longer (draining, or gone) is waited for until it serves
    again, in any stage, or ``checks`` more checks have passed without it. And the view must
    have been steady for ``steady`` checks: the same replicas in each stage, every one measured.
    What a replica measures first, and what its neighbours measure while it starts and
    downloads its stage's state, is not what they serve (CI once saw a stage's two replicas at
    a sixth of their rate while a moved one caught up, and a second replica moved after it)."""

    def __init__(self, checks: int = SETTLE_CHECKS, steady: int = STEADY_CHECKS) -> None:
        self._checks, self._steady = checks, steady
        self._view: tuple[frozenset[str], ...] = ()
        self._steady_for = 0
        #: Replicas waited for, with the checks left to wait.
        self.away: dict[str, int] = {}

    def settled(self, stages: Sequence[Sequence[Replica]]) -> bool:
        """Take one check's view (the replicas serving now, by stage); whether nobody is away
        and the view has been steady long enough."""
        view = tuple(frozenset(r.peer_id for r in stage) for stage in stages)
        before, now = frozenset().union(*self._view), frozenset().union(*view)
        for peer in list(self.away):
            self.away[peer] -= 1
            if peer in now or self.away[peer] <= 0:
                del self.away[peer]
        for peer in before - now:
            self.away[peer] = self._checks
        measured = all(r.throughput > 0 for stage in stages for r in stage)
        self._steady_for = self._steady_for + 1 if view == self._view and measured else 0
        self._view = view
        return not self.away and self._steady_for >= self._steady
