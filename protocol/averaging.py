"""The Averaging service's adapter: validate and decode peers' messages, hand them to the node.

The servicer owns everything that can be checked without knowing the round's state (the signed
header: the sender's key, the receiver, freshness, replays; message kinds, sizes, codec, shapes,
decoding, NaN/Inf) and asks the node's :class:`AggregateHandler` for the rest (is there such a
round, is the sender a member, has it sent this part already). The header's signature is checked
before any chunk is read, and a sender's stream budget is charged only then: nobody can stream,
or park streams, in a member's name. Every rejection ends the stream with the status of its
ResultCode (see ``errors.py``) and is counted in :attr:`AveragingServicer.rejections`; the server
keeps serving the other streams.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import grpc
import torch
from google.protobuf.message import DecodeError, Message

from swarmgrad.compression import CodecError, Meta, NonFiniteError, decode
from swarmgrad.protocol.auth import (
    ANYONE,
    Signer,
    Verifier,
    sign_request,
    sign_statement,
    signature_holds,
    signed_bytes,
    verify_statement,
)
from swarmgrad.protocol.errors import ProtocolViolation, SwarmgradError, quote
from swarmgrad.protocol.framing import Framed, serialize
from swarmgrad.protocol.keys import verify_signature
from swarmgrad.protocol.server import Malformed, Rejections, ServerLimits, lenient
from swarmgrad.protocol.tensors import meta_from_proto, meta_to_proto
from swarmgrad.protocol.v1 import averaging_pb2, averaging_pb2_grpc
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


_SERVICE_NAME = "Averaging"


def aggregate_method(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamMultiCallable:
    """The Aggregate call on ``channel``, sending Framed requests."""
    return channel.stream_stream(
        AGGREGATE,
        request_serializer=serialize,
        response_deserializer=averaging_pb2.AggregateResponse.FromString,
    )


def add_to_server(servicer: AveragingServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` with Framed responses (the generated helper would reserialize)."""
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.Aggregate,
        request_deserializer=lenient(averaging_pb2.AggregateRequest.FromString),
        response_serializer=serialize,
    )
    check = grpc.unary_unary_rpc_method_handler(
        servicer.Check,
        request_deserializer=lenient(averaging_pb2.Signed.FromString),
        response_serializer=averaging_pb2.CheckReply.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Aggregate": handler, "Check": check}),)
    )


class AveragingServicer(averaging_pb2_grpc.AveragingServicer):
    def __init__(
        self,
        handler: AggregateHandler,
        *,
        verifier: Verifier,
        limits: ServerLimits | None = None,
        rejections: Rejections | None = None,
        pace: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        """``pace`` waits until so many result bytes may go up the node's link (its upload cap):
        an owner's results share the uplink with its own chunks."""
        self._handler = handler
        self._verifier = verifier
        self._limits = limits or ServerLimits()
        self._pace = pace
        #: Streams open right now, by (authenticated) sender.
        self.open_streams: Counter[str] = Counter()
        #: Rejected streams, by ("Averaging", ResultCode name).
        self.rejections = rejections if rejections is not None else Rejections()
        #: Payload bytes "received" (members' chunks) and "sent" (averaged chunks).
        self.traffic: Counter[str] = Counter()

    async def Aggregate(
        self,
        request_iterator: Requests,
        context: grpc.aio.ServicerContext[
            averaging_pb2.AggregateRequest, averaging_pb2.AggregateResponse
        ],
    ) -> None:
        session: PartSession | None = None
        sender: str | None = None
        try:
            header = await _read_header(
                request_iterator, self._verifier, self._limits.header_timeout_seconds
            )
            if self.open_streams[header.sender] >= self._limits.max_streams_per_peer:
                raise ProtocolViolation(
                    ResultCode.OVERLOADED,
                    f"{header.sender} already has {self.open_streams[header.sender]} open streams",
                )
            sender = header.sender
            self.open_streams[sender] += 1
            session = await self._handler.open_session(header)
            await _serve_stream(request_iterator, context, session, self.traffic, self._pace)
            session.close(None)
        except ProtocolViolation as error:
            self.rejections.record(_SERVICE_NAME, error.code_name, str(error))
            if session is not None:
                session.close(error)
            await context.abort(error.status, str(error))
        except asyncio.CancelledError:
            # The client went away (or the server is stopping): the owner drops this sender.
            if session is not None:
                session.close(ProtocolViolation(ResultCode.ABORTED, "stream cancelled"))
            raise
        except Exception as error:  # a bug of ours: counted, one rate-limited line
            self.rejections.record(
                _SERVICE_NAME, "INTERNAL", f"stream from {sender} failed: {error!r}"
            )
            if session is not None:
                session.close(ProtocolViolation(ResultCode.ABORTED, f"stream failed: {error!r}"))
            await context.abort(grpc.StatusCode.INTERNAL, f"stream failed: {type(error).__name__}")
        finally:
            if sender is not None:
                self.open_streams[sender] -= 1
                if self.open_streams[sender] <= 0:
                    del self.open_streams[sender]

    async def Check(
        self,
        request: averaging_pb2.Signed | Malformed,
        context: grpc.aio.ServicerContext[averaging_pb2.Signed, averaging_pb2.CheckReply],
    ) -> averaging_pb2.CheckReply:
        """A member's reveal, report, accusation or audit request about a round (open runs)."""
        try:
            if isinstance(request, Malformed) or request.ByteSize() > MAX_CHECK_BYTES:
                raise ProtocolViolation(ResultCode.BAD_PAYLOAD, "a malformed check message")
            signer, statement = unseal(request, CHECK_STATEMENT, averaging_pb2.CheckStatement)
            # A private run's allowlist, as for a stream's header (Verifier.verify): a stranger's
            # message must not wait in a slot for a round, nor reach the node at all.
            admit = self._verifier.admit
            if admit is not None and not admit(signer):
                raise ProtocolViolation(
                    ResultCode.NOT_ALLOWED, f"{signer} is not on this private run's allowlist"
                )
            if statement.sender != signer:
                raise ProtocolViolation(
                    ResultCode.UNAUTHENTICATED,
                    f"a check message signed by {signer} in the name of {quote(statement.sender)}",
                )
            if statement.WhichOneof("body") is None:
                raise ProtocolViolation(ResultCode.BAD_PAYLOAD, "an empty check message")
            chunk = await self._handler.check(statement, request)
        except ProtocolViolation as error:
            self.rejections.record(_SERVICE_NAME, error.code_name, str(error))
            await context.abort(error.status, str(error))
        return averaging_pb2.CheckReply(code=ResultCode.OK, payloads=[chunk] if chunk else [])


async def _serve_stream(
    requests: Requests,
    context: grpc.aio.ServicerContext[
        averaging_pb2.AggregateRequest, averaging_pb2.AggregateResponse
    ],
    session: PartSession,
    traffic: Counter[str],
    pace: Callable[[int], Awaitable[None]] | None,
) -> None:
    """Read chunks and write results concurrently; the first failure of either ends both."""

    async def write_results() -> None:
        async for result in session.results():
            if pace is not None:
                await pace(len(result.payload))
            traffic["sent"] += len(result.payload)
            await context.write(result.wire())
        account = await session.account()
        if account is not None:
            await context.write(averaging_pb2.AggregateResponse(account=account))

    reader = asyncio.create_task(_read_chunks(requests, session, traffic))
    writer = asyncio.create_task(write_results())
    try:
        await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_EXCEPTION)
        for task in (reader, writer):
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        await writer
        await reader
    finally:
        for task in (reader, writer):
            task.cancel()
        await asyncio.gather(reader, writer, return_exceptions=True)


Requests = AsyncIterator[averaging_pb2.AggregateRequest | Malformed]


async def _read_header(
    requests: Requests, verifier: Verifier, timeout_seconds: float
) -> StreamHeader:
    """The stream's first message, a header signed by its sender (the server's admission has
    already bounded the wait; this bound holds for a servicer served without it)."""
    try:
        async with asyncio.timeout(timeout_seconds):
            first = await anext(requests)
    except TimeoutError:
        raise ProtocolViolation(ResultCode.TIMED_OUT, "no header in time") from None
    except StopAsyncIteration:
        raise ProtocolViolation(ResultCode.BAD_PAYLOAD, "empty stream") from None
    if isinstance(first, Malformed) or first.WhichOneof("body") != "header":
        raise ProtocolViolation(ResultCode.BAD_PAYLOAD, "a stream must open with a PartHeader")
    h = first.header
    if not math.isfinite(h.weight) or h.weight < 0:
        raise ProtocolViolation(ResultCode.BAD_PAYLOAD, f"bad weight {h.weight!r}")
    if (
        len(h.sender) > 256
        or len(h.receiver) > 256
        or len(h.key.run_id) > 256
        or len(h.key.group_id) > 64
        or len(h.key.spec_hash) > 64
        or len(h.commitment) > 64
    ):
        raise ProtocolViolation(ResultCode.BAD_PAYLOAD, "oversized header field")
    header = StreamHeader(
        run_id=h.key.run_id,
        spec_hash=h.key.spec_hash,
        round=h.key.round,
        group_id=h.key.group_id,
        sender=h.sender,
        receiver=h.receiver,
        part=h.part,
        weight=h.weight,
        commitment=h.commitment,
        auth=h.auth,
    )
    verifier.verify(AGGREGATE, h.auth, receiver=h.receiver, fields=header.fields(), sender=h.sender)
    return header


async def _read_chunks(
    requests: Requests,
    session: PartSession,
    traffic: Counter[str],
) -> None:
    """Validate, decode and pass on every chunk; close the session with the first violation."""
    try:
        expected = 0
        # One decode buffer per stream, reused chunk after chunk: the session copies what it
        # keeps, and a fresh multi-MiB tensor per chunk costs as much as decoding it.
        scratch = torch.empty(max(session.chunk_numels, default=0), dtype=torch.float32)
        while True:
            try:
                async with asyncio.timeout(session.sender_timeout_seconds):
                    message = await anext(requests)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise ProtocolViolation(
                    ResultCode.TIMED_OUT,
                    f"no chunk {expected} within {session.sender_timeout_seconds:g} s",
                ) from None
            if isinstance(message, Malformed):
                raise ProtocolViolation(ResultCode.BAD_PAYLOAD, "a malformed message")
            if message.WhichOneof("body") != "chunk":
                raise ProtocolViolation(ResultCode.BAD_PAYLOAD, "unexpected second header")
            traffic["received"] += len(message.chunk.payload)
            meta = check_chunk(
                message.chunk,
                index=expected,
                numels=session.chunk_numels,
                codec=session.codec,
                max_bytes=session.max_chunk_bytes,
            )
            numel = session.chunk_numels[expected]
            values = await decode_chunk(message.chunk.payload, meta, scratch[:numel])
            await session.accept(expected, values, message.chunk)
            expected += 1
        if expected != len(session.chunk_numels):
            raise ProtocolViolation(
                ResultCode.BAD_SHAPE,
                f"stream ended after {expected} of {len(session.chunk_numels)} chunks",
            )
    except ProtocolViolation as error:
        session.close(error)
        raise


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
