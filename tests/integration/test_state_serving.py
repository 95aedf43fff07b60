"""Who a donor serves its state to: signed, fresh requests meant for it, and no more than a share
of its downloads to any one peer; each refusal is its status, counted, and a flood of garbage is
not logged line by line. (Real gRPC servers on 127.0.0.1:0.)"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from swarmgrad.protocol import state
from swarmgrad.protocol.v1 import state_pb2
from tests.integration.state_donors import (
    JOINER,
    RUN,
    SPEC_HASH,
    TRUE,
    Donors,
    donors_fixture,  # noqa: F401  (the fixture donors)
)


async def _status(channel: grpc.aio.Channel, method: str, request: bytes) -> grpc.StatusCode:
    call = channel.unary_stream(f"/{state.SERVICE}/{method}")
    try:
        async for _ in call(request, timeout=10):
            pass
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def test_only_signed_fresh_requests_meant_for_this_donor_are_served(
    donors: Donors, caplog: pytest.LogCaptureFixture
) -> None:
    name, channel = await donors.add("donor")
    servicer = donors.servicers[name]
    template = state_pb2.StateRequest(run_id=RUN, spec_hash=SPEC_HASH, root=TRUE.checksum)
    good = state.signed_request(
        JOINER, state.DOWNLOAD_METHOD, name, template, first_chunk=0, num_chunks=1
    )
    for_another = state.signed_request(
        JOINER, state.DOWNLOAD_METHOD, "other", template, num_chunks=1
    )
    for_another.receiver = name  # the signature was for "other"
    unsigned = state_pb2.StateRequest()
    unsigned.CopyFrom(good)
    unsigned.ClearField("auth")
    cases = [
        (unsigned.SerializeToString(), grpc.StatusCode.UNAUTHENTICATED),
        (for_another.SerializeToString(), grpc.StatusCode.UNAUTHENTICATED),
        (b"\xff\x01garbage", grpc.StatusCode.INVALID_ARGUMENT),
        (good.SerializeToString(), grpc.StatusCode.OK),
        (good.SerializeToString(), grpc.StatusCode.UNAUTHENTICATED),  # the same request again
    ]
    with caplog.at_level("INFO"):
        for request, expected in cases:
            assert await _status(channel, "Download", request) == expected, request[:20]
        for _ in range(50):  # a flood of garbage: counted, not logged line by line
            await _status(channel, "Manifest", b"\x0a\xff")
    refused = servicer.rejections.by_code("State")
    assert refused == {"UNAUTHENTICATED": 3, "BAD_PAYLOAD": 51}
    lines = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) <= 4
    assert all(r.levelname == "INFO" for r in lines)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_one_peer_cannot_hold_more_than_its_share_of_a_donors_downloads(
    donors: Donors,
) -> None:
    gate = asyncio.Event()

    async def hold(num_bytes: int) -> None:
        await gate.wait()

    name, channel = await donors.add("donor", pace=hold)
    template = state_pb2.StateRequest(run_id=RUN, spec_hash=SPEC_HASH, root=TRUE.checksum)

    def request() -> bytes:
        signed = state.signed_request(JOINER, state.DOWNLOAD_METHOD, name, template, num_chunks=1)
        return signed.SerializeToString()

    limit = 2 * state.STREAMS_PER_DONOR
    held = [asyncio.create_task(_status(channel, "Download", request())) for _ in range(limit)]
    async with asyncio.timeout(10):
        while sum(donors.servicers[name]._downloads.values()) < limit:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert await _status(channel, "Download", request()) == grpc.StatusCode.RESOURCE_EXHAUSTED
    gate.set()
    assert set(await asyncio.gather(*held)) == {grpc.StatusCode.OK}
