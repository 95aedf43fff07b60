"""Aggregate streams to a real Averaging servicer for tests: the peers' keys, their groups, signed
headers and chunks, and honest rounds checked against the exact average."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest
import torch

from swarmgrad.compression import decode, get_codec
from swarmgrad.node.averaging.allreduce import AllReduceConfig, RoundResult
from swarmgrad.node.averaging.averager import Averager, standalone
from swarmgrad.node.averaging.group import Group, Member
from swarmgrad.node.identity import Identity
from swarmgrad.protocol.averaging import StreamHeader, header_to_proto
from swarmgrad.protocol.tensors import meta_to_proto
from swarmgrad.protocol.v1 import averaging_pb2, averaging_pb2_grpc

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
