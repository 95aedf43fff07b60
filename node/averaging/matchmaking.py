"""Matchmaking without a leader: peers ready for round r form groups through the DHT.

Each peer announces a signed readiness record under ``round/<r>`` (its endpoint, bandwidth and
weight). The peers it expects in the round are those whose peer records say they are at epoch r or
r - 1 (a peer that just finished the last round may not have announced it yet). A swarm of many
groups is split into **buckets** by a hash of (round, peer id): a power of two of them, so each
expects two to four groups' worth of the round's peers (:func:`bucket_count`); a peer only waits
for, and only groups with, the peers of its own bucket. It reads the topic until every expected
peer of its bucket is a candidate (at least two), or its matchmaking timeout passes; then it waits
``settle_seconds`` for stragglers' records to spread, and reads once more. Its bucket's
candidates are ordered by a hash of (round, peer id), a fresh shuffle each round that every peer
computes alike, and cut into groups of ``group_size`` (a short last group joins the one before
it), none holding two peers of which one avoids the other: a node names its newest bans in its
readiness record, and keeps the peers it names among its candidates, so that every peer cuts
the same groups however their bans differ (``grouping.py``).

A peer that crashed (or froze, or lost its relay) leaves a peer record behind that says it is
still at the round, until the record expires: waiting for it would cost every round until then
a whole matchmaking timeout. So a peer waited for past ``PROBE_AFTER_SECONDS`` is asked who it
is (``alive``: a signed answer from its endpoint, under a deadline), if its record says peers
can dial it, and one that does not answer is no longer waited for in this round. Only the
waiting changes: a peer that does post its readiness in time is a candidate like any other.

Readiness records are signed, but keys cost nothing: a record counts, and a peer is waited for
and counted in the buckets, only if this node believes it is a live member of the run (a peer
it averaged with lately, or a newcomer with a peer record that answered a signed probe at its
endpoint: ``membership.py``, which says how honest nodes still agree). Throwaway keys that fill
the round keys with records, or the directory with peer records whose endpoints are dead, are
neither grouped with nor waited for. As it goes, matchmaking tells the averager (``expect``)
which peers may stream to this node in the round, before its own all-reduce starts.

Peers that saw the same candidates form the same groups. Waiting for the whole bucket, not for
the first ``group_size`` candidates, is what keeps them the same in a large swarm: peers that
become ready at different times would otherwise each cut a different prefix of the arrivals
(``simulate --engine des`` showed most rounds lost that way at 32 peers). A peer that still saw
a different set (a record that arrived between two peers' reads, or a census that put the
bucket count on the other side of a power of two) ends up in a group whose id its mates do not
share, its all-reduce streams are refused as UNKNOWN_ROUND, and the round counts as failed for
it: nothing hangs and nothing mixes. A peer that finds nobody returns None and trains on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from swarmgrad.node.averaging.group import Group, Member, bounded
from swarmgrad.node.averaging.grouping import assign_groups, bucket_count, bucket_of, group_order
from swarmgrad.node.averaging.membership import Alive, Membership, Probes
from swarmgrad.node.discovery.base import Discovery, dht_time
from swarmgrad.node.discovery.envelope import MAX_TTL_SECONDS
from swarmgrad.node.discovery.records import PeerRecord, ReadyRecord, avoid_tag, pack_avoids
from swarmgrad.node.identity import Identity
from swarmgrad.node.kinds import Reach

log = logging.getLogger(__name__)

#: A readiness record outlives its matchmaking by this much (stragglers still read it).
READY_MARGIN_SECONDS = 30.0
#: The longest matchmaking whose readiness record (and its withdrawal) a DHT still takes.
MAX_MATCHMAKING_TIMEOUT_SECONDS = MAX_TTL_SECONDS - READY_MARGIN_SECONDS - 30.0
#: How often matchmaking reads the candidates, and the run's peer records, while it waits; a
#: round key holding more than ``POLL_RECORDS`` records is read less often (``poll_pause``).
POLL_SECONDS = 0.1
POLL_RECORDS = 64
MAX_POLL_SECONDS = 0.4
EXPECTED_REFRESH_SECONDS = 1.0
#: How long matchmaking waits for a missing peer before asking whether it is still there, and
#: how often it asks again while that peer answers but is not ready (it is still training).
PROBE_AFTER_SECONDS = 1.0
PROBE_EVERY_SECONDS = 3.0
#: Told which peers may stream to this node in a round (the averager's ``expect``).
Expect = Callable[[int, Collection[str]], None]
R = TypeVar("R", PeerRecord, ReadyRecord)
#: The peers that can be asked: others have dialed them. One whose verdict is not in yet (a NAT'd
#: peer announces its LAN address until it has a relay) or that nobody can dial would not answer
#: anyway, and is waited for as before.
_DIALABLE = frozenset({Reach.DIRECT, Reach.UPNP, Reach.RELAYED})


@dataclass(frozen=True, slots=True)
class _Census:
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


class _Liveness:
    """Which of the peers a round waits for are gone: each missing one is asked (``alive``) once
    it has been waited for ``PROBE_AFTER_SECONDS``, again every ``PROBE_EVERY_SECONDS`` while it
    answers, in the background (the wait goes on polling meanwhile)."""

    def __init__(self, round_: int, alive: Alive | None) -> None:
        self._round, self._alive = round_, alive
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time()
        self._asked: dict[str, float] = {}
        self._probes: set[asyncio.Task[None]] = set()
        self.gone: set[str] = set()

    def check(self, missing: Collection[PeerRecord]) -> None:
        now = self._loop.time()
        if self._alive is None or now - self._started < PROBE_AFTER_SECONDS:
            return
        for record in missing:
            asked = self._asked.get(record.peer_id)
            if record.peer_id in self.gone or (asked and now - asked < PROBE_EVERY_SECONDS):
                continue
            self._asked[record.peer_id] = now
            probe = asyncio.create_task(self._probe(self._alive, record))
            self._probes.add(probe)
            probe.add_done_callback(self._probes.discard)

    async def _probe(self, alive: Alive, record: PeerRecord) -> None:
        if not await alive(record):
            log.info(
                "round %d: %s does not answer; not waiting for it", self._round, record.peer_id
            )
            self.gone.add(record.peer_id)

    def close(self) -> None:
        for probe in self._probes:
            probe.cancel()


def poll_pause(records: int) -> float:
    """The pause between two reads of a round's readiness that returned ``records`` records.
    Each read costs the DHT processes that answer it, and this one, a check per record: a
    round key flooded with 310 throwaway keys' records, read ten times a second by every
    waiting node, was most of what the flood still cost an honest swarm once stores were
    bounded (``discovery/check_budget.py``). Up to 64 records (an honest swarm's round, in
    most swarms) it is ``POLL_SECONDS``; beyond, longer in proportion, at most
    ``MAX_POLL_SECONDS``."""
    return min(MAX_POLL_SECONDS, POLL_SECONDS * max(1.0, records / POLL_RECORDS))


def _freshest_first(round_: int, records: Collection[R]) -> list[R]:
    """``records`` in the order newcomers among them are asked (questions are bounded per
    round): the latest issued first (a flood stored ahead is older than honest records, issued
    as their nodes start matchmaking; a record dated ahead counts as issued now), then in the
    round's shuffle. Peers that see the same records ask the same ones."""
    now = dht_time()
    return sorted(records, key=lambda r: (-min(r.issued_at, now), group_order(round_, r.peer_id)))


class Matchmaker:
    def __init__(
        self,
        discovery: Discovery,
        identity: Identity,
        *,
        group_size: int,
        matchmaking_timeout_seconds: float,
        settle_seconds: float = 0.5,
        peers: Callable[[], Awaitable[list[PeerRecord]]] | None = None,
        excluded: Callable[[str], bool] | None = None,
        avoiding: Callable[[], Sequence[str]] | None = None,
        alive: Alive | None = None,
        membership: Membership | None = None,
        expect: Expect | None = None,
    ) -> None:
        """``peers`` reads the run's peer records (the node's directory; default: the DHT);
        ``excluded`` says which peers this node no longer groups with (its trust ledger's bans):
        they are not waited for, and their readiness records are not candidates unless this
        node's own record names them as avoided: ``avoiding`` gives the peers it names (newest
        bans first; the first ``MAX_AVOIDS``), so that others cut the same groups; ``membership``
        says whose readiness counts (``membership.py``; None: every signed record, as in tests
        of the grouping rules alone); ``alive`` asks a peer that is late whether it is still
        there (default: the membership's probe; None without either: every expected peer is
        waited for until the timeout); ``expect`` is told, as matchmaking goes, which members
        may stream to this node in the round."""
        if group_size < 2:
            raise ValueError("group_size must be at least 2")
        if not 0 < matchmaking_timeout_seconds <= MAX_MATCHMAKING_TIMEOUT_SECONDS:
            raise ValueError(
                f"matchmaking_timeout_seconds must be in (0, {MAX_MATCHMAKING_TIMEOUT_SECONDS:g}]"
            )
        self._discovery, self._identity = discovery, identity
        self._peers = peers or discovery.find
        self.group_size = group_size
        self.timeout_seconds = matchmaking_timeout_seconds
        self.settle_seconds = settle_seconds
        self._excluded = excluded or (lambda _peer: False)
        self._avoiding = avoiding or (lambda: ())
        self.membership = membership
        if alive is None and membership is not None:
            alive = membership.alive
        self._alive = alive
        self._expect = expect

    async def form_group(
        self, round_: int, *, endpoint: str, bandwidth: float = 1.0, weight: float = 1.0
    ) -> Group | None:
        """This peer's group for ``round_``, or None if it found nobody in time."""
        now = dht_time()
        ready = ReadyRecord(
            peer_id=self._identity.peer_id,
            run_id=self._discovery.run_id,
            spec_hash=self._discovery.spec_hash.hex(),
            endpoint=endpoint,
            round=round_,
            bandwidth=bandwidth,
            weight=weight,
            issued_at=now,
            expires_at=now + self.timeout_seconds + READY_MARGIN_SECONDS,
            avoids=pack_avoids(p for p in self._avoiding() if p != self._identity.peer_id),
        )
        avoided = ready.avoided()
        await self._discovery.announce_ready(ready)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_seconds
        me = self._identity.peer_id
        probes = self.membership.session(round_) if self.membership is not None else None
        liveness = _Liveness(round_, self._alive)
        told: set[str] = set()
        try:
            peers, read_at = await self._read_peers(avoided), loop.time()
            records = {p.peer_id: p for p in peers if p.peer_id != me}
            # Readiness first: its signers' questions go before the census's.
            posted = await self._ready(round_, avoided)
            candidates = self._admit(round_, posted, records, probes)
            census = self._census(round_, peers, probes)
            while loop.time() < deadline:
                told = self._tell(round_, candidates, census, told)
                seen = {r.peer_id for r in candidates if census.in_bucket(r.peer_id)}
                wanted = census.wanted.keys() - liveness.gone
                if len(seen) >= 2 and wanted <= seen:
                    break
                if census.ahead and census.expected == {me} and seen <= {me} and not census.pending:
                    # Everyone else has moved past this round (this node lost one): nobody will
                    # come, and the sooner it says so the sooner it catches up by state sync
                    # (while they wait for it, one round behind, as "expected").
                    log.info("round %d: the other peers are past this round", round_)
                    break
                if wanted == {me} and seen <= {me} and census.wanted.keys() != {me}:
                    log.info("round %d: the peers it waited for are gone", round_)
                    break
                missing = [
                    r
                    for p, r in census.wanted.items()
                    if p not in seen
                    and p not in census.pending  # being asked already
                    and r is not None
                    and r.reachability in _DIALABLE
                ]
                liveness.check(missing)
                await asyncio.sleep(poll_pause(len(posted)))
                if loop.time() - read_at > EXPECTED_REFRESH_SECONDS:
                    peers, read_at = await self._read_peers(avoided), loop.time()
                    records = {p.peer_id: p for p in peers if p.peer_id != me}
                posted = await self._ready(round_, avoided)
                candidates = self._admit(round_, posted, records, probes)
                census = self._census(round_, peers, probes)
            await asyncio.sleep(self.settle_seconds)
            posted = await self._ready(round_, avoided)
            candidates = self._admit(round_, posted, records, probes)
            if probes is not None:
                # Newcomers seen last are counted once they answer, never before: every honest
                # node waits for the same answers, and so cuts the same groups.
                await probes.settle()
                candidates = self._admit(round_, posted, records, probes)
                census = self._census(round_, peers, probes)
            self._tell(round_, candidates, census, told)
        finally:
            liveness.close()
        if probes is not None and len(posted) > len(candidates):
            log.info(
                "round %d: %d readiness records from peers it does not count as members",
                round_, len(posted) - len(candidates),
            )  # fmt: skip
        # A peer whose offer is out of range has come (nobody waits for it) but joins no group:
        # every member leaves it out alike, so all still cut the same groups.
        by_id = {
            r.peer_id: r
            for r in candidates
            if census.in_bucket(r.peer_id) and bounded(r.bandwidth, r.weight)
        }
        refused = [r.peer_id for r in candidates if not bounded(r.bandwidth, r.weight)]
        if refused:
            log.info("round %d: left out %s (bandwidth or weight out of range)", round_, refused)
        avoids = {p: r.avoided() for p, r in by_id.items()}
        for members in assign_groups(round_, list(by_id), self.group_size, avoids):
            if self._identity.peer_id in members:
                if not any(by_id[p].bandwidth > 0 for p in members):
                    log.info("round %d: no member of the group can be dialed", round_)
                    return None
                return Group(
                    round=round_,
                    members=tuple(
                        Member(
                            peer_id=p,
                            endpoint=by_id[p].endpoint,
                            bandwidth=by_id[p].bandwidth,
                            weight=by_id[p].weight,
                        )
                        for p in members
                    ),
                )
        log.info("round %d: no group (%d candidates)", round_, len(candidates))
        return None

    def _census(self, round_: int, peers: list[PeerRecord], probes: Probes | None) -> _Census:
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
        me = self._identity.peer_id
        records = {p.peer_id: p for p in peers if p.peer_id != me}
        members, pending = list(records.values()), set()
        if probes is not None:
            members = []
            taking_part = [p for p in records.values() if p.epoch >= round_ - 1]
            for p in _freshest_first(round_, taking_part):
                verdict = probes.verdict(p, exact=False)
                if verdict:
                    members.append(p)
                elif verdict is None:
                    pending.add(p.peer_id)
        counted = [p for p in members if not self._excluded(p.peer_id)]
        expected = {p.peer_id for p in counted if p.epoch in (round_ - 1, round_)} | {me}
        ahead = any(p.epoch > round_ for p in counted)
        taking = {p.peer_id for p in members if p.epoch >= round_ - 1} | {me}
        buckets = bucket_count(round_, taking, self.group_size)
        mine = bucket_of(round_, me, buckets)
        waiting = expected | {p for p in pending if records[p].epoch in (round_ - 1, round_)}
        wanted = {p: records.get(p) for p in waiting if bucket_of(round_, p, buckets) == mine}
        return _Census(round_, expected, ahead, buckets, mine, wanted, frozenset(pending))

    def _admit(
        self,
        round_: int,
        ready: list[ReadyRecord],
        records: dict[str, PeerRecord],
        probes: Probes | None,
    ) -> list[ReadyRecord]:
        """The readiness records that count (``membership.py``): this node's own, a known
        member's, or a newcomer's that answered at the endpoint it is ready at (asked now if
        it was not yet)."""
        if probes is None:
            return ready
        me = self._identity.peer_id

        def counts(r: ReadyRecord) -> bool:
            if r.peer_id == me or probes.membership.known(r.peer_id):
                return True
            record = records.get(r.peer_id)  # none: no live record in the run, not asked
            return record is not None and bool(probes.verdict(replace(record, endpoint=r.endpoint)))

        return [r for r in _freshest_first(round_, ready) if counts(r)]

    def _tell(
        self, round_: int, candidates: list[ReadyRecord], census: _Census, told: set[str]
    ) -> set[str]:
        """Tell ``expect`` the members that may stream to this node in ``round_``, if more
        than it was told (``told``)."""
        members = {r.peer_id for r in candidates if not self._excluded(r.peer_id)}
        members |= census.expected
        members.discard(self._identity.peer_id)
        if self._expect is not None and not members <= told:
            told = told | members
            self._expect(round_, told)
        return told

    def _read(self, peer_id: str, avoided: frozenset[str]) -> bool:
        """Whether this node reads ``peer_id``'s records: not excluded, or excluded and named in
        this node's own readiness record (``avoided``), for others still see that peer (never
        waited for, but counted in the buckets and cut into groups as they do)."""
        return not self._excluded(peer_id) or avoid_tag(peer_id) in avoided

    async def _read_peers(self, avoided: frozenset[str]) -> list[PeerRecord]:
        return [p for p in await self._peers() if self._read(p.peer_id, avoided)]

    async def _ready(self, round_: int, avoided: frozenset[str]) -> list[ReadyRecord]:
        return [
            r for r in await self._discovery.find_ready(round_) if self._read(r.peer_id, avoided)
        ]
