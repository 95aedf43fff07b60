"""A node's registry of rounds (``node/averaging/registry.py``): what it answers of a round it is
not in. When two peers' matchmakings cut different sets, each runs the round's number in a group
of its own; a stream for the other group is refused at once (it used to wait the whole join
timeout for a round that never comes here), and the node says it has left that group's round
(the round's liveness question, ``quiet.py``), so an owner stops waiting for it. So too for a
round the node is past."""

from __future__ import annotations

import asyncio

import pytest

from swarmgrad.node.averaging.group import Group, Member
from swarmgrad.node.averaging.registry import ActiveRound, Registry
from swarmgrad.protocol.errors import ProtocolViolation


def group(round_: int, *names: str) -> Group:
    return Group(
        round=round_,
        members=tuple(Member(peer_id=n, endpoint=f"{n}:1", bandwidth=1.0) for n in names),
    )


async def test_a_round_run_here_in_another_group_is_refused_at_once_and_said_left() -> None:
    registry = Registry(join_timeout_seconds=30.0)
    mine, split = group(4, "me", "a", "b"), group(4, "me", "a")  # cut apart: one peer differs
    here, there = (4, mine.group_id), (4, split.group_id)
    await registry.add(here, ActiveRound(group=mine, me=0, reducer=None))

    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ProtocolViolation, match="is in round 4 with another group"):
        await registry.wait(there, "a")
    assert loop.time() - started < 1.0  # not the 30 s join timeout
    assert registry.left(there)
    assert not registry.left(here)  # the round it runs

    # A stream that came first waits (the node may start that round in a moment), and is
    # refused as soon as the node starts the round's number in its own group instead.
    fresh = Registry(join_timeout_seconds=30.0)
    early = asyncio.ensure_future(fresh.wait(there, "a"))
    for _ in range(3):  # let it run up to its wait
        await asyncio.sleep(0)
    assert not early.done()
    started = loop.time()
    await fresh.add(here, ActiveRound(group=mine, me=0, reducer=None))
    with pytest.raises(ProtocolViolation, match="is in round 4 with another group"):
        await early
    assert loop.time() - started < 1.0

    # Another round's number is not this one's business: a stream for it waits, as an early
    # stream for a round not started yet (here up to a short join timeout).
    brief = Registry(join_timeout_seconds=0.2)
    await brief.add(here, ActiveRound(group=mine, me=0, reducer=None))
    assert not brief.left((5, split.group_id))
    with pytest.raises(ProtocolViolation, match=r"no round 5 .* \(waited 0.2 s\)"):
        await brief.wait((5, split.group_id), "a")

    # Finished (it lingers for slow readers of its results), it has left it; a new matchmaking
    # of round 4 may now cut another group, so that one is no longer refused as elsewhere.
    registry.finish(here)
    assert registry.left(here)
    assert not registry.left(there)
    assert (await registry.wait(here, "a")).group == mine  # its results are still read
    registry.drop(here)  # its linger is over
    with pytest.raises(ProtocolViolation, match="round 4 has ended here"):
        await registry.wait(here, "a")

    # Averaged (its replica moved past round 4), or in a later round: round 4's other groups
    # it will never run either, and says so at once (CI: a peer that asked a finished one
    # after its round waited out the sender timeout, 10 s).
    registry.averaged(4)
    assert registry.left(there)
    with pytest.raises(ProtocolViolation, match="this node is past round 4"):
        await registry.wait(there, "a")
    later = Registry(join_timeout_seconds=30.0)
    await later.add((6, mine.group_id), ActiveRound(group=mine, me=0, reducer=None))
    assert later.left((5, split.group_id))
    assert not later.left((7, split.group_id))
