"""Who a peer waits for in a round's matchmaking: its census of the run's peer records.

The census says which members are expected at the round, how the round is cut into buckets and
which bucket is this peer's, and in which order newcomers are asked whether they are there
(``membership.py``); ``matchmaking.py`` decides, from it and the readiness records, when to stop
waiting and which groups to cut.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TypeVar

from swarmgrad.node.averaging.grouping import bucket_count, bucket_of, group_order
from swarmgrad.node.averaging.membership import Probes
from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.discovery.records import PeerRecord, ReadyRecord

R = TypeVar("R", PeerRecord, ReadyRecord)


@dataclass(frozen=True, slots=True)
class Census:
    """One read of the run's peer records for a round, as matchmaking uses it."""

    round: int
    expected: set[str]  # members at the round or one behind (and this peer)
    ahead: bool  # another member is past the round
    buckets: int
    mine: int  # this peer's bucket
    #: The expected peers of this peer's bucket (None: me), and newcomers whose answer to a
    #: probe is not in yet (waited for until it is).
    wanted: dict[str, PeerRecord | None]
    pending: frozenset[str]  # newcomers asked, not answered yet

    def in_bucket(self, peer_id: str) -> bool:
        return bucket_of(self.round, peer_id, self.buckets) == self.mine


def take_census(
    round_: int,
    me: str,
    peers: list[PeerRecord],
    probes: Probes | None,
    excluded: Callable[[str], bool],
    group_size: int,
) -> Census:
    """Who should be ready for ``round_`` in this peer's bucket, and whether any other peer
    is past the round.

    Expected are those whose records say they are at it, or one behind (a peer that just
    finished the last round may not have announced it yet; a peer that died in it is waited
    for once, then its record falls two behind). Those who already finished it count too
    for the buckets: a slow peer must cut the round into as many buckets as the fast ones
    did, or it would wait in a bucket of its own for peers that are in others. With a
    membership, only members count (a flood of peer records would otherwise both be waited
    for and scatter the honest peers over buckets of their own); a newcomer being asked is
    waited for until it answers."""
    records = {p.peer_id: p for p in peers if p.peer_id != me}
    members, pending = list(records.values()), set()
    if probes is not None:
        members = []
        taking_part = [p for p in records.values() if p.epoch >= round_ - 1]
        for p in freshest_first(round_, taking_part):
            verdict = probes.verdict(p, exact=False)
            if verdict:
                members.append(p)
            elif verdict is None:
                pending.add(p.peer_id)
    counted = [p for p in members if not excluded(p.peer_id)]
    expected = {p.peer_id for p in counted if p.epoch in (round_ - 1, round_)} | {me}
    ahead = any(p.epoch > round_ for p in counted)
    taking = {p.peer_id for p in members if p.epoch >= round_ - 1} | {me}
    buckets = bucket_count(round_, taking, group_size)
    mine = bucket_of(round_, me, buckets)
    waiting = expected | {p for p in pending if records[p].epoch in (round_ - 1, round_)}
    wanted = {p: records.get(p) for p in waiting if bucket_of(round_, p, buckets) == mine}
    return Census(round_, expected, ahead, buckets, mine, wanted, frozenset(pending))


def freshest_first(round_: int, records: Collection[R]) -> list[R]:
    """``records`` in the order newcomers among them are asked (questions are bounded per
    round): the latest issued first (a flood stored ahead is older than honest records, issued
    as their nodes start matchmaking; a record dated ahead counts as issued now), then in the
    round's shuffle. Peers that see the same records ask the same ones."""
    now = dht_time()
    return sorted(records, key=lambda r: (-min(r.issued_at, now), group_order(round_, r.peer_id)))
