"""Peers that go quiet mid-round, on real grpc.aio servers (127.0.0.1:0): a frozen process
neither answers nor resets its connections, so only asking it whether it is there finds it
before the round's timeouts (``node/averaging/quiet.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest

from swarmgrad.node.averaging.allreduce import AllReduceConfig, RoundResult
from swarmgrad.node.averaging.averager import Averager, standalone
from swarmgrad.node.averaging.group import Group, Member
from swarmgrad.node.averaging.quiet import QUIET_SECONDS, UNANSWERED_PROBES
from swarmgrad.node.averaging.registry import Registry
from swarmgrad.node.kinds import Presence
from swarmgrad.protocol.v1 import averaging_pb2_grpc
from tests.integration.averaging_streams import (
    CONFIG,
    Request,
    chunk,
    header,
    ident,
    vector,
)

#: Timeouts a quiet peer would otherwise cost: the sender's 30 s, the owner's 60 s.
PATIENT = replace(
    CONFIG,
    sender_timeout_seconds=30.0,
    reducer_timeout_seconds=60.0,
    round_timeout_seconds=90.0,
    join_timeout_seconds=5.0,
)
PROBE_SECONDS = 2.0


async def answers(peer_id: str, endpoint: str, round_key: tuple[int, bytes]) -> Presence:
    """The test's question: does anything answer at ``endpoint`` within the deadline? (An
    averager that serves only Averaging answers GetInfo with UNIMPLEMENTED; a frozen endpoint
    answers nothing.) A node asks with a signed GetInfo that names the round
    (``PeerService.presence``; tests/integration/test_reachability.py)."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        try:
            await channel.unary_unary("/swarmgrad.v1.Peer/GetInfo")(b"", timeout=PROBE_SECONDS)
        except grpc.aio.AioRpcError as error:
            silent = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
            return Presence.GONE if error.code() in silent else Presence.THERE
    return Presence.THERE


@contextlib.asynccontextmanager
async def frozen_endpoint() -> AsyncIterator[str]:
    """An endpoint whose process froze: the kernel still accepts connections, nothing answers."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for writer in held:
            writer.close()
        server.close()


@contextlib.asynccontextmanager
async def averagers(config: AllReduceConfig) -> AsyncIterator[tuple[Averager, Averager, str]]:
    """Two live averagers that ask quiet peers, and a frozen endpoint."""
    async with (
        standalone(ident("owner"), config, alive=answers) as owner,
        standalone(ident("honest"), config, alive=answers) as honest,
        frozen_endpoint() as frozen_at,
    ):
        yield owner, honest, frozen_at


@pytest.fixture
async def trio() -> AsyncIterator[tuple[Averager, Averager, str]]:
    async with averagers(PATIENT) as three:
        yield three


def group_of(round_: int, trio: tuple[Averager, Averager, str], *, others_own: bool) -> Group:
    """The owner (which owns a part), the honest member and the frozen one (which own parts
    too if ``others_own``)."""
    owner, honest, frozen_at = trio
    bandwidth = 1.0 if others_own else 0.0
    return Group(
        round=round_,
        members=(
            Member(peer_id=owner.peer_id, endpoint=owner.endpoint, bandwidth=1.0),
            Member(peer_id=honest.peer_id, endpoint=honest.endpoint, bandwidth=bandwidth),
            Member(peer_id=ident("frozen").peer_id, endpoint=frozen_at, bandwidth=bandwidth),
        ),
    )


async def round_with_a_stalled_stream(
    trio: tuple[Averager, Averager, str], group: Group
) -> tuple[list[RoundResult], float]:
    """Owner and honest member average ``group``, whose third member ("frozen") opens its
    stream to the owner, sends its first chunk and then nothing, its stream left open: their
    results, and how long the round took."""
    owner, honest, _ = trio
    stalled = asyncio.Event()

    async def first_chunk_then_silence() -> AsyncIterator[Request]:
        yield header(group, "frozen")
        yield chunk(0, vector(2)[:4096])
        stalled.set()
        await asyncio.Event().wait()  # the stream stays open; nothing more comes

    started = time.monotonic()
    rounds = asyncio.gather(owner.all_reduce(vector(0), group), honest.all_reduce(vector(1), group))
    async with grpc.aio.insecure_channel(owner.endpoint) as channel:
        stream = averaging_pb2_grpc.AveragingStub(channel).Aggregate(
            first_chunk_then_silence(), timeout=60
        )
        await asyncio.wait_for(stalled.wait(), 10)
        results = await rounds
        elapsed = time.monotonic() - started
        stream.cancel()
    return list(results), elapsed


async def test_an_owner_drops_a_member_that_froze_mid_stream_in_seconds(
    trio: tuple[Averager, Averager, str],
) -> None:
    # The frozen member owns no part (bandwidth 0, as a relayed peer): nobody streams to it, so
    # only the owner, whose part it holds up, can find it gone.
    results, elapsed = await round_with_a_stalled_stream(trio, group_of(1, trio, others_own=False))
    for result in results:
        contributors = result.chunk_contributors
        assert contributors[(0, 0)] == (0, 1, 2)  # its first chunk was in
        assert all(contributors[(0, i)] == (0, 1) for i in (1, 2, 3)), contributors
    asked = QUIET_SECONDS + UNANSWERED_PROBES * PROBE_SECONDS
    assert elapsed < asked + 5.0, elapsed  # not the sender timeout (30 s)


async def test_a_member_drops_an_owner_that_froze_in_seconds(
    trio: tuple[Averager, Averager, str],
) -> None:
    # The frozen peer owns a part: each member's stream to it hangs, unanswered.
    owner, honest, _ = trio
    group = group_of(2, trio, others_own=True)
    started = time.monotonic()
    results = await asyncio.gather(
        owner.all_reduce(vector(0), group), honest.all_reduce(vector(1), group)
    )
    elapsed = time.monotonic() - started
    frozen_id = ident("frozen").peer_id
    for result in results:
        assert "answered none of 2 liveness probes" in result.failures[frozen_id]
        assert result.missing  # its part: the caller's own values, listed as not averaged
    assert elapsed < QUIET_SECONDS + UNANSWERED_PROBES * PROBE_SECONDS + 5.0, elapsed


async def test_a_member_that_answers_but_stalls_is_not_dropped_before_its_timeout() -> None:
    # A keyed member that answers every question yet sends nothing more cannot be told from a
    # slow uplink: it is waited for up to the sender timeout (8 s here), as before the
    # questions, and no longer (the questions do not keep it in the round either).
    quick = replace(PATIENT, sender_timeout_seconds=8.0)
    async with averagers(quick) as (owner, honest, _):
        answering = (owner, honest, honest.endpoint)  # something answers at its endpoint
        results, elapsed = await round_with_a_stalled_stream(
            answering, group_of(3, answering, others_own=False)
        )
    for result in results:
        contributors = result.chunk_contributors
        assert all(contributors[(0, i)] == (0, 1) for i in (1, 2, 3)), contributors
    assert quick.sender_timeout_seconds <= elapsed < quick.sender_timeout_seconds + 5.0, elapsed


async def test_an_owner_drops_a_member_that_has_left_the_round_at_once() -> None:
    # What a node resumed after a freeze meets (test_crash_recovery): the others went on without
    # it, their streams to its part never reached it, and they still answer. Asked, a member
    # that has left the round says so (signed: test_reachability), and is dropped then, not at
    # the open timeout (the sender timeout: 30 s here). One that is still in it is waited for.
    gone_on: set[str] = set()

    async def presence(peer_id: str, endpoint: str, round_key: tuple[int, bytes]) -> Presence:
        return Presence.LEFT if peer_id in gone_on else await answers(peer_id, endpoint, round_key)

    async with (
        standalone(ident("owner"), PATIENT, alive=presence) as owner,
        standalone(ident("honest"), PATIENT, alive=presence) as honest,
    ):
        # "moved-on" owns no part and never opens its stream to the owner's part.
        moved_on = Member(peer_id=ident("moved-on").peer_id, endpoint=honest.endpoint, bandwidth=0)
        group = Group(
            round=5,
            members=(
                Member(peer_id=owner.peer_id, endpoint=owner.endpoint, bandwidth=1.0),
                Member(peer_id=honest.peer_id, endpoint=honest.endpoint, bandwidth=0.0),
                moved_on,
            ),
        )
        gone_on.add(moved_on.peer_id)
        started = time.monotonic()
        results = await asyncio.gather(
            owner.all_reduce(vector(0), group), honest.all_reduce(vector(1), group)
        )
        elapsed = time.monotonic() - started
    for result in results:
        assert all(c == (0, 1) for c in result.chunk_contributors.values()), result
    assert elapsed < QUIET_SECONDS + 5.0, elapsed  # not the 30 s open timeout


async def test_a_group_split_by_matchmaking_drops_its_dissenter_in_seconds() -> None:
    # Two peers' matchmakings cut different sets for one round: A and B run {A, B, C}, while C
    # runs {C, D}. C refuses A's and B's streams at once (it runs round 7 in another group),
    # and answers their owners' question that it has left their group's round: they drop it
    # then. Before, the streams waited out C's join timeout and the owners waited for C's
    # streams until the open timeout (the sender timeout: 30 s here).
    names = ("a", "b", "c", "d")
    registries = {ident(n).peer_id: Registry(PATIENT.join_timeout_seconds) for n in names}

    async def presence(peer_id: str, endpoint: str, round_key: tuple[int, bytes]) -> Presence:
        if await answers(peer_id, endpoint, round_key) is not Presence.THERE:
            return Presence.GONE
        # What the peer's Peer service says from its registry (signed: test_reachability).
        return Presence.LEFT if registries[peer_id].left(round_key) else Presence.THERE

    async with contextlib.AsyncExitStack() as stack:
        a, b, c, d = [
            await stack.enter_async_context(
                standalone(ident(n), PATIENT, alive=presence, registry=registries[ident(n).peer_id])
            )
            for n in names
        ]

        def member(averager: Averager) -> Member:
            return Member(peer_id=averager.peer_id, endpoint=averager.endpoint, bandwidth=1.0)

        split = Group(round=7, members=(member(a), member(b), member(c)))
        apart = Group(round=7, members=(member(c), member(d)))
        started = time.monotonic()
        in_split = asyncio.gather(a.all_reduce(vector(0), split), b.all_reduce(vector(1), split))
        in_apart = asyncio.gather(c.all_reduce(vector(2), apart), d.all_reduce(vector(3), apart))
        results, _ = await asyncio.gather(in_split, in_apart)
        elapsed = time.monotonic() - started
    for result in results:
        assert set(result.contributors) == {a.peer_id, b.peer_id}, result
        assert result.missing  # C's part: the caller's own values, listed as not averaged
        assert "another group" in result.failures[c.peer_id], result.failures
    assert elapsed < QUIET_SECONDS + 5.0, elapsed  # not the 30 s open timeout
