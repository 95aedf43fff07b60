"""Matchmaking without a leader: peers ready for round r form groups through the DHT.

Each peer announces a signed readiness record under ``round/<r>`` (its endpoint, bandwidth and
weight). The peers it expects in the round are those whose peer records say they are at epoch r or
r - 1 (a peer that just finished the last round may not have announced it yet). A swarm of many
groups is split into **buckets** by a hash of (round, peer id): a power of two of them, so each
expects two to four groups' worth of the round's peers (:func:`bucket_count`); a peer only waits
for, and only groups with, the peers of its own bucket. It reads the topic until every expected
peer of its bucket is a candidate (at least two), or its wave is over (below), or its matchmaking
timeout passes; then it waits
a settle time for stragglers' records to spread (a few of its own announces' time, at most
``settle_seconds``: ``cut.Settle``), and reads once more. Its bucket's
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
(``simulate --engine des`` showed most rounds lost that way at 32 peers). More rules keep
peers that read at different moments alike:

- **Waves.** A straggler that came after one peer stopped waiting and before another did would
  be cut in by one and out by the other. So a bucket's candidates are split into waves by when
  each signed its readiness (``grouping.waves``: the first wave holds those issued within
  ``wave_seconds`` of the earliest, a little under the matchmaking timeout), groups are cut
  within this peer's wave only, and a peer stops waiting once its wave is over: whoever comes
  later is in the next wave for every peer that reads it, and averages with the other
  latecomers, or alone in its wave, trains on. Waves go by the signers' clocks: a peer whose
  clock is off by seconds lands in another wave than its time says, and a member that backdates
  its record can split a round in two waves, not keep the honest peers from grouping.
- **Slots.** With rounds at the slot boundaries of the DHT clock (``algorithm.round_seconds``,
  ``slots.py``), a record is in the slot of the boundary nearest its signed time and counts only
  if it was signed within the slot's grace; nobody reads the candidates for its cut before the
  grace has passed and the settle time after it. A node that would sign past the grace posts
  nothing and trains on to the next boundary. A keyed member that signs within the grace and
  posts just as the others read can still put itself in some peers' cut and not others', as it
  could between two waves' last reads. (Waves and slots: ``cut.py``.)
- **What was seen stays seen.** Two reads of a round key can differ (replicas answer
  differently, or one is slow): a readiness record that counted at one read of a matchmaking
  stays a candidate until it expires.

A peer that still saw a different set (a record that arrived between two peers' last reads, or
a census that put the bucket count on the other side of a power of two) ends up in a group
whose id its mates do not share, its all-reduce streams are refused as UNKNOWN_ROUND, and the
round counts as failed for it: nothing hangs and nothing mixes. A peer that finds nobody
returns None and trains on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, replace

from swarmgrad.node.averaging.census import Census, freshest_first, take_census
from swarmgrad.node.averaging.cut import Cut, Settle
from swarmgrad.node.averaging.group import Group, Member, bounded
from swarmgrad.node.averaging.grouping import assign_groups
from swarmgrad.node.averaging.membership import Alive, Liveness, Membership, Probes
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
#: Told which peers may stream to this node in a round (the averager's ``expect``).
Expect = Callable[[int, Collection[str]], None]
#: The peers that can be asked: others have dialed them. One whose verdict is not in yet (a NAT'd
#: peer announces its LAN address until it has a relay) or that nobody can dial would not answer
#: anyway, and is waited for as before.
_DIALABLE = frozenset({Reach.DIRECT, Reach.UPNP, Reach.RELAYED})


def poll_pause(records: int) -> float:
    """The pause between two reads of a round's readiness that returned ``records`` records.
    Each read costs the DHT processes that answer it, and this one, a check per record: a
    round key flooded with 310 throwaway keys' records, read ten times a second by every
    waiting node, was most of what the flood still cost an honest swarm once stores were
    bounded (``discovery/check_budget.py``). Up to 64 records (an honest swarm's round, in
    most swarms) it is ``POLL_SECONDS``; beyond, longer in proportion, at most
    ``MAX_POLL_SECONDS``."""
    return min(MAX_POLL_SECONDS, POLL_SECONDS * max(1.0, records / POLL_RECORDS))


@dataclass(frozen=True, slots=True)
class Hooks:
    """What the node tells matchmaking about its peers; each has a default.

    ``peers`` reads the run's peer records (the node's directory; default: the DHT);
    ``excluded`` says which peers this node no longer groups with (its trust ledger's bans):
    they are not waited for, and their readiness records are not candidates unless this node's
    own record names them as avoided: ``avoiding`` gives the peers it names (newest bans first;
    the first ``MAX_AVOIDS``), so that others cut the same groups; ``membership`` says whose
    readiness counts (``membership.py``; None: every signed record, as in tests of the
    grouping rules alone); ``alive`` asks a peer that is late whether it is still there
    (default: the membership's probe; None without either: every expected peer is waited for
    until the timeout); ``expect`` is told, as matchmaking goes, which members may stream to
    this node in the round."""

    peers: Callable[[], Awaitable[list[PeerRecord]]] | None = None
    excluded: Callable[[str], bool] | None = None
    avoiding: Callable[[], Sequence[str]] | None = None
    alive: Alive | None = None
    membership: Membership | None = None
    expect: Expect | None = None


class Matchmaker:
    def __init__(
        self,
        discovery: Discovery,
        identity: Identity,
        *,
        group_size: int,
        matchmaking_timeout_seconds: float,
        settle_seconds: float = 0.5,
        slot_seconds: float = 0.0,
        hooks: Hooks | None = None,
    ) -> None:
        if group_size < 2:
            raise ValueError("group_size must be at least 2")
        if not 0 < matchmaking_timeout_seconds <= MAX_MATCHMAKING_TIMEOUT_SECONDS:
            raise ValueError(
                f"matchmaking_timeout_seconds must be in (0, {MAX_MATCHMAKING_TIMEOUT_SECONDS:g}]"
            )
        hooks = hooks or Hooks()
        self._discovery, self._identity = discovery, identity
        self._peers = hooks.peers or discovery.find
        self.group_size = group_size
        #: Whose records it cuts, by waves or by slots of the DHT clock (``cut.py``).
        self.cut = Cut(
            identity.peer_id,
            timeout_seconds=matchmaking_timeout_seconds,
            slot_seconds=slot_seconds,
        )
        #: The wait before the last read: ``settle_seconds`` at most, less where the DHT's
        #: stores take less (``cut.Settle``).
        self.settle = Settle(settle_seconds)
        self._excluded = hooks.excluded or (lambda _peer: False)
        self._avoiding = hooks.avoiding or (lambda: ())
        self.membership = hooks.membership
        alive = hooks.alive
        if alive is None and self.membership is not None:
            alive = self.membership.alive
        self._alive = alive
        self._expect = hooks.expect

    @property
    def settle_seconds(self) -> float:
        """The longest settle time (a round's withdrawal waits this long)."""
        return self.settle.longest

    @property
    def timeout_seconds(self) -> float:
        return self.cut.timeout_seconds

    @timeout_seconds.setter
    def timeout_seconds(self, seconds: float) -> None:
        self.cut.timeout_seconds = seconds

    async def form_group(
        self, round_: int, *, endpoint: str, bandwidth: float = 1.0, weight: float = 1.0
    ) -> Group | None:
        """This peer's group for ``round_``, or None if it found nobody in time."""
        now = dht_time()
        slot = self.cut.slot(round_, now)
        if slot is None:
            return None
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
        loop = asyncio.get_running_loop()
        announcing = loop.time()
        await self._discovery.announce_ready(ready)
        self.settle.stored(loop.time() - announcing)
        deadline = loop.time() + self.timeout_seconds
        cut_at = self.cut.cut_at(slot)
        me = self._identity.peer_id
        probes = self.membership.session(round_) if self.membership is not None else None
        liveness = Liveness(round_, self._alive)
        told: set[str] = set()
        kept: dict[str, ReadyRecord] = {}  # every candidate seen in this matchmaking (_admit)
        try:
            peers, read_at = await self._read_peers(avoided), loop.time()
            records = {p.peer_id: p for p in peers if p.peer_id != me}
            # Readiness first: its signers' questions go before the census's.
            posted = await self._ready(round_, avoided)
            candidates = self._admit(round_, posted, records, probes, kept)
            census = self._census(round_, peers, probes)
            while loop.time() < deadline:
                told = self._tell(round_, candidates, census, told)
                seen = {r.peer_id for r in candidates if census.in_bucket(r.peer_id)}
                wanted = {p for p, r in census.wanted.items() if not liveness.gone(p, r)}
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
                in_bucket = {r.peer_id: r for r in candidates if census.in_bucket(r.peer_id)}
                if dht_time() >= self.cut.over(in_bucket, slot):
                    break  # whoever comes now is in the next wave (slot): cut without it
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
                candidates = self._admit(round_, posted, records, probes, kept)
                census = self._census(round_, peers, probes)
            # A slot's records signed up to its grace have the settle time to spread.
            settle = self.settle.seconds
            await asyncio.sleep(max(settle, cut_at + settle - dht_time()))
            posted = await self._ready(round_, avoided)
            candidates = self._admit(round_, posted, records, probes, kept)
            if probes is not None:
                # Newcomers seen last are counted once they answer, never before: every honest
                # node waits for the same answers, and so cuts the same groups.
                await probes.settle()
                candidates = self._admit(round_, posted, records, probes, kept)
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
        by_id = self.cut.mine(round_, by_id, slot)
        log.debug(
            "round %d: cutting %d candidates (bucket %d of %d, this wave) of %d records read",
            round_, len(by_id), census.mine, census.buckets, len(posted),
        )  # fmt: skip
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

    def _census(self, round_: int, peers: list[PeerRecord], probes: Probes | None) -> Census:
        me = self._identity.peer_id
        return take_census(round_, me, peers, probes, self._excluded, self.group_size)

    def _admit(
        self,
        round_: int,
        ready: list[ReadyRecord],
        records: dict[str, PeerRecord],
        probes: Probes | None,
        kept: dict[str, ReadyRecord],
    ) -> list[ReadyRecord]:
        """The readiness records that count (``membership.py``): this node's own, a known
        member's, or a newcomer's that answered at the endpoint it is ready at (asked now if
        it was not yet); and every one that counted at an earlier read of this matchmaking
        (``kept``), until it expires. Two reads of a round key can differ (replicas answer
        differently, or one is slow): a candidate that one peer's last read missed and its
        mates' did not split their groups (3 of 21 rounds of an 8-node swarm under a readiness
        flood). A record withdrawn meanwhile stays too: its peer has cut its group with it."""
        now = dht_time()
        for r in self._counted(round_, ready, records, probes):
            held = kept.get(r.peer_id)
            if held is None or r.issued_at >= held.issued_at:
                kept[r.peer_id] = r
        return [r for r in kept.values() if r.expires_at > now]

    def _counted(
        self,
        round_: int,
        ready: list[ReadyRecord],
        records: dict[str, PeerRecord],
        probes: Probes | None,
    ) -> list[ReadyRecord]:
        if probes is None:
            return ready
        me = self._identity.peer_id

        def counts(r: ReadyRecord) -> bool:
            if r.peer_id == me or probes.membership.known(r.peer_id):
                return True
            record = records.get(r.peer_id)  # none: no live record in the run, not asked
            return record is not None and bool(probes.verdict(replace(record, endpoint=r.endpoint)))

        return [r for r in freshest_first(round_, ready) if counts(r)]

    def _tell(
        self, round_: int, candidates: list[ReadyRecord], census: Census, told: set[str]
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
