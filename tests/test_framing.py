"""Framed messages serialize to exactly what protobuf would produce, without its copies."""

from __future__ import annotations

import os

import pytest
import torch

from swarmgrad.compression import get_codec
from swarmgrad.protocol.averaging import framed_chunk
from swarmgrad.protocol.framing import Framed, serialize
from swarmgrad.protocol.v1 import averaging_pb2


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 70_000, 5 << 20])
@pytest.mark.parametrize("kind", [averaging_pb2.AggregateRequest, averaging_pb2.AggregateResponse])
def test_framed_bytes_parse_as_the_full_message(kind: type, size: int) -> None:
    payload = os.urandom(size)
    _, meta = get_codec("none").encode(torch.ones(3))
    frame = framed_chunk(kind, 7, payload, meta)
    if kind is averaging_pb2.AggregateResponse:
        frame.message.contributors.extend([0, 2, 5])
    parsed = kind.FromString(serialize(frame))
    assert parsed.chunk.payload == payload
    assert parsed.chunk.index == 7
    assert parsed.chunk.meta == frame.message.chunk.meta
    expected = kind()
    expected.CopyFrom(frame.message)
    expected.chunk.payload = payload
    assert parsed == expected


def test_plain_messages_pass_through_and_a_filled_payload_is_refused() -> None:
    message = averaging_pb2.AggregateRequest(chunk=averaging_pb2.Chunk(index=1, payload=b"xy"))
    assert serialize(message) == message.SerializeToString()
    with pytest.raises(ValueError, match="empty"):
        serialize(Framed(message, b"more"))
