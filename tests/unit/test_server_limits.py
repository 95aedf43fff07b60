"""The server's limits as configured, and refusal details that stay short whatever a peer sent
(no sockets: the servers under load are in tests/integration/test_grpc_limits.py)."""

from __future__ import annotations

import pytest

from swarmgrad.protocol.averaging import check_chunk
from swarmgrad.protocol.errors import MAX_DETAIL_CHARS, ProtocolViolation
from swarmgrad.protocol.server import ServerLimits
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode


def test_a_connection_carries_no_more_streams_than_its_address_may_have() -> None:
    limits = ServerLimits()
    options = dict(limits.server_options())
    assert options["grpc.max_concurrent_streams"] == limits.max_streams_per_connection
    assert "grpc.max_concurrent_streams" not in dict(limits.options())  # a channel's options
    assert limits.max_unauthenticated_per_address < limits.max_rpcs_per_address
    assert limits.max_rpcs_per_address < limits.max_concurrent_rpcs
    assert limits.header_timeout_seconds <= 2.0


@pytest.mark.parametrize(
    "changes",
    [
        {"max_rpcs_per_address": 0},
        {"max_unauthenticated_per_address": 0},
        {"max_streams_per_connection": 0},
        {"max_rpcs_per_address": 8, "max_unauthenticated_per_address": 16},
        {"header_timeout_seconds": 0.0},
        {"request_timeout_seconds": -1.0},
    ],
)
def test_limits_that_cannot_work_are_refused(changes: dict[str, float]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each message names its own field
        ServerLimits(**changes)  # type: ignore[arg-type]


def test_a_violations_detail_is_cut_to_a_bounded_length() -> None:
    error = ProtocolViolation(ResultCode.BAD_PAYLOAD, "x" * 100_000)
    assert len(error.detail) == MAX_DETAIL_CHARS
    assert len(str(error)) < MAX_DETAIL_CHARS + 20


def test_a_chunk_with_a_huge_codec_name_or_dtype_is_named_briefly() -> None:
    chunk = averaging_pb2.Chunk(index=0, payload=b"\0" * 16)
    chunk.meta.codec = "z" * 100_000
    chunk.meta.version = 1
    with pytest.raises(ProtocolViolation) as codec:
        check_chunk(chunk, index=0, numels=[4], codec=("none", 1), max_bytes=1024)
    assert codec.value.code == ResultCode.BAD_CODEC
    assert len(str(codec.value)) < 120, str(codec.value)
    chunk.meta.codec = "none"
    chunk.meta.dtype = "d" * 100_000
    chunk.meta.shape[:] = [7] * 64
    with pytest.raises(ProtocolViolation) as shape:
        check_chunk(chunk, index=0, numels=[4], codec=("none", 1), max_bytes=1024)
    assert shape.value.code == ResultCode.BAD_SHAPE
    assert len(str(shape.value)) < 160, str(shape.value)
