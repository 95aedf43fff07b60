"""Early streams against throwaway keys (issue 42, finding 7), on real grpc.aio servers
(127.0.0.1:0): a stranger's streams for rounds that never come hold the shared early slots, and a
member the owner's matchmaking expects still waits for the owner's round in a slot of its own."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest

from swarmgrad.node.averaging.averager import Averager, standalone
from swarmgrad.node.averaging.registry import MAX_EARLY_STREAMS
from swarmgrad.protocol.averaging import StreamHeader, header_to_proto
from tests.helpers import until
from tests.integration.averaging_streams import (
    CONFIG,
    check_honest,
    group_of,
    ident,
    rpc,
    vector,
)

#: Long enough that the flood still waits when the honest round comes.
PATIENT = replace(CONFIG, join_timeout_seconds=20.0)
FLOOD = 80  # more than every early slot there ever was (64)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Averager, Averager]]:
    async with (
        standalone(ident("owner"), PATIENT) as owner,
        standalone(ident("honest"), PATIENT) as honest,
    ):
        yield owner, honest


async def stranger_stream(owner: Averager, i: int) -> grpc.StatusCode:
    """Stranger ``i``'s stream (its own fresh key) for a round that will never start: how it
    ended."""
    stranger = ident(f"stranger-{i}")
    header = StreamHeader(
        run_id=PATIENT.run_id,
        spec_hash=PATIENT.spec_hash,
        round=10**6 + i,
        group_id=os.urandom(16),
        sender=stranger.peer_id,
        receiver=owner.peer_id,
        part=0,
        weight=1.0,
    )
    return await rpc(owner.endpoint, [header_to_proto(header, stranger)], timeout_seconds=30)


async def test_a_member_expected_by_matchmaking_waits_through_a_flood_of_early_streams(
    pair: tuple[Averager, Averager],
) -> None:
    owner, honest = pair
    refusals = owner.servicer.rejections
    flood = [asyncio.ensure_future(stranger_stream(owner, i)) for i in range(FLOOD)]
    try:

        async def full() -> bool:  # every shared slot held, the rest of the flood refused
            waiting = sum(owner.servicer.open_streams.values())
            return waiting >= MAX_EARLY_STREAMS and refusals.by_code()["OVERLOADED"] >= (
                FLOOD - MAX_EARLY_STREAMS
            )

        await until(full, timeout_seconds=15, what="the flood to hold every shared slot")
        flooded = refusals.by_code()["OVERLOADED"]
        group = group_of(7, owner, honest, [])
        owner.expect(7, {honest.peer_id})  # what the owner's matchmaking tells it
        early = asyncio.ensure_future(honest.all_reduce(vector(1), group))

        async def arrived() -> bool:  # the member's stream waits at the owner (or was refused)
            return honest.peer_id in owner.servicer.open_streams or (
                refusals.by_code()["OVERLOADED"] > flooded
            )

        await until(arrived, timeout_seconds=10, what="the member's stream at the owner")
        assert refusals.by_code()["OVERLOADED"] == flooded  # it was not refused
        results = await asyncio.gather(owner.all_reduce(vector(0), group), early)
        check_honest((results[0], results[1]), (0, 1))
    finally:
        for call in flood:
            call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*flood, return_exceptions=True)


async def test_a_stranger_is_not_given_a_members_slot(pair: tuple[Averager, Averager]) -> None:
    # Expected members' slots are theirs: a key nobody expects waits in the shared pool, and
    # is refused once the pool is full, whatever round it names.
    owner, _ = pair
    owner.expect(10**6, {ident("somebody").peer_id})
    flood = [asyncio.ensure_future(stranger_stream(owner, i)) for i in range(FLOOD)]
    try:

        async def settled() -> bool:
            waiting = sum(owner.servicer.open_streams.values())
            return waiting + owner.servicer.rejections.by_code()["OVERLOADED"] >= FLOOD

        await until(settled, timeout_seconds=15, what="every stream waiting or refused")
        assert sum(owner.servicer.open_streams.values()) == MAX_EARLY_STREAMS
    finally:
        for call in flood:
            call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*flood, return_exceptions=True)
