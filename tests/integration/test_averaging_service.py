"""The Averaging servicer against hostile input, on a real grpc.aio server (127.0.0.1:0): each
bad message gets its own status and is counted, nobody streams in a member's name without its key
or parks more streams than its budget, a stop is bounded with streams open, and a refusal reaches
the member as its status; honest rounds stay correct throughout."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import replace

import grpc
import pytest

from swarmgrad.node.averaging.averager import Averager, standalone
from swarmgrad.node.averaging.group import Group, Member
from swarmgrad.protocol.auth import signed_bytes
from swarmgrad.protocol.averaging import AGGREGATE
from swarmgrad.protocol.errors import RoundAborted
from swarmgrad.protocol.v1 import averaging_pb2_grpc
from tests.integration.averaging_streams import (
    CHUNK,
    CONFIG,
    Request,
    check_honest,
    chunk,
    group_of,
    header,
    honest_round,
    ident,
    rpc,
    vector,
)
from tests.integration.averaging_streams import pair as pair  # a fixture; "as" marks it used


def resigned(message: Request, sender: str, *, issued_at: float) -> Request:
    """``message`` (a header) signed again by ``sender`` as if at ``issued_at``."""
    h, auth = message.header, message.header.auth
    auth.issued_at = issued_at
    fields = [
        h.key.run_id,
        h.key.spec_hash,
        h.key.round,
        h.key.group_id,
        h.sender,
        h.part,
        h.weight,
    ]
    signed = signed_bytes(AGGREGATE, h.receiver, [auth.public_key, issued_at, auth.nonce, *fields])
    auth.signature = ident(sender).sign(signed)
    return message


BAD_INPUTS: list[tuple[str, grpc.StatusCode, str, Callable[[Group, str], list[Request]]]] = [
    (
        "wrong run id",
        grpc.StatusCode.FAILED_PRECONDITION,
        "WRONG_RUN",
        lambda g, e: [header(g, e, run_id="other-run")],
    ),
    (
        "wrong spec hash",
        grpc.StatusCode.FAILED_PRECONDITION,
        "WRONG_RUN",
        lambda g, e: [header(g, e, spec_hash=b"\x02" * 32)],
    ),
    (
        "unknown round",
        grpc.StatusCode.NOT_FOUND,
        "UNKNOWN_ROUND",
        lambda g, e: [header(g, e, round=g.round + 100)],
    ),
    (
        "unknown group",
        grpc.StatusCode.NOT_FOUND,
        "UNKNOWN_ROUND",
        lambda g, e: [header(g, e, group_id=b"\x00" * 16)],
    ),
    (
        "sender not in group",
        grpc.StatusCode.PERMISSION_DENIED,
        "NOT_A_MEMBER",
        lambda g, e: [header(g, "mallory")],
    ),
    (
        "a member's name signed with another key",
        grpc.StatusCode.UNAUTHENTICATED,
        "UNAUTHENTICATED",
        lambda g, e: [header(g, "honest", signer=e)],
    ),
    (
        "unsigned header",
        grpc.StatusCode.UNAUTHENTICATED,
        "UNAUTHENTICATED",
        lambda g, e: [unsigned(header(g, e))],
    ),
    (
        "header changed after signing",
        grpc.StatusCode.UNAUTHENTICATED,
        "UNAUTHENTICATED",
        lambda g, e: [changed_after_signing(header(g, e))],
    ),
    (
        "header for another receiver",
        grpc.StatusCode.UNAUTHENTICATED,
        "UNAUTHENTICATED",
        lambda g, e: [header(g, e, receiver=ident("honest").peer_id)],
    ),
    (
        "stale header",
        grpc.StatusCode.UNAUTHENTICATED,
        "UNAUTHENTICATED",
        lambda g, e: [resigned(header(g, e), e, issued_at=time.time() - 3600)],
    ),
    (
        "part not owned here",
        grpc.StatusCode.PERMISSION_DENIED,
        "NOT_A_MEMBER",
        lambda g, e: [header(g, e, part=1)],
    ),
    (
        "weight differs from the group's",
        grpc.StatusCode.INVALID_ARGUMENT,
        "BAD_PAYLOAD",
        lambda g, e: [header(g, e, weight=5.0)],
    ),
    (
        "NaN weight",
        grpc.StatusCode.INVALID_ARGUMENT,
        "BAD_PAYLOAD",
        lambda g, e: [header(g, e, weight=math.nan)],
    ),
    (
        "chunk before header",
        grpc.StatusCode.INVALID_ARGUMENT,
        "BAD_PAYLOAD",
        lambda g, e: [chunk(0, vector(1)[:CHUNK])],
    ),
    (
        "second header",
        grpc.StatusCode.INVALID_ARGUMENT,
        "BAD_PAYLOAD",
        lambda g, e: [header(g, e), header(g, e)],
    ),
    (
        "wrong codec",
        grpc.StatusCode.INVALID_ARGUMENT,
        "BAD_CODEC",
        lambda g, e: [header(g, e), chunk(0, vector(1)[:CHUNK], "fp16")],
    ),
    (
        "shape mismatch",
        grpc.StatusCode.INVALID_ARGUMENT,
        "BAD_SHAPE",
        lambda g, e: [header(g, e), chunk(0, vector(1)[:100])],
    ),
    (
        "chunk out of order",
        grpc.StatusCode.INVALID_ARGUMENT,
        "BAD_SHAPE",
        lambda g, e: [header(g, e), chunk(2, vector(1)[:CHUNK])],
    ),
    (
        "stream ends early",
        grpc.StatusCode.INVALID_ARGUMENT,
        "BAD_SHAPE",
        lambda g, e: [header(g, e)],
    ),
]


def unsigned(message: Request) -> Request:
    message.header.ClearField("auth")
    return message


def changed_after_signing(message: Request) -> Request:
    message.header.key.round += 1
    return message


def truncated(g: Group, e: str) -> list[Request]:
    message = chunk(0, vector(1)[:CHUNK])
    message.chunk.payload = message.chunk.payload[:-10]
    return [header(g, e), message]


def nan_values(g: Group, e: str) -> list[Request]:
    message = chunk(0, vector(1)[:CHUNK])
    payload = bytearray(message.chunk.payload)
    payload[0:4] = b"\x00\x00\xc0\x7f"  # first block's scale := NaN
    message.chunk.payload = bytes(payload)
    return [header(g, e), message]


def too_large(g: Group, e: str) -> list[Request]:
    message = chunk(0, vector(1)[:CHUNK])
    message.chunk.payload = bytes(CONFIG.max_chunk_bytes + 1)
    return [header(g, e), message]


BAD_INPUTS += [
    ("chunk too large", grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_LARGE", too_large),
    ("truncated payload", grpc.StatusCode.INVALID_ARGUMENT, "BAD_PAYLOAD", truncated),
    ("NaN values", grpc.StatusCode.INVALID_ARGUMENT, "NON_FINITE", nan_values),
]


async def test_every_bad_input_gets_its_status_and_the_honest_round_is_exact(
    pair: tuple[Averager, Averager],
) -> None:
    owner, honest = pair
    evil = [f"evil{i}" for i in range(len(BAD_INPUTS))]
    group = group_of(0, owner, honest, evil)
    owner_task = asyncio.create_task(owner.all_reduce(vector(10), group))
    honest_task = asyncio.create_task(honest.all_reduce(vector(11), group))
    for (case, status, code, build), sender in zip(BAD_INPUTS, evil, strict=True):
        before = owner.servicer.rejections.by_code()[code]
        got = await rpc(owner.endpoint, build(group, sender))
        assert got == status, case
        assert owner.servicer.rejections.by_code()[code] == before + 1, case
    check_honest((await owner_task, await honest_task), (10, 11))


async def test_duplicate_chunk_and_duplicate_stream_are_refused(
    pair: tuple[Averager, Averager],
) -> None:
    owner, honest = pair
    group = group_of(0, owner, honest, ["dup"])
    owner_task = asyncio.create_task(owner.all_reduce(vector(1), group))
    honest_task = asyncio.create_task(honest.all_reduce(vector(2), group))
    part = vector(3)[:CHUNK]
    got = await rpc(owner.endpoint, [header(group, "dup"), chunk(0, part), chunk(0, part)])
    assert got == grpc.StatusCode.ALREADY_EXISTS
    # The same sender again, on a new stream, for the same part.
    assert await rpc(owner.endpoint, [header(group, "honest")]) in (
        grpc.StatusCode.ALREADY_EXISTS,  # honest's own stream is still open
        grpc.StatusCode.NOT_FOUND,  # or the round already ended
    )
    assert owner.servicer.rejections.by_code()["DUPLICATE_PART"] >= 1
    await asyncio.gather(owner_task, honest_task)


async def test_too_many_concurrent_streams_from_one_peer_are_refused(
    pair: tuple[Averager, Averager],
) -> None:
    owner, honest = pair
    group = group_of(9, owner, honest, [])
    limit = owner.transport.limits.max_streams_per_peer
    # Streams for a round that has not started wait (join_timeout) while they count as open.
    waiting = [header(group, "honest", round=500 + i) for i in range(limit)]
    parked = [asyncio.create_task(rpc(owner.endpoint, [m])) for m in waiting]
    async with asyncio.timeout(5):
        while sum(owner.servicer.open_streams.values()) < limit:  # noqa: ASYNC110 - server state
            await asyncio.sleep(0.01)
    assert (
        await rpc(owner.endpoint, [header(group, "honest")]) == grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert owner.servicer.rejections.by_code()["OVERLOADED"] == 1
    assert set(await asyncio.gather(*parked)) == {grpc.StatusCode.NOT_FOUND}


async def test_nobody_parks_streams_in_a_members_name_or_replays_a_header(
    pair: tuple[Averager, Averager],
) -> None:
    owner, honest = pair
    group = group_of(5, owner, honest, ["mallory"])
    limit = owner.transport.limits.max_streams_per_peer
    # Mallory, a member, parks a stream budget's worth of streams in honest's name: every one is
    # refused before it counts against honest.
    forged = [header(group, "honest", signer="mallory", round=600 + i) for i in range(limit)]
    statuses = await asyncio.gather(*(rpc(owner.endpoint, [m]) for m in forged))
    assert set(statuses) == {grpc.StatusCode.UNAUTHENTICATED}
    assert owner.servicer.open_streams[honest.peer_id] == 0
    # A header seen once (here: for a round that never starts) is refused when sent again.
    seen = header(group, "mallory", round=700)
    assert await rpc(owner.endpoint, [seen]) == grpc.StatusCode.NOT_FOUND
    assert await rpc(owner.endpoint, [seen]) == grpc.StatusCode.UNAUTHENTICATED
    # Peer-sent strings are not echoed back at length.
    long_run = header(group, "mallory", run_id="x" * 250)
    async with grpc.aio.insecure_channel(owner.endpoint) as channel:
        call = averaging_pb2_grpc.AveragingStub(channel).Aggregate(iter([long_run]), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in call:
                pass
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "x" * 50 not in (refused.value.details() or "")
    check_honest(await honest_round(owner, honest, group_of(6, owner, honest, []), (8, 9)), (8, 9))


async def test_stop_is_graceful_and_bounded_with_streams_open() -> None:
    async with (
        standalone(ident("owner"), CONFIG) as owner,
        standalone(ident("honest"), CONFIG) as honest,
    ):
        group = group_of(0, owner, honest, [])
        # A stream parked on a round that never starts here: stop must not wait for it forever.
        parked = asyncio.create_task(rpc(owner.endpoint, [header(group, "honest", round=77)]))
        async with asyncio.timeout(5):
            while not owner.servicer.open_streams:  # noqa: ASYNC110 - server state
                await asyncio.sleep(0.01)
        started = asyncio.get_running_loop().time()
        await owner.stop()
        elapsed = asyncio.get_running_loop().time() - started
        assert elapsed < owner.transport.limits.grace_seconds + 2
        assert await parked != grpc.StatusCode.OK


async def test_an_owners_refusal_reaches_the_member_as_its_status_every_time() -> None:
    # An owner refuses a stream at its header (here: another run). The member writes its chunks
    # only once the owner has accepted the header: gRPC replaces the status of a call that ends
    # during a write with "INTERNAL Internal error from Core", and the member then could not
    # tell a refusal from a crash (a quarter of refusals, before).
    other = replace(CONFIG, run_id="other-run")
    async with (
        standalone(ident("owner"), other) as owner,
        standalone(ident("honest"), CONFIG) as member,
    ):
        group = Group(
            round=1,
            members=(
                Member(peer_id=owner.peer_id, endpoint=owner.endpoint, bandwidth=1.0),
                Member(peer_id=member.peer_id, endpoint=member.endpoint, bandwidth=0.0),
            ),
        )
        reasons = []
        for round_ in range(1, 21):
            with pytest.raises(RoundAborted) as refused:
                await member.all_reduce(vector(round_), replace(group, round=round_))
            reasons.append(str(refused.value))
    assert all("WRONG_RUN" in reason and "other-run" in reason for reason in reasons), reasons
