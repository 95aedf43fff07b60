"""Matchmaking against throwaway keys (issue 42, finding 4), on a DHT of plain dicts: whose
readiness counts (``membership.py``), who is waited for, and what a flood of records costs."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import replace
from typing import Any

from swarmgrad.node.averaging.membership import (
    MAX_PROBES_IN_FLIGHT,
    MAX_PROBES_PER_ROUND,
    NEWCOMER_WAIT_SECONDS,
    Membership,
)
from swarmgrad.node.discovery.records import PeerRecord, ReadyRecord
from swarmgrad.node.identity import Identity
from tests.unit.test_matchmaking_rules import Board, maker, peer
from tests.unit.test_matchmaking_rules import ready as ready_elsewhere

SYBILS = 300


class Endpoints:
    """``alive`` for a membership: the named peers answer at once, every other endpoint is
    silent, after ``silent_seconds`` (a dead host drops packets: the probe waits out its
    deadline). Every probe is noted, and the most open at once."""

    def __init__(self, *live: str, silent_seconds: float = 0.0) -> None:
        self.live, self.silent_seconds = set(live), silent_seconds
        self.asked: Counter[str] = Counter()
        self.open = self.most_open = 0

    async def alive(self, record: PeerRecord) -> bool:
        self.asked[record.peer_id] += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            if record.peer_id in self.live:
                return True
            await asyncio.sleep(self.silent_seconds)
            return False
        finally:
            self.open -= 1


def ready(name: str, round_: int) -> ReadyRecord:
    """``name``'s readiness, at the endpoint its peer record announces (``peer``)."""
    return replace(ready_elsewhere(name, round_), endpoint="127.0.0.1:1")


def sybil(i: int) -> str:
    return f"sybil-{i:03d}"


async def flooded_board(round_: int, honest: list[str]) -> Board:
    """Readiness for ``round_``: the honest peers' issued now, the sybils' stored 30 s ahead."""
    board = Board()
    for name in honest:
        await board.announce_ready(ready(name, round_))
    for i in range(SYBILS):
        stored_ahead = ready(sybil(i), round_)
        stored_ahead = replace(stored_ahead, issued_at=stored_ahead.issued_at - 30.0)
        await board.announce_ready(stored_ahead)
    return board


def members(group: Any) -> list[str]:
    assert group is not None
    return sorted(m.peer_id for m in group.members)


async def test_readiness_from_keys_without_a_peer_record_is_ignored_for_free() -> None:
    # The finding: 310 throwaway keys, each a well-formed readiness record under the coming
    # round keys and nothing else. Grouped with them, every honest round aborted.
    me = Identity.from_seed("mm-sybil/me")
    board = await flooded_board(5, ["a", "b"])
    endpoints = Endpoints("a", "b")
    peers = [peer(me.peer_id, 5), peer("a", 5), peer("b", 5)]
    mm = maker(board, me, peers, membership=Membership(endpoints.alive))
    started = time.monotonic()
    group = await mm.form_group(5, endpoint="me:1")
    assert members(group) == sorted([me.peer_id, "a", "b"])
    assert time.monotonic() - started < 2.0  # not the 10 s timeout
    assert set(endpoints.asked) == {"a", "b"}  # nobody asked the sybils anything


async def test_sybil_peer_records_are_neither_waited_for_nor_scatter_the_buckets() -> None:
    # 300 keys also announce peer records at the round, with endpoints that drop packets (each
    # probe waits out a 2 s deadline). Counted in the census, they would cut the round into 32
    # buckets, each honest peer alone in its own; waited for, they would cost every round the
    # matchmaking timeout.
    me = Identity.from_seed("mm-sybil/me")
    honest = ["a", "b", "c"]
    board = await flooded_board(5, honest)
    endpoints = Endpoints(*honest, silent_seconds=2.0)
    membership = Membership(endpoints.alive)
    peers = [peer(p, 5) for p in [me.peer_id, *honest, *(sybil(i) for i in range(SYBILS))]]
    try:
        for round_ in (5, 6):  # the next round is cheaper: the slow "no"s are remembered
            if round_ == 6:
                board = await flooded_board(6, honest)
                peers = [peer(p.peer_id, 6) for p in peers]
            mm = maker(board, me, peers, membership=membership)
            started = time.monotonic()
            group = await mm.form_group(round_, endpoint="me:1")
            waited = time.monotonic() - started
            assert members(group) == sorted([me.peer_id, *honest])
            assert waited < 2 * NEWCOMER_WAIT_SECONDS + 1.0, (round_, waited)
        asked = sum(endpoints.asked[sybil(i)] for i in range(SYBILS))
        assert asked <= 2 * MAX_PROBES_PER_ROUND  # bounded per round, each asked once
        assert max(endpoints.asked.values()) == 1
        assert endpoints.most_open <= MAX_PROBES_IN_FLIGHT
    finally:
        await membership.close()


async def test_a_known_member_counts_without_a_question() -> None:
    me = Identity.from_seed("mm-sybil/me")
    board = await flooded_board(3, ["mate"])
    endpoints = Endpoints()  # nobody would answer now
    membership = Membership(endpoints.alive)
    membership.met(["mate"])  # it averaged with this node last round
    peers = [peer(me.peer_id, 3), peer("mate", 3)]
    group = await maker(board, me, peers, membership=membership).form_group(3, endpoint="me:1")
    assert members(group) == sorted([me.peer_id, "mate"])
    assert not endpoints.asked


async def test_peers_that_ask_the_same_newcomer_cut_the_same_groups() -> None:
    # Two honest peers that never met, and a newcomer (ready, and slow to answer: 0.3 s), in a
    # flood: each counts the newcomer once it answered, and both cut the same group.
    first, second = Identity.from_seed("mm-sybil/first"), Identity.from_seed("mm-sybil/second")
    board = await flooded_board(4, ["newcomer"])

    async def slow(record: PeerRecord) -> bool:
        if record.peer_id in ("newcomer", first.peer_id, second.peer_id):
            await asyncio.sleep(0.3)
            return True
        return False

    peers = [peer(p, 4) for p in (first.peer_id, second.peer_id, "newcomer")]
    makers = [maker(board, me, peers, membership=Membership(slow)) for me in (first, second)]
    groups = await asyncio.gather(
        *(m.form_group(4, endpoint=f"{i}:1") for i, m in enumerate(makers))
    )
    assert groups[0] == groups[1]
    assert members(groups[0]) == sorted([first.peer_id, second.peer_id, "newcomer"])


async def test_a_silent_newcomer_is_remembered_and_not_asked_again() -> None:
    me = Identity.from_seed("mm-sybil/me")
    endpoints = Endpoints("mate")
    membership = Membership(endpoints.alive)
    peers = [peer(me.peer_id, 7), peer("mate", 7), peer("ghost", 7)]
    for round_ in (7, 8):
        board = Board()
        for name in ("mate", "ghost"):
            await board.announce_ready(ready(name, round_))
        peers = [peer(p.peer_id, round_) for p in peers]
        group = await maker(board, me, peers, membership=membership).form_group(
            round_, endpoint="me:1"
        )
        assert members(group) == sorted([me.peer_id, "mate"])
    assert endpoints.asked == {"mate": 1, "ghost": 1}
    assert membership.probes == {"answered": 1, "silent": 1}
    # A peer record with another endpoint (the ghost restarted on a new port) is asked afresh.
    moved = PeerRecord.create("ghost", run_id=peers[0].run_id, spec_hash=bytes(32),
                              endpoint="127.0.0.1:2", now=0.0, ttl_seconds=60)  # fmt: skip
    assert membership.session(9).verdict(moved) is None


async def test_matchmaking_tells_the_averager_whom_to_expect() -> None:
    me = Identity.from_seed("mm-sybil/me")
    board = await flooded_board(2, ["a", "b"])
    told: dict[int, set[str]] = {}
    peers = [peer(me.peer_id, 2), peer("a", 2), peer("b", 2)]
    mm = maker(
        board,
        me,
        peers,
        membership=Membership(Endpoints("a", "b").alive),
        expect=lambda round_, ids: told.setdefault(round_, set()).update(ids),
    )
    group = await mm.form_group(2, endpoint="me:1")
    assert members(group) == sorted([me.peer_id, "a", "b"])
    assert told == {2: {"a", "b"}}  # its mates, and no stranger
