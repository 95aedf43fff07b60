"""The Averaging service's server: validate and decode peers' streams, hand them to the node.

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
import math
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import torch

from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.averaging import (
    AGGREGATE,
    CHECK_STATEMENT,
    MAX_CHECK_BYTES,
    SERVICE,
    AggregateHandler,
    PartSession,
    StreamHeader,
    check_chunk,
    decode_chunk,
    unseal,
)
from swarmgrad.protocol.errors import ProtocolViolation, quote
from swarmgrad.protocol.framing import serialize
from swarmgrad.protocol.server import Malformed, Rejections, ServerLimits, lenient
from swarmgrad.protocol.v1 import averaging_pb2, averaging_pb2_grpc
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

_SERVICE_NAME = "Averaging"


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

        def release() -> None:
            """The sender's stream stops counting against its budget (once; before a refusal
            is sent, so nobody sees a refused stream still open)."""
            nonlocal sender
            if sender is not None:
                self.open_streams[sender] -= 1
                if self.open_streams[sender] <= 0:
                    del self.open_streams[sender]
                sender = None

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
            release()
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
            culprit = sender
            release()
            self.rejections.record(
                _SERVICE_NAME, "INTERNAL", f"stream from {culprit} failed: {error!r}"
            )
            if session is not None:
                session.close(ProtocolViolation(ResultCode.ABORTED, f"stream failed: {error!r}"))
            await context.abort(grpc.StatusCode.INTERNAL, f"stream failed: {type(error).__name__}")
        finally:
            release()

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
    """Read chunks and write results concurrently; the first failure of either ends both.

    The stream's initial metadata goes out first, on its own: the failure that ends both may
    cancel the writer in the middle of its first write, and gRPC then still counts the initial
    metadata that write carried as unsent. The status sent next would carry it a second time;
    gRPC's core refuses that batch (logged as ExecuteBatchError), no status ever leaves, and the
    peer waits for its call's deadline instead of hearing why its stream was refused.
    """
    await context.send_initial_metadata(())

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
