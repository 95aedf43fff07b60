"""Rounds on a shared clock: time windows that end at the same moments for every replica
(``algorithm.round_seconds``), and the rule that says which readiness records are in a slot's
round, alike for every peer that reads them.

A window measured from a replica's own last round ends when that replica's history says: a
peer that restarted, resynced or missed a round comes to matchmaking out of phase with the
rest. Under churn that is every round: in the discrete-event model's volunteer swarm (64 demo
peers, sessions of ~40 s) someone arrived between two peers' last reads of almost every round,
they cut different groups, and rounds took the matchmaking timeout (35 s median for 1 s of
compute) while the swarm kept 7% of its samples. So a window ends at a **slot boundary** of the
DHT clock (the records' clock: :func:`~swarmgrad.node.discovery.base.dht_time`), a multiple of
``round_seconds``: the first one at least a quarter slot away (:func:`window_end`; a round
must end within three quarters of a slot for its members to come to the next boundary), and a
replica stops stepping before a step would cross it. Every replica then comes to the round at
the same boundary, however it got there. A replica that missed a round checks at every quarter
slot of its window whether the swarm is ahead (:func:`checks`), and downloads the round's
outcome as soon as it is: at the boundary it would be late for the next round.

A readiness record belongs to the slot of the boundary nearest its signed ``issued_at``
(:func:`slot_of`) and counts only if it was signed at most :func:`slot_grace` after that
boundary (:func:`in_slot`): a record that comes later (a peer whose state download ran past
the boundary) is in no peer's groups, and its peer trains on to the next boundary, carrying what
it trained. No peer cuts before the grace has passed and its records had the settle time to
spread, so every peer reads the same candidates whenever it stopped waiting: nobody waits for
a late peer, and a late peer cannot split a round.
"""

from __future__ import annotations

import math

__all__ = [
    "MIN_WINDOW_SHARE",
    "SETTLE_SECONDS",
    "SLOT_GRACE_SECONDS",
    "SLOT_GRACE_SHARE",
    "checks",
    "in_slot",
    "shortest_slot",
    "slot_cut",
    "slot_grace",
    "slot_of",
    "window_end",
]

#: How long a readiness record is given to spread before peers read the candidates for a cut
#: (matchmaking's settle time, ``swarm_config.MATCHMAKING_SETTLE_SECONDS``).
SETTLE_SECONDS = 0.5

#: The most a slot's readiness records may be signed after its boundary: the donors' records
#: read before a round, and a busy event loop. ``SLOT_GRACE_SHARE`` of a slot for short slots.
SLOT_GRACE_SECONDS = 2.0
SLOT_GRACE_SHARE = 1 / 8


#: A window is at least this share of a slot: a round that ends later in its slot than the rest
#: trains on to the boundary after next.
MIN_WINDOW_SHARE = 0.25


def window_end(now: float, slot_seconds: float, step_seconds: float = 0.0) -> float:
    """The boundary (a multiple of ``slot_seconds`` on the DHT clock) at which a window opened
    at ``now`` ends: the first that leaves at least a quarter slot of training, and room for
    one step of ``step_seconds`` (a replica whose step would cross the boundary would sign its
    readiness past the slot's grace)."""
    if not slot_seconds > 0:
        raise ValueError(f"a slot must be positive, got {slot_seconds}")
    least = max(slot_seconds * MIN_WINDOW_SHARE, step_seconds)
    return math.ceil((now + least) / slot_seconds) * slot_seconds


def checks(opened: float, ends_at: float, slot_seconds: float) -> list[float]:
    """When a window opened at ``opened`` and ending at ``ends_at`` is checked (whether its
    replica is behind the swarm: it missed the last round, whose outcome it then downloads):
    at every quarter slot before the boundary, from the first after it opened. The first that
    finds the swarm's round landed leaves the most time for the download."""
    quarter = slot_seconds * MIN_WINDOW_SHARE
    marks = (ends_at - k * quarter for k in (3, 2, 1))
    return [t for t in marks if t > opened]


def slot_grace(slot_seconds: float) -> float:
    """How long after its boundary a slot's readiness record may be signed."""
    return min(SLOT_GRACE_SECONDS, slot_seconds * SLOT_GRACE_SHARE)


def shortest_slot() -> float:
    """The shortest slot whose round can be cut in time: nobody reads a slot's candidates
    before its grace (an eighth of a slot) and the settle time have passed, and that cut must
    come by three quarters of the slot: a blocking round must end by then, and an overlapped
    one cut later lands past the next boundary, whose records are then signed late (the model's
    calm 200 demo peers, overlapped: 22% utilization at 0.5 s slots, every other round without
    a group at 0.57 s, 90% and every round averaged at 0.8 s)."""
    # Slots this short have a grace of SLOT_GRACE_SHARE of themselves (it is capped at 16 s).
    return SETTLE_SECONDS / (1.0 - MIN_WINDOW_SHARE - SLOT_GRACE_SHARE)


def slot_cut(slot: int, slot_seconds: float) -> float:
    """When (DHT time) ``slot``'s grace ends: its last record is signed by then, and nobody
    reads its candidates for the cut before."""
    return slot * slot_seconds + slot_grace(slot_seconds)


def slot_of(issued_at: float, slot_seconds: float) -> int:
    """The slot (the index of its boundary) a readiness record signed at ``issued_at`` is in:
    the nearest boundary's."""
    return math.floor(issued_at / slot_seconds + 0.5)


def in_slot(issued_at: float, slot: int, slot_seconds: float) -> bool:
    """Whether a record signed at ``issued_at`` counts in ``slot``'s round: its slot, and signed
    no later than the grace after the boundary."""
    return slot_of(issued_at, slot_seconds) == slot and issued_at <= slot_cut(slot, slot_seconds)
