"""Framed messages serialize to exactly what protobuf would produce, without its copies."""

from __future__ import annotations

import os

import pytest
import torch

from swarmgrad.compression import get_codec
from swarmgrad.protocol.averaging import framed_chunk
from swarmgrad.protocol.framing import Framed, bytes_message, parse_flat, serialize
from swarmgrad.protocol.v1 import averaging_pb2, state_pb2


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


@pytest.mark.parametrize("index", [0, 1, 300, 2**40])
@pytest.mark.parametrize("size", [0, 1, 200, 1 << 20])
def test_flat_messages_match_protobuf_both_ways(index: int, size: int) -> None:
    payload = os.urandom(size)
    ours = bytes_message({1: index}, 2, memoryview(payload))
    assert state_pb2.StateChunk.FromString(ours) == state_pb2.StateChunk(
        index=index, values=payload
    )
    # protobuf's own encoding (which leaves out index 0 and an empty payload) parses the same
    varints, blobs = parse_flat(
        state_pb2.StateChunk(index=index, values=payload).SerializeToString()
    )
    assert varints.get(1, 0) == index
    assert bytes(blobs.get(2, b"")) == payload


def test_parse_flat_skips_unknown_fields_and_refuses_malformed_bytes() -> None:
    known = bytes_message({1: 5}, 2, b"xyz")
    fixed = b"\x1d" + b"\0" * 4 + b"\x21" + b"\0" * 8  # fields 3 (fixed32) and 4 (fixed64)
    varints, blobs = parse_flat(fixed + known + b"\x28\x07")  # and field 5 = 7
    assert (varints, bytes(blobs[2])) == ({1: 5, 5: 7}, b"xyz")
    for bad, why in [
        (b"\x08", "varint runs past"),
        (b"\x08" + b"\xff" * 11, "longer than 10 bytes"),
        (b"\x12\x05abc", "runs past the end"),
        (b"\x1d\0\0", "runs past the end"),
        (b"\x0b", "wire type 3"),
        (b"\x00\x01", "field number 0"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_flat(bad)
