"""The Averaging service's wire side: stream headers and chunks, what members and owners sign
of them, and the calls (``Aggregate``, ``Check``) a client makes.

What a peer sends is checked here before it touches memory: a header's signature, freshness
and receiver (:func:`header_signed`), a chunk's kind, size, codec and shape (:func:`check_chunk`),
its decoding with NaN/Inf refused (:func:`decode_chunk`). The server that applies those checks
to streams is ``averaging_service.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import grpc
import torch
from google.protobuf.message import DecodeError, Message

from swarmgrad.compression import CodecError, Meta, NonFiniteError, decode
from swarmgrad.protocol.auth import (
    ANYONE,
    Signer,
    sign_request,
    sign_statement,
    signature_holds,
    signed_bytes,
    verify_statement,
)
from swarmgrad.protocol.errors import ProtocolViolation, SwarmgradError, quote
from swarmgrad.protocol.framing import Framed, serialize
from swarmgrad.protocol.keys import verify_signature
from swarmgrad.protocol.tensors import meta_from_proto, meta_to_proto
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.protocol.v1.auth_pb2 import Auth
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamHeader:
    run_id: str
    spec_hash: bytes
    round: int
    group_id: bytes
    sender: str
    receiver: str
    part: int
    weight: float
    #: Open runs: SHA-256 of the secret the sender reveals after the round (empty otherwise).
    commitment: bytes = b""
    #: The header's signature, once verified (not itself a signed field).
    auth: Auth | None = field(default=None, compare=False)

    @property
    def public_key(self) -> bytes:
        return b"" if self.auth is None else bytes(self.auth.public_key)

    def fields(self) -> list[str | bytes | int | float]:
        """What the header's signature covers besides its auth, typed as the wire carries it
        (a weight of 3 is the double 3.0 on the other side)."""
        return [
            self.run_id,
            self.spec_hash,
            int(self.round),
            self.group_id,
            self.sender,
            int(self.part),
            float(self.weight),
            self.commitment,
        ]


@dataclass(slots=True, kw_only=True)
class ChunkResult:
    """An averaged chunk as the owner sends it: the same bytes go to every member."""

    index: int
    payload: bytes | memoryview
    meta: Meta
    contributors: tuple[int, ...]
    _wire: bytes | None = None

    def wire(self) -> bytes:
        """The serialized AggregateResponse, built once and written to every member's stream."""
        if self._wire is None:
            frame = framed_chunk(
                averaging_pb2.AggregateResponse, self.index, self.payload, self.meta
            )
            frame.message.contributors.extend(self.contributors)  # type: ignore[attr-defined]
            self._wire = serialize(frame)
        return self._wire


class PartSession(Protocol):
    """One sender's stream into one part owned by this node (implemented in ``node/``)."""

    @property
    def codec(self) -> tuple[str, int]:
        """(name, version) every chunk must be encoded with."""
        ...

    @property
    def chunk_numels(self) -> Sequence[int]: ...

    @property
    def max_chunk_bytes(self) -> int: ...

    @property
    def sender_timeout_seconds(self) -> float:
        """How long the sender may take to send its next chunk."""
        ...

    async def accept(self, index: int, values: torch.Tensor, chunk: averaging_pb2.Chunk) -> None:
        """Take chunk ``index``, decoded into ``values`` from ``chunk``. ``values`` is reused for
        the next chunk: copy what you keep."""
        ...

    def results(self) -> AsyncIterator[ChunkResult]: ...

    async def account(self) -> averaging_pb2.Signed | None:
        """What the owner signs about its part once every result is out (open runs), sent as
        the stream's last message; None: nothing."""
        ...

    def close(self, error: SwarmgradError | None) -> None: ...


class AggregateHandler(Protocol):
    async def open_session(self, header: StreamHeader) -> PartSession:
        """Find the round and part; raise ProtocolViolation if the stream is not acceptable."""
        ...

    async def check(
        self, statement: averaging_pb2.CheckStatement, signed: averaging_pb2.Signed
    ) -> averaging_pb2.Chunk | None:
        """Take a member's check message (its signature is verified), and answer an audit's
        request with the chunk asked for; raise ProtocolViolation if there is no such round
        here or the sender is not in it."""
        ...


def header_to_proto(header: StreamHeader, signer: Signer) -> averaging_pb2.AggregateRequest:
    """The first message of a stream: ``header``, signed by its sender."""
    if signer.peer_id != header.sender:
        raise ValueError("a stream header is signed by its own sender")
    key = averaging_pb2.RoundKey(
        run_id=header.run_id,
        spec_hash=header.spec_hash,
        round=header.round,
        group_id=header.group_id,
    )
    return averaging_pb2.AggregateRequest(
        header=averaging_pb2.PartHeader(
            key=key,
            sender=header.sender,
            receiver=header.receiver,
            part=header.part,
            weight=header.weight,
            auth=sign_request(signer, AGGREGATE, header.receiver, header.fields()),
            commitment=header.commitment,
        )
    )


def framed_chunk(
    kind: type[Message],
    index: int,
    payload: bytes | memoryview,
    meta: Meta,
    *,
    signature: bytes = b"",
) -> Framed:
    """An AggregateRequest or AggregateResponse carrying a chunk, cheap to serialize."""
    message = kind()
    chunk = message.chunk  # type: ignore[attr-defined]
    chunk.index = index
    if signature:
        chunk.signature = signature
    chunk.meta.CopyFrom(meta_to_proto(meta))
    return Framed(message, payload)


SERVICE = "swarmgrad.v1.Averaging"
AGGREGATE = f"/{SERVICE}/Aggregate"
CHECK = f"/{SERVICE}/Check"
#: The kinds of signed statements (what their signatures name).
ACCOUNT_STATEMENT = "swarmgrad.v1.PartAccount"
CHECK_STATEMENT = "swarmgrad.v1.CheckStatement"
#: Largest Check message a server reads (reveals carry every owner's account).
MAX_CHECK_BYTES = 8 << 20


def seal(signer: Signer, kind: str, message: Message) -> averaging_pb2.Signed:
    """``message`` as a statement of ``kind`` signed by ``signer``."""
    body = message.SerializeToString(deterministic=True)
    return averaging_pb2.Signed(body=body, auth=sign_statement(signer, kind, body))


M = TypeVar("M", bound=Message)


def unseal(signed: averaging_pb2.Signed, kind: str, message_type: type[M]) -> tuple[str, M]:
    """(signer's peer id, the parsed body) of a statement of ``kind``; ProtocolViolation if the
    signature does not hold (UNAUTHENTICATED) or the body does not parse (BAD_PAYLOAD)."""
    peer = verify_statement(signed.auth, kind, signed.body)
    message = message_type()
    try:
        message.ParseFromString(signed.body)
    except DecodeError:
        raise ProtocolViolation(ResultCode.BAD_PAYLOAD, f"{peer}'s {kind} does not parse") from None
    return peer, message


def check_method(channel: grpc.aio.Channel) -> grpc.aio.UnaryUnaryMultiCallable:
    """The Check call on ``channel``."""
    return channel.unary_unary(
        CHECK,
        request_serializer=averaging_pb2.Signed.SerializeToString,
        response_deserializer=averaging_pb2.CheckReply.FromString,
    )


def aggregate_method(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamMultiCallable:
    """The Aggregate call on ``channel``, sending Framed requests."""
    return channel.stream_stream(
        AGGREGATE,
        request_serializer=serialize,
        response_deserializer=averaging_pb2.AggregateResponse.FromString,
    )


def check_chunk(
    chunk: averaging_pb2.Chunk,
    *,
    index: int,
    numels: Sequence[int],
    codec: tuple[str, int],
    max_bytes: int,
) -> Meta:
    """Check a chunk against what the round expects at position ``index`` of a part made of
    chunks of ``numels`` values; its Meta, or ProtocolViolation. Both directions use it: owners
    on members' chunks, members on owners' averages."""
    # Peer-sent strings in a detail are quoted (cut short): the detail goes back in the status,
    # whose size gRPC bounds (a 100 KB codec name came back as RESOURCE_EXHAUSTED, not BAD_CODEC).
    if chunk.index < index:
        raise ProtocolViolation(ResultCode.DUPLICATE_PART, f"chunk {chunk.index} sent twice")
    if chunk.index != index or index >= len(numels):
        raise ProtocolViolation(
            ResultCode.BAD_SHAPE, f"chunk {chunk.index} where chunk {index} was due"
        )
    if len(chunk.payload) > max_bytes:
        raise ProtocolViolation(
            ResultCode.TOO_LARGE,
            f"chunk of {len(chunk.payload)} bytes; the round allows {max_bytes}",
        )
    if (chunk.meta.codec, chunk.meta.version) != codec:
        raise ProtocolViolation(
            ResultCode.BAD_CODEC,
            f"codec {quote(chunk.meta.codec)} version {chunk.meta.version}; "
            f"the round uses {codec[0]}/{codec[1]}",
        )
    numel = numels[index]
    if list(chunk.meta.shape) != [numel] or chunk.meta.dtype != "float32":
        raise ProtocolViolation(
            ResultCode.BAD_SHAPE,
            f"chunk {index} is {quote(list(chunk.meta.shape))} {quote(chunk.meta.dtype)}; "
            f"expected [{numel}] float32",
        )
    try:
        return meta_from_proto(chunk.meta)
    except CodecError as error:
        raise ProtocolViolation(ResultCode.BAD_PAYLOAD, str(error)) from None


async def decode_chunk(payload: bytes, meta: Meta, out: torch.Tensor) -> torch.Tensor:
    """Decode into ``out`` in a worker thread; a bad payload is a ProtocolViolation."""
    try:
        return await asyncio.to_thread(decode, payload, meta, max_numel=out.numel(), out=out)
    except NonFiniteError as error:
        raise ProtocolViolation(ResultCode.NON_FINITE, str(error)) from None
    except CodecError as error:
        raise ProtocolViolation(ResultCode.BAD_PAYLOAD, str(error)) from None


CHUNK_STATEMENT = "swarmgrad.v1.Chunk"


def chunk_fields(
    key: averaging_pb2.RoundKey, sender: str, part: int, index: int, payload: bytes | memoryview
) -> list[str | bytes | int | float]:
    """What a member's chunk signature covers (open runs)."""
    digest = hashlib.sha256(payload).digest()
    return [
        key.run_id,
        key.spec_hash,
        int(key.round),
        key.group_id,
        sender,
        int(part),
        int(index),
        digest,
    ]


def sign_chunk(
    signer: Signer, key: averaging_pb2.RoundKey, part: int, index: int, payload: bytes | memoryview
) -> bytes:
    return signer.sign(
        signed_bytes(
            CHUNK_STATEMENT, ANYONE, chunk_fields(key, signer.peer_id, part, index, payload)
        )
    )


def header_signed(header: StreamHeader, auth: Auth) -> bool:
    """Whether ``auth`` is ``header.sender``'s signature of ``header`` (forwarded: an open
    run's account shows each member's commitment with it)."""
    return signature_holds(auth, AGGREGATE, header.receiver, header.fields(), signer=header.sender)


def chunk_signed_by(
    public_key: bytes,
    key: averaging_pb2.RoundKey,
    sender: str,
    part: int,
    chunk: averaging_pb2.Chunk,
) -> bool:
    """Whether ``chunk`` carries ``sender``'s (holder of ``public_key``) signature."""
    fields = chunk_fields(key, sender, part, chunk.index, chunk.payload)
    return verify_signature(
        public_key, chunk.signature, signed_bytes(CHUNK_STATEMENT, ANYONE, fields)
    )
