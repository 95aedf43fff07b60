"""The Averaging servicer against hostile input, on a real grpc.aio server (127.0.0.1:0): each
bad message gets its own status and is counted, nobody streams in a member's name without its key,
and honest rounds stay correct throughout."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import math
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import grpc
import pytest
import torch

from swarmgrad.compression import decode, get_codec
from swarmgrad.node.averaging.allreduce import AllReduceConfig, RoundResult
from swarmgrad.node.averaging.averager import Averager, standalone
from swarmgrad.node.averaging.group import Group, Member
from swarmgrad.node.identity import Identity
from swarmgrad.protocol.auth import Verifier, signed_bytes
from swarmgrad.protocol.averaging import AGGREGATE, ChunkResult, StreamHeader, header_to_proto
from swarmgrad.protocol.averaging_service import AveragingServicer, add_to_server
from swarmgrad.protocol.errors import ProtocolViolation, RoundAborted
from swarmgrad.protocol.tensors import meta_to_proto
from swarmgrad.protocol.v1 import averaging_pb2, averaging_pb2_grpc
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

CHUNK = 4096
SIZE = 3 * CHUNK + 100
CONFIG = AllReduceConfig(
    run_id="svc",
    spec_hash=b"\x01" * 32,
    codec="int8",
    chunk_values=CHUNK,
    sender_timeout_seconds=6.0,
    reducer_timeout_seconds=12.0,
    round_timeout_seconds=30.0,
    join_timeout_seconds=0.5,
)

Request = averaging_pb2.AggregateRequest


def vector(seed: int) -> torch.Tensor:
    return torch.randn(SIZE, generator=torch.Generator().manual_seed(seed))


@functools.cache
def ident(name: str) -> Identity:
    """The key of the test peer called ``name`` (the same every run)."""
    return Identity.from_seed(f"test-averaging-service/{name}")


def group_of(round_: int, owner: Averager, honest: Averager, evil: list[str]) -> Group:
    members = [Member(peer_id=owner.peer_id, endpoint=owner.endpoint, bandwidth=1.0)]
    members.append(Member(peer_id=honest.peer_id, endpoint=honest.endpoint, bandwidth=0.0))
    members += [
        Member(peer_id=ident(e).peer_id, endpoint="127.0.0.1:9", bandwidth=0.0) for e in evil
    ]
    return Group(round=round_, members=tuple(members))


def header(group: Group, sender: str, *, signer: str | None = None, **changes: object) -> Request:
    """``sender``'s header for part 0 (the owner's), signed with the key of ``signer`` (default:
    the sender's own); ``changes`` are made before signing."""
    h = StreamHeader(
        run_id=CONFIG.run_id,
        spec_hash=CONFIG.spec_hash,
        round=group.round,
        group_id=group.group_id,
        sender=ident(sender).peer_id,
        receiver=ident("owner").peer_id,
        part=0,
        weight=1.0,
    )
    h = replace(h, **changes)  # type: ignore[arg-type]
    key = ident(signer or sender)
    if signer is not None:  # sign in another's name: header_to_proto refuses to
        h = replace(h, sender=key.peer_id)
        message = header_to_proto(h, key)
        message.header.sender = ident(sender).peer_id
        return message
    return header_to_proto(h, key)


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


def chunk(index: int, values: torch.Tensor, codec: str = "int8") -> Request:
    payload, meta = get_codec(codec).encode(values)
    return Request(
        chunk=averaging_pb2.Chunk(index=index, meta=meta_to_proto(meta), payload=payload)
    )


def expected_two_member_average(owner_seed: int, honest_seed: int) -> torch.Tensor:
    """Owner's own values exact, the honest member's through int8, the mean re-encoded."""
    codec = get_codec("int8")
    own, other = vector(owner_seed), vector(honest_seed)
    out = torch.empty(SIZE)
    for start in range(0, SIZE, CHUNK):
        end = min(start + CHUNK, SIZE)
        mean = (own[start:end] * 0.5 + decode(*codec.encode(other[start:end])) * 0.5) / 1.0
        out[start:end] = decode(*codec.encode(mean))
    return out


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Averager, Averager]]:
    async with (
        standalone(ident("owner"), CONFIG) as owner,
        standalone(ident("honest"), CONFIG) as honest,
    ):
        yield owner, honest


async def rpc(
    endpoint: str, messages: list[Request], timeout_seconds: float = 10.0
) -> grpc.StatusCode:
    """Send ``messages`` on one Aggregate stream; the status it ended with."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        call = averaging_pb2_grpc.AveragingStub(channel).Aggregate(
            iter(messages), timeout=timeout_seconds
        )
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as error:
            return error.code()
        return grpc.StatusCode.OK


async def honest_round(
    owner: Averager, honest: Averager, group: Group, seeds: tuple[int, int]
) -> tuple[RoundResult, RoundResult]:
    results = await asyncio.gather(
        owner.all_reduce(vector(seeds[0]), group), honest.all_reduce(vector(seeds[1]), group)
    )
    return results[0], results[1]


def check_honest(results: tuple[RoundResult, RoundResult], seeds: tuple[int, int]) -> None:
    for result in results:
        assert set(result.contributors) == {ident("owner").peer_id, ident("honest").peer_id}
        assert result.missing == ()
    assert torch.equal(results[0].averaged, results[1].averaged)
    expected = expected_two_member_average(*seeds)
    assert torch.allclose(results[0].averaged, expected, atol=1e-6)


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


def mutate(message: Request, rng: random.Random) -> Request:
    """A structurally plausible but broken copy of ``message``."""
    data = bytearray(message.SerializeToString())
    kind = rng.randrange(6)
    if kind == 0 and data:  # flip random bytes of the encoding
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        try:
            return Request.FromString(bytes(data))
        except Exception:
            return Request(chunk=averaging_pb2.Chunk(index=rng.randrange(9), payload=bytes(data)))
    out = Request()
    out.CopyFrom(message)
    if out.WhichOneof("body") == "header":
        h = out.header
        field = rng.choice(["round", "group", "part", "weight", "run", "sender"])
        if field == "round":
            h.key.round = rng.randrange(1 << 40)
        elif field == "group":
            h.key.group_id = rng.randbytes(rng.choice([0, 16, 100]))
        elif field == "part":
            h.part = rng.randrange(1 << 31)
        elif field == "weight":
            h.weight = rng.choice([-1.0, math.inf, math.nan, 0.0, 1e300])
        elif field == "run":
            h.key.run_id = "x" * rng.choice([0, 1, 300])
        else:
            h.sender = rng.choice(["", "owner", "y" * 1000])
        return out
    c = out.chunk
    choice = kind % 5
    if choice == 0:
        c.payload = c.payload[: rng.randrange(len(c.payload))]
    elif choice == 1:
        c.payload = rng.randbytes(len(c.payload))
    elif choice == 2:
        c.meta.shape[:] = [rng.randrange(-5, 1 << 20) for _ in range(rng.randint(0, 12))]
    elif choice == 3:
        c.meta.params["block_size"] = rng.choice([0, 1, 3, -8, 1 << 40])
    else:
        c.meta.codec = rng.choice(["", "int4", "topk", "z" * 100])
        c.meta.version = rng.randrange(5)
    return out


async def test_fuzz_1000_mutated_streams_crash_nothing_and_honest_rounds_stay_exact(
    pair: tuple[Averager, Averager],
) -> None:
    owner, honest = pair
    rng = random.Random(1234)
    streams = 1000
    fuzz_ids = [f"f{i}" for i in range(streams)]
    fuzz_group = group_of(1, owner, honest, fuzz_ids)  # a round of its own, full of fuzzers
    fuzz_round = asyncio.create_task(owner.all_reduce(vector(20), fuzz_group))
    honest_group = group_of(2, owner, honest, [])
    honest_during = asyncio.create_task(honest_round(owner, honest, honest_group, (30, 31)))

    statuses: list[grpc.StatusCode] = []
    limit = asyncio.Semaphore(16)

    async def one(i: int) -> None:
        valid = [header(fuzz_group, fuzz_ids[i]), chunk(0, vector(i)[:CHUNK])]
        # Break the header or the first chunk, so no fuzzer's values are ever accepted.
        target = rng.randrange(2)
        messages = [mutate(m, rng) if j == target else m for j, m in enumerate(valid)]
        async with limit:
            # A deadline far past a check's time, on a loaded machine too. (Streams that ran
            # into theirs in CI, 16 of 1000 at 10 s, had been refused while a result was being
            # written, and their status never left: see the last test here.)
            statuses.append(await rpc(owner.endpoint, messages, timeout_seconds=30))

    await asyncio.gather(*(one(i) for i in range(streams)))
    assert len(statuses) == streams
    assert grpc.StatusCode.OK not in statuses
    assert owner.servicer.rejections.total() == streams, collections.Counter(statuses)
    # Unparsable bytes too get their status: the owner never ends a stream with INTERNAL (a bug
    # of ours). A client may still read INTERNAL of its own: grpcio reports that, not the
    # server's status, when its write meets a stream the server has just refused (grpc/grpc
    # #36066; a refusal at the header, such as a group this owner is not in, is that quick).
    assert "INTERNAL" not in owner.servicer.rejections.by_code("Averaging")
    check_honest(await honest_during, (30, 31))
    check_honest(
        await honest_round(owner, honest, group_of(3, owner, honest, []), (40, 41)), (40, 41)
    )
    # The fuzzers' own round ends too (a flipped bit can make a valid message, so it may even
    # average something); what matters is that it ends and that honest rounds were exact.
    with contextlib.suppress(RoundAborted):
        await fuzz_round


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


async def test_error_feedback_carries_exactly_what_the_owner_did_not_receive(
    pair: tuple[Averager, Averager],
) -> None:
    """A member encodes each chunk once; what it reports as sent is what its owner decodes
    (the same bytes through the same decoder), its own part exact. Fed back round after round,
    nothing is lost: what went out plus one residual is what came in."""
    owner, honest = pair
    codec = get_codec(CONFIG.codec)
    size = 3 * CHUNK + 100
    residual, inputs, sent_total = torch.zeros(size), torch.zeros(size), torch.zeros(size)
    generator = torch.Generator().manual_seed(5)
    for round_ in range(5):
        group = group_of(round_, owner, honest, [])
        mine, theirs = (
            torch.randn(size, generator=generator),
            torch.randn(size, generator=generator),
        )
        compensated = theirs + residual
        own, member = await asyncio.gather(
            owner.all_reduce(mine, group, keep_sent=True),
            honest.all_reduce(compensated, group, keep_sent=True),
        )
        assert own.sent is not None
        assert member.sent is not None
        assert torch.equal(own.sent, mine)  # the owner's part is reduced from its exact values
        for start in range(0, size, CHUNK):  # the honest member owns nothing: every chunk goes
            piece = compensated[start : start + CHUNK]
            assert torch.equal(member.sent[start : start + CHUNK], decode(*codec.encode(piece)))
        assert not torch.equal(member.sent, compensated)  # int8 loses something
        residual = compensated - member.sent
        inputs += theirs
        sent_total += member.sent
    assert torch.allclose(sent_total + residual, inputs, atol=1e-4)
    assert (sent_total - inputs).norm() < 2 * residual.norm() + 1e-6


async def test_an_owners_results_go_through_its_upload_cap() -> None:
    # The owner owns the whole vector, so every byte it uploads is a result: with its link
    # capped, the round cannot end before those bytes could have gone up the link.
    rate = 20_000.0  # bytes per second: the results (~3 x 4 KiB x int8) take ~0.6 s
    async with (
        standalone(ident("owner"), CONFIG, upload_bytes_per_second=rate) as owner,
        standalone(ident("honest"), CONFIG) as honest,
    ):
        group = group_of(7, owner, honest, [])
        started = time.monotonic()
        results = await honest_round(owner, honest, group, (5, 6))
        elapsed = time.monotonic() - started
    check_honest(results, (5, 6))
    sent = owner.traffic["sent"]
    assert sent > 3 * CHUNK  # the results, one byte per value and the blocks' scales
    burst = 0.1 * rate  # what the bucket lets through at once
    assert elapsed >= (sent - burst) / rate


class _FailsWhileResultIsWritten:
    """A part session whose first result is being written when its reader fails (one chunk
    in, the next refused): the stream must still end with the refusal's status at once."""

    codec = ("int8", get_codec("int8").version)
    chunk_numels = (CHUNK, CHUNK)
    max_chunk_bytes = 1 << 20
    sender_timeout_seconds = 5.0

    def __init__(self) -> None:
        self._accepted = asyncio.Event()
        self._writing = asyncio.Event()

    async def accept(self, index: int, values: torch.Tensor, chunk: averaging_pb2.Chunk) -> None:
        self._accepted.set()
        await self._writing.wait()
        await asyncio.sleep(0)  # the writer has handed its write to gRPC
        raise ProtocolViolation(ResultCode.BAD_PAYLOAD, "refused while a result goes out")

    async def results(self) -> AsyncIterator[ChunkResult]:
        await self._accepted.wait()
        _, meta = get_codec("int8").encode(vector(3)[:CHUNK])
        self._writing.set()
        # Bytes enough (3 MiB) that the write waits for the caller's flow-control window.
        yield ChunkResult(index=0, payload=bytes(3 << 20), meta=meta, contributors=(0,))

    async def account(self) -> None:
        return None

    def close(self, error: object) -> None:
        pass


class _OneSession:
    async def open_session(self, header: StreamHeader) -> _FailsWhileResultIsWritten:
        return _FailsWhileResultIsWritten()

    async def check(self, statement: object, signed: object) -> None:
        return None


async def test_a_stream_refused_while_a_result_is_written_still_gets_its_status() -> None:
    # CI once saw a fuzzed stream wait for its whole deadline: the refusal's status could not
    # leave after a cancelled write (gRPC's ExecuteBatchError). Each call here gets its status
    # well within a deadline it would otherwise run into.
    server = grpc.aio.server()
    servicer = AveragingServicer(_OneSession(), verifier=Verifier(ident("owner").peer_id))
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        group = Group(round=1, members=(Member(peer_id=ident("a").peer_id, endpoint="x:1"),))
        statuses = [
            await rpc(
                f"127.0.0.1:{port}",
                [header(group, "a", round=1 + i), chunk(0, vector(i)[:CHUNK])],
                timeout_seconds=10,
            )
            for i in range(5)
        ]
    finally:
        await server.stop(None)
    assert statuses == [grpc.StatusCode.INVALID_ARGUMENT] * 5
    assert servicer.rejections.by_code()["BAD_PAYLOAD"] == 5


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
