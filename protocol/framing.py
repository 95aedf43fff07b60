"""Fast serialization of messages that carry one large ``Chunk.payload``.

protobuf's ``SerializeToString`` copies a bytes field at ~0.5 GB/s, and building a message from a
``Chunk`` deep-copies it: for 4 MiB chunks that was most of an all-reduce's CPU time. A
:class:`Framed` keeps the payload beside a small message (its chunk's payload left empty) and
:func:`serialize` writes the *same protobuf encoding* protobuf would: the small message, then the
chunk field with the payload appended by hand (protobuf allows fields in any order and merges a
repeated sub-message field). Receivers parse with the generated ``FromString``, which does not copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import Message

_LEN = 2  # protobuf wire type of length-delimited fields
_PAYLOAD_FIELD = 3  # Chunk.payload


@dataclass(frozen=True, slots=True)
class Framed:
    """``message`` (an AggregateRequest or AggregateResponse whose ``chunk.payload`` is empty)
    with the payload that belongs in that field."""

    message: Message
    payload: bytes | memoryview  # a memoryview must be of unsigned bytes (format "B")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int) -> bytes:
    return _varint(field << 3 | _LEN)


def serialize(item: Framed | Message | bytes) -> bytes:
    """Protobuf bytes of ``item``; for a Framed, with its payload in ``chunk.payload``; bytes
    (a message serialized earlier, e.g. once for many streams) pass through."""
    if isinstance(item, bytes):
        return item
    if not isinstance(item, Framed):
        return item.SerializeToString()
    message, payload = item.message, item.payload
    chunk = getattr(message, "chunk")  # noqa: B009 - both message types have it
    if chunk.payload:
        raise ValueError("a Framed message must leave chunk.payload empty")
    head = chunk.SerializeToString()
    payload_key = _key(_PAYLOAD_FIELD) + _varint(len(payload))
    rest = type(message)()
    rest.CopyFrom(message)
    rest.ClearField("chunk")
    chunk_field = message.DESCRIPTOR.fields_by_name["chunk"].number
    chunk_len = len(head) + len(payload_key) + len(payload)
    return b"".join(
        (
            rest.SerializeToString(),
            _key(chunk_field),
            _varint(chunk_len),
            head,
            payload_key,
            payload,
        )
    )
