"""Fast serialization of messages that carry one large bytes field, and parsing without copies.

protobuf's ``SerializeToString`` copies a bytes field at ~0.5 GB/s, and building a message from a
``Chunk`` deep-copies it: for 4 MiB chunks that was most of an all-reduce's CPU time. A
:class:`Framed` keeps the payload beside a small message (its chunk's payload left empty) and
:func:`serialize` writes the *same protobuf encoding* protobuf would: the small message, then the
chunk field with the payload appended by hand (protobuf allows fields in any order and merges a
repeated sub-message field). Receivers parse with the generated ``FromString``, which does not copy.

A flat message (scalars and one big bytes field, e.g. ``StateChunk``) is written with
:func:`bytes_message` and read back with :func:`parse_flat`, which returns the bytes fields as
views into the received buffer instead of the copies ``FromString`` and field access make.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import Message

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5  # protobuf wire types
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


def _key(field: int, wire_type: int = _LEN) -> bytes:
    return _varint(field << 3 | wire_type)


def bytes_message(varints: dict[int, int], field: int, payload: bytes | memoryview) -> bytes:
    """Protobuf bytes of a flat message: the non-negative integer ``varints`` (field number ->
    value) and ``payload`` as bytes field ``field``, copied once."""
    parts = [_key(number, _VARINT) + _varint(value) for number, value in varints.items()]
    return b"".join((*parts, _key(field), _varint(len(payload)), payload))


def parse_flat(raw: bytes) -> tuple[dict[int, int], dict[int, memoryview]]:
    """A flat message's varint fields and length-delimited fields (views into ``raw``, no copy).

    The last occurrence of a field wins, as in protobuf; fixed-width fields are skipped. Raises
    ValueError on anything that is not a well-formed message of such fields.
    """
    view = memoryview(raw)
    varints: dict[int, int] = {}
    blobs: dict[int, memoryview] = {}
    position = 0
    while position < len(view):
        key, position = _read_varint(view, position)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise ValueError("field number 0")
        if wire_type == _VARINT:
            varints[field], position = _read_varint(view, position)
        elif wire_type == _LEN:
            size, position = _read_varint(view, position)
            if position + size > len(view):
                raise ValueError(f"field {field} runs past the end of the message")
            blobs[field] = view[position : position + size]
            position += size
        elif wire_type in (_FIXED64, _FIXED32):
            position += 8 if wire_type == _FIXED64 else 4
            if position > len(view):
                raise ValueError(f"field {field} runs past the end of the message")
        else:
            raise ValueError(f"field {field} has wire type {wire_type}")
    return varints, blobs


def _read_varint(view: memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    for offset in range(10):  # a 64-bit varint has at most 10 bytes
        if position + offset >= len(view):
            raise ValueError("a varint runs past the end of the message")
        byte = view[position + offset]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position + offset + 1
        shift += 7
    raise ValueError("a varint longer than 10 bytes")


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
