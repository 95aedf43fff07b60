"""Matchmaking's waiting rules against a DHT of plain dicts: who it waits for, and when it stops."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any, cast

from swarmgrad.node.averaging.grouping import assign_groups, bucket_count, bucket_of
from swarmgrad.node.averaging.matchmaking import Hooks, Matchmaker
from swarmgrad.node.averaging.membership import PROBE_AFTER_SECONDS
from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.discovery.records import PeerRecord, ReadyRecord
from swarmgrad.node.identity import Identity

RUN, SPEC = "mm-rules", b"\x07" * 32


class Board:
    """Readiness records by round, as a DHT would hold them."""

    def __init__(self) -> None:
        self.run_id, self.spec_hash = RUN, SPEC
        self.ready: dict[int, dict[str, ReadyRecord]] = {}

    async def announce_ready(self, record: ReadyRecord) -> None:
        self.ready.setdefault(record.round, {})[record.peer_id] = record

    async def find_ready(self, round_: int) -> list[ReadyRecord]:
        return list(self.ready.get(round_, {}).values())


def peer(name: str, epoch: int, reachability: str = "direct") -> PeerRecord:
    return PeerRecord.create(
        name, run_id=RUN, spec_hash=SPEC, endpoint="127.0.0.1:1", now=dht_time(),
        ttl_seconds=60, epoch=epoch, reachability=reachability,
    )  # fmt: skip


def maker(
    board: Board,
    identity: Identity,
    peers: list[PeerRecord],
    *,
    settle_seconds: float = 0.05,
    **options: Any,
) -> Matchmaker:
    async def read() -> list[PeerRecord]:
        return peers

    return Matchmaker(
        cast(Any, board),
        identity,
        group_size=4,
        matchmaking_timeout_seconds=10.0,
        settle_seconds=settle_seconds,
        hooks=Hooks(peers=read, **options),
    )


async def test_a_peer_that_lost_a_round_stops_waiting_once_everyone_is_past_it() -> None:
    me = Identity.from_seed("mm-rules/me")
    others = [peer("a", 8), peer("b", 8)]
    started = time.monotonic()
    group = await maker(Board(), me, [peer(me.peer_id, 7), *others]).form_group(7, endpoint="x:1")
    assert group is None
    assert time.monotonic() - started < 2.0  # not the 10 s timeout: it can resync at once


async def test_a_peer_still_waits_for_peers_one_round_behind() -> None:
    me = Identity.from_seed("mm-rules/me")
    board = Board()
    mm = maker(board, me, [peer(me.peer_id, 7), peer("late", 6), peer("ahead", 8)])
    mm.timeout_seconds = 0.5
    started = time.monotonic()
    assert await mm.form_group(7, endpoint="x:1") is None
    assert time.monotonic() - started >= 0.5  # "late" may still come: it waited it out


def ready(name: str, round_: int) -> ReadyRecord:
    now = dht_time()
    return ReadyRecord(peer_id=name, run_id=RUN, spec_hash=SPEC.hex(), endpoint=f"{name}:1",
                       round=round_, bandwidth=1.0, weight=1.0, issued_at=now,
                       expires_at=now + 60)  # fmt: skip


class Liveness:
    """``alive`` for the matchmaker: the peers named dead do not answer; every probe is noted."""

    def __init__(self, *dead: str) -> None:
        self.dead, self.asked = set(dead), Counter[str]()

    async def alive(self, record: PeerRecord) -> bool:
        self.asked[record.peer_id] += 1
        return record.peer_id not in self.dead


async def test_a_crashed_peer_is_asked_and_not_waited_for_until_the_timeout() -> None:
    # "crashed" left a record at the round (it would expire in a minute); "mate" is ready.
    me = Identity.from_seed("mm-rules/me")
    board = Board()
    await board.announce_ready(ready("mate", 4))
    liveness = Liveness("crashed")
    peers = [peer(me.peer_id, 4), peer("mate", 4), peer("crashed", 4)]
    started = time.monotonic()
    group = await maker(board, me, peers, alive=liveness.alive).form_group(4, endpoint="me:1")
    waited = time.monotonic() - started
    assert group is not None
    assert sorted(m.peer_id for m in group.members) == sorted([me.peer_id, "mate"])
    assert PROBE_AFTER_SECONDS <= waited < 3.0  # not the 10 s timeout
    assert liveness.asked == {"crashed": 1}  # the ready mate was never asked


async def test_a_late_peer_that_answers_is_waited_for_and_joins() -> None:
    me = Identity.from_seed("mm-rules/me")
    board = Board()
    await board.announce_ready(ready("mate", 4))
    liveness = Liveness()
    peers = [peer(me.peer_id, 4), peer("mate", 4), peer("slow", 4)]
    mm = maker(board, me, peers, alive=liveness.alive)

    async def slow_peer() -> None:  # still training: it answers, and is ready 2.5 s later
        await asyncio.sleep(2.5)
        await board.announce_ready(ready("slow", 4))

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(slow_peer())
        group = await mm.form_group(4, endpoint="me:1")
    assert group is not None
    assert sorted(m.peer_id for m in group.members) == sorted([me.peer_id, "mate", "slow"])
    assert liveness.asked["slow"] >= 1


async def test_a_peer_that_restarts_elsewhere_is_asked_again_and_waited_for() -> None:
    # "phoenix" crashed: its old endpoint does not answer. It restarts on another port and
    # publishes a new record before this node's group is cut: a node that read only the new
    # record waits for it, so this one must too, or the two cut different groups.
    me = Identity.from_seed("mm-rules/me")
    board = Board()
    old = peer("phoenix", 4)
    peers = [peer(me.peer_id, 4), peer("mate", 4), old]
    asked: list[str] = []  # the endpoints phoenix was asked at

    async def alive(record: PeerRecord) -> bool:
        if record.peer_id != "phoenix":
            return True  # the mate is still training
        asked.append(record.endpoint)
        return record.endpoint != old.endpoint

    mm = maker(board, me, peers, alive=alive)  # reads ``peers`` as it is at each read

    async def restart() -> None:
        await asyncio.sleep(PROBE_AFTER_SECONDS + 0.5)  # its old endpoint was asked by now
        assert asked == [old.endpoint]
        new = PeerRecord.create(
            "phoenix", run_id=RUN, spec_hash=SPEC, endpoint="127.0.0.1:2", now=dht_time(),
            ttl_seconds=60, epoch=4, reachability="direct",
        )  # fmt: skip
        peers[-1] = new
        await asyncio.sleep(1.0)
        await board.announce_ready(ready("mate", 4))  # the mate comes: not enough to cut
        await asyncio.sleep(1.0)
        await board.announce_ready(ready("phoenix", 4))

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(restart())
        group = await mm.form_group(4, endpoint="me:1")
    assert group is not None
    assert sorted(m.peer_id for m in group.members) == sorted([me.peer_id, "mate", "phoenix"])
    assert asked == [old.endpoint, "127.0.0.1:2"]  # asked again at the new endpoint


async def test_a_peer_nobody_can_dial_yet_is_not_asked_but_waited_for() -> None:
    # A NAT'd peer announces its LAN address until it holds a relay: nobody could reach it to
    # ask, so a failed question would say nothing; it is waited for as before.
    me = Identity.from_seed("mm-rules/me")
    board = Board()
    await board.announce_ready(ready("mate", 4))
    liveness = Liveness("settling", "cut-off")
    peers = [peer(me.peer_id, 4), peer("mate", 4), peer("settling", 4, "unknown"),
             peer("cut-off", 4, "unreachable")]  # fmt: skip
    mm = maker(board, me, peers, alive=liveness.alive)
    mm.timeout_seconds = PROBE_AFTER_SECONDS + 1.5
    started = time.monotonic()
    group = await mm.form_group(4, endpoint="me:1")
    assert time.monotonic() - started >= mm.timeout_seconds  # waited it out
    assert group is not None
    assert not liveness.asked


async def test_a_survivor_whose_peers_are_all_gone_stops_waiting() -> None:
    me = Identity.from_seed("mm-rules/me")
    liveness = Liveness("a", "b")
    peers = [peer(me.peer_id, 4), peer("a", 4), peer("b", 3)]
    started = time.monotonic()
    group = await maker(Board(), me, peers, alive=liveness.alive).form_group(4, endpoint="me:1")
    assert group is None
    assert time.monotonic() - started < 3.0  # not the 10 s timeout: it trains on
    assert set(liveness.asked) == {"a", "b"}


async def test_banned_peers_are_neither_candidates_nor_waited_for() -> None:
    me = Identity.from_seed("mm-rules/me")
    board = Board()
    now = dht_time()
    for name in ("friend", "foe"):
        await board.announce_ready(
            ReadyRecord(peer_id=name, run_id=RUN, spec_hash=SPEC.hex(), endpoint=f"{name}:1",
                        round=3, bandwidth=1.0, weight=1.0, issued_at=now, expires_at=now + 60)
        )  # fmt: skip
    peers = [peer(me.peer_id, 3), peer("friend", 3), peer("foe", 3)]
    group = await maker(board, me, peers, excluded=lambda p: p == "foe").form_group(
        3, endpoint="me:1"
    )
    assert group is not None
    assert sorted(m.peer_id for m in group.members) == sorted([me.peer_id, "friend"])


async def test_a_peer_offering_an_absurd_share_or_weight_is_left_out_of_the_group() -> None:
    """1e308 is finite and passes a record's checks, but it would overflow the partition (or
    the weighted average) of every member of its group: such a peer is no candidate."""
    me = Identity.from_seed("mm-rules/me")
    board = Board()
    now = dht_time()
    offers = {"friend": (1.0, 3.0), "greedy": (1e308, 1.0), "heavy": (1.0, 1e300)}
    for name, (bandwidth, weight) in offers.items():
        await board.announce_ready(
            ReadyRecord(peer_id=name, run_id=RUN, spec_hash=SPEC.hex(), endpoint=f"{name}:1",
                        round=3, bandwidth=bandwidth, weight=weight, issued_at=now,
                        expires_at=now + 60)
        )  # fmt: skip
    peers = [peer(name, 3) for name in (me.peer_id, *offers)]
    group = await maker(board, me, peers).form_group(3, endpoint="me:1")
    assert group is not None
    assert sorted(m.peer_id for m in group.members) == sorted([me.peer_id, "friend"])
    assert [end - start for start, end in group.partition(1000)] == [500, 500]


def test_buckets_keep_every_group_whole_in_a_large_swarm() -> None:
    assert bucket_count(3, [f"p{i}" for i in range(15)], 4) == 1  # under four groups: one bucket
    for size in (16, 64, 1000, 5000):
        peers = [f"peer-{i}" for i in range(size)]
        buckets = bucket_count(3, peers, 4)
        assert buckets & (buckets - 1) == 0  # a power of two
        sizes = Counter(bucket_of(3, p, buckets) for p in peers)
        assert len(sizes) == buckets
        assert min(sizes.values()) >= 2  # nobody alone in its bucket
        assert 4 <= size / buckets < 32  # two to four groups' worth, more if halved
        # A census a few peers off mostly gives the same count; when not, one splits the other.
        other = bucket_count(3, peers[:-3], 4)
        assert other in (buckets, buckets // 2)
        if other != buckets:
            assert all(bucket_of(3, p, buckets) % other == bucket_of(3, p, other) for p in peers)


async def test_in_a_large_swarm_a_peer_waits_for_its_bucket_and_groups_within_it() -> None:
    # 40 peers at round 5: the round is cut into buckets; every peer of this one's bucket is
    # ready, and so are half the others (the rest still train). It must not wait for the rest,
    # and its group must hold only peers of its bucket, the group they compute too (cut from
    # all the candidates it sees, it would depend on who else happened to be ready).
    me = Identity.from_seed("mm-rules/me")
    names = [f"peer-{i:02d}" for i in range(39)]
    everyone = [me.peer_id, *names]
    buckets = bucket_count(5, everyone, 4)
    assert buckets > 1
    mine = bucket_of(5, me.peer_id, buckets)
    bucket = [p for p in everyone if bucket_of(5, p, buckets) == mine]
    board = Board()
    now = dht_time()
    others = [p for p in everyone if p not in bucket]
    for name in bucket + others[::2]:
        if name != me.peer_id:
            await board.announce_ready(
                ReadyRecord(peer_id=name, run_id=RUN, spec_hash=SPEC.hex(), endpoint=f"{name}:1",
                            round=5, bandwidth=1.0, weight=1.0, issued_at=now,
                            expires_at=now + 60)
            )  # fmt: skip
    mm = maker(board, me, [peer(p, 5) for p in everyone])
    started = time.monotonic()
    group = await mm.form_group(5, endpoint="me:1")
    assert time.monotonic() - started < 3.0  # not the 10 s timeout: its bucket was all there
    assert group is not None
    members = [m.peer_id for m in group.members]
    assert me.peer_id in members
    assert set(members) <= set(bucket)
    expected = next(g for g in assign_groups(5, bucket, 4) if me.peer_id in g)
    assert members == expected


def ready_at(name: str, round_: int, issued_at: float) -> ReadyRecord:
    return ReadyRecord(peer_id=name, run_id=RUN, spec_hash=SPEC.hex(), endpoint=f"{name}:1",
                       round=round_, bandwidth=1.0, weight=1.0, issued_at=issued_at,
                       expires_at=issued_at + 60)  # fmt: skip


async def test_peers_in_slots_cut_the_same_groups_whenever_they_stop_waiting() -> None:
    """Rounds in slots of 2 s (grace 0.25 s): two members that stop waiting at different
    moments cut the same group. A newcomer signed within the grace is in it for both, one
    signed past it for neither (whoever read it), and a node that would sign past the grace
    posts nothing."""
    slot_seconds = 2.0
    me, mate = Identity.from_seed("mm-rules/me"), Identity.from_seed("mm-rules/mate")
    board = Board()
    peers = [peer(me.peer_id, 4), peer(mate.peer_id, 4)]

    def slotted(identity: Identity) -> Matchmaker:
        found = maker(board, identity, peers)
        found.cut.slot_seconds = slot_seconds
        return found

    boundary = (dht_time() // slot_seconds + 1) * slot_seconds
    await asyncio.sleep(boundary + 0.01 - dht_time())  # just after a boundary

    async def newcomers() -> None:
        await asyncio.sleep(0.1)
        await board.announce_ready(ready_at("in-grace", 4, boundary + 0.2))
        await board.announce_ready(ready_at("past-grace", 4, boundary + 0.3))

    async def late_mate() -> Any:
        await asyncio.sleep(0.05)  # it comes later
        return await slotted(mate).form_group(4, endpoint="mate:1")

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(newcomers())
        mine = tasks.create_task(slotted(me).form_group(4, endpoint="me:1"))
        theirs = tasks.create_task(late_mate())
    cut = {me.peer_id, mate.peer_id, "in-grace"}
    for group in (mine.result(), theirs.result()):
        assert group is not None
        assert {m.peer_id for m in group.members} == cut
    assert dht_time() >= boundary + 0.25  # nobody cut before the grace had passed

    await asyncio.sleep(max(0.0, boundary + 0.5 - dht_time()))  # well past the grace
    board.ready.clear()
    assert await slotted(me).form_group(5, endpoint="me:1") is None
    assert board.ready == {}  # it posted nothing: nobody's groups would have it
