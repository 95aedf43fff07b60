"""Peers that read a round's candidates at different moments still cut the same groups: a
straggler goes where everyone puts it (its wave, by when it signed), and a candidate one read
returned stays one when a later read misses it (``matchmaking.py``, ``grouping.waves``)."""

from __future__ import annotations

import asyncio

import pytest

from swarmgrad.node.averaging.group import Group
from swarmgrad.node.averaging.grouping import waves
from swarmgrad.node.averaging.matchmaking import Matchmaker
from swarmgrad.node.discovery.records import ReadyRecord
from swarmgrad.node.identity import Identity
from tests.unit.test_matchmaking_rules import Board, maker, peer, ready


def test_waves_open_at_the_earliest_record_and_hold_what_came_within_the_window() -> None:
    issued = {"a": 100.0, "b": 101.0, "c": 108.0, "d": 108.5, "e": 116.0, "f": 130.0}
    assert waves(issued, 8.0) == [["a", "b", "c"], ["d", "e"], ["f"]]
    assert waves(issued, 100.0) == [["a", "b", "c", "d", "e", "f"]]
    assert waves({}, 5.0) == []
    # The same records give the same waves, in whatever order they were read.
    assert waves(dict(reversed(issued.items())), 8.0) == waves(issued, 8.0)
    with pytest.raises(ValueError, match="positive"):
        waves(issued, 0.0)


def members(group: Group | None) -> list[str] | None:
    return None if group is None else sorted(m.peer_id for m in group.members)


async def test_a_straggler_is_cut_alike_by_peers_that_stopped_waiting_before_and_after_it() -> None:
    # "early" starts matchmaking at once, "later" 1 s after, "slow" 3.5 s after: after "early"
    # stopped waiting (its 3 s timeout), before "later" would have (its own, 1 s on). "later"
    # used to wait for it and cut it in, "early" had cut it out, and both their rounds failed.
    # All three are expected (their peer records say they are at the round).
    board = Board()
    ids = {name: Identity.from_seed(f"mm-waves/{name}") for name in ("early", "later", "slow")}
    census = [peer(i.peer_id, 4) for i in ids.values()]
    makers = {name: maker(board, i, census) for name, i in ids.items()}
    for mm in makers.values():
        mm.timeout_seconds = 3.0

    async def start(name: str, after_seconds: float) -> Group | None:
        await asyncio.sleep(after_seconds)
        return await makers[name].form_group(4, endpoint=f"{name}:1")

    early, later, slow = await asyncio.gather(
        start("early", 0.0), start("later", 1.0), start("slow", 3.5)
    )
    assert members(early) == members(later) == sorted([ids["early"].peer_id, ids["later"].peer_id])
    assert slow is None  # alone in its wave: it trains on, and nobody waits for it


async def test_latecomers_within_one_wave_average_among_themselves() -> None:
    board = Board()
    ids = {name: Identity.from_seed(f"mm-waves/{name}") for name in ("a", "b", "late1", "late2")}
    census = [peer(i.peer_id, 6) for i in ids.values()]
    makers = {name: maker(board, i, census) for name, i in ids.items()}
    for mm in makers.values():
        mm.timeout_seconds = 4.0  # a 2 s wave

    async def start(name: str, after_seconds: float) -> Group | None:
        await asyncio.sleep(after_seconds)
        return await makers[name].form_group(6, endpoint=f"{name}:1")

    a, b, late1, late2 = await asyncio.gather(
        start("a", 0.0), start("b", 0.2), start("late1", 2.8), start("late2", 3.3)
    )
    assert members(a) == members(b) == sorted([ids["a"].peer_id, ids["b"].peer_id])
    assert members(late1) == members(late2) == sorted([ids["late1"].peer_id, ids["late2"].peer_id])


class Forgetful(Board):
    """A DHT whose reads of a round key miss ``lost`` after the first (a replica that answers
    differently, or not in time)."""

    def __init__(self, lost: str) -> None:
        super().__init__()
        self.lost, self.reads = lost, 0

    async def find_ready(self, round_: int) -> list[ReadyRecord]:
        self.reads += 1
        found = await super().find_ready(round_)
        return found if self.reads == 1 else [r for r in found if r.peer_id != self.lost]


async def test_a_candidate_a_later_read_misses_stays_a_candidate() -> None:
    me = Identity.from_seed("mm-waves/me")
    board = Forgetful(lost="mate-2")
    await board.announce_ready(ready("mate-1", 4))
    await board.announce_ready(ready("mate-2", 4))
    board.ready[4][me.peer_id] = ready(me.peer_id, 4)  # read back at the first read
    mm: Matchmaker = maker(board, me, [peer(p, 4) for p in (me.peer_id, "mate-1", "mate-2")])
    group = await mm.form_group(4, endpoint=f"{me.peer_id}:1")
    assert board.reads >= 2  # it read again after it had seen everyone (settle)
    assert members(group) == sorted([me.peer_id, "mate-1", "mate-2"])
