"""Matchmaking's settle time (``cut.Settle``): the wait before its last read follows what a DHT
store costs from this node, so a swarm on a fast DHT does not wait the longest settle time every
round, and one on a slow DHT still cuts in the records that were on their way."""

from __future__ import annotations

import asyncio

import pytest

from swarmgrad.node.averaging.cut import (
    MIN_SETTLE_SECONDS,
    SETTLE_HISTORY,
    SETTLE_PER_STORE,
    Settle,
)
from swarmgrad.node.discovery.records import ReadyRecord
from swarmgrad.node.identity import Identity
from tests.unit.test_matchmaking_rules import Board, maker, peer, ready

LONGEST = 0.5


def test_the_settle_time_is_a_few_stores_within_its_bounds() -> None:
    settle = Settle(LONGEST)
    assert settle.seconds == LONGEST  # nothing measured yet: the longest
    settle.stored(0.005)
    assert settle.seconds == MIN_SETTLE_SECONDS
    settle.stored(0.05)
    assert settle.seconds == pytest.approx(SETTLE_PER_STORE * 0.05)
    settle.stored(1.0)  # one slow store: the longest, until it leaves the history
    assert settle.seconds == LONGEST
    for _ in range(SETTLE_HISTORY - 1):
        settle.stored(0.04)
        assert settle.seconds == LONGEST
    settle.stored(0.04)
    assert settle.seconds == pytest.approx(SETTLE_PER_STORE * 0.04)


class SlowBoard(Board):
    """A DHT whose stores take ``delay``; ``mine`` is set when ``me``'s own record has landed."""

    def __init__(self, delay: float, me: str) -> None:
        super().__init__()
        self.delay, self.me, self.mine = delay, me, asyncio.Event()

    async def announce_ready(self, record: ReadyRecord) -> None:
        await asyncio.sleep(self.delay)
        await super().announce_ready(record)
        if record.peer_id == self.me:
            self.mine.set()


async def _group_with_straggler(store_seconds: float, straggler_after: float) -> set[str]:
    """The members of ``me``'s round-3 group: ``mate`` is ready, ``late`` (whom nobody waits
    for) lands ``straggler_after`` seconds after ``me``'s own record has."""
    me = Identity.from_seed("mm-settle/me")
    board = SlowBoard(store_seconds, me.peer_id)
    board.ready[3] = {"mate": ready("mate", 3)}
    matchmaker = maker(board, me, [peer(me.peer_id, 3), peer("mate", 3)], settle_seconds=LONGEST)

    async def straggler() -> None:
        await board.mine.wait()
        await asyncio.sleep(straggler_after)
        board.ready[3]["late"] = ready("late", 3)

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(straggler())
        group = await matchmaker.form_group(3, endpoint="me:1")
    assert group is not None
    return {m.peer_id for m in group.members} - {me.peer_id}


async def test_on_a_slow_dht_a_record_on_its_way_is_still_cut_in() -> None:
    # Stores of 0.15 s: the wait is 0.45 s, and a record landing 0.2 s after this node's is in.
    assert await _group_with_straggler(0.15, 0.2) == {"mate", "late"}


async def test_on_a_fast_dht_the_round_does_not_wait_the_longest_settle_time() -> None:
    # Stores of no time: the wait is the shortest, and the last read is long done 0.4 s later
    # (the longest settle time, 0.5 s, would have read "late" too).
    assert await _group_with_straggler(0.0, 0.4) == {"mate"}
