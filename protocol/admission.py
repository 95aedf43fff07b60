"""Before any service sees a call, the server's :class:`Admission` (an interceptor) bounds what
one caller address can hold (the node's concurrent-call slots are shared by every peer, and one
client with a few connections once held all of them with silent streams):

- calls in flight from one address, every phase (``max_rpcs_per_address``; beyond: OVERLOADED);
- streams open at once on one HTTP/2 connection (``max_streams_per_connection``, no more than
  the address may have in flight): gRPC's core refuses one beyond it before any Python runs
  (REFUSED_STREAM; the caller gets UNAVAILABLE, its client does not queue the stream);
- a call's first message must arrive in time: a stream's signed header within
  ``header_timeout_seconds``, a unary call's request within ``request_timeout_seconds`` (gRPC
  itself would wait for a request for as long as the caller's own deadline, or forever);
- calls still waiting for their first message (nothing signed seen yet), per address
  (``max_unauthenticated_per_address``): a new one pushes out the oldest (OVERLOADED). Honest
  clients send their header or request at once, so it is a silent call that waits long enough
  to be pushed out, even where a flooder shares the address with honest peers (a loopback
  swarm, a NAT); refusing the newest instead would hand such a flooder the address.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final, TypeAlias

import grpc

from swarmgrad.protocol.addresses import host_of
from swarmgrad.protocol.errors import ProtocolViolation
from swarmgrad.protocol.handlers import Context, Rejections, refuse
from swarmgrad.protocol.limits import ServerLimits
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

log = logging.getLogger(__name__)


class _Ended:
    """What :meth:`Admission._first` returns for a call that ended before its first message."""


_ENDED: Final = _Ended()
#: Why a call stopped waiting for its first message without it.
_LATE: Final = "late"
_PUSHED_OUT: Final = "pushed out"
Handler: TypeAlias = Callable[..., Any]


class Admission(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no types
    """The server's gate, before any service (see the module docstring). Refusals are counted
    in ``rejections`` under the service that was called."""

    def __init__(self, limits: ServerLimits, rejections: Rejections | None = None) -> None:
        self._limits = limits
        self.rejections = rejections if rejections is not None else Rejections()
        #: Calls in flight, by caller address.
        self.in_flight: Counter[str] = Counter()
        # Calls waiting for their first message, by address, oldest first; each one's future
        # settles when it stops waiting (its message, the deadline, or pushed out).
        self._waiting: dict[str, dict[asyncio.Future[Any], None]] = {}
        # Each method's handler and its wrapped one (made once, not per call).
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def waiting(self, address: str) -> int:
        """Calls from ``address`` waiting for their first message now."""
        return len(self._waiting.get(address, ()))

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        method = str(details.method)
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, method.rsplit("/", 2)[-2].rsplit(".", 1)[-1])
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler: grpc.RpcMethodHandler, service: str) -> grpc.RpcMethodHandler:
        """``handler`` as a request-streaming handler (its first message read here, with a
        deadline: gRPC reads a unary request before any handler runs, with none), run inside
        the caller's admission."""
        streaming = bool(handler.request_streaming)
        if handler.response_streaming:
            inner: Handler = handler.stream_stream if streaming else handler.unary_stream
        else:
            inner = handler.stream_unary if streaming else handler.unary_unary
        if not (inspect.iscoroutinefunction(inner) or inspect.isasyncgenfunction(inner)):
            return handler  # a sync handler (none here) runs in gRPC's thread pool, unbounded

        async def first(requests: AsyncIterator[Any], context: Context, address: str) -> Any:
            message = await self._first(requests, context, address, service, streaming)
            if streaming:
                return _prepend(message, requests)
            if message is _ENDED:
                violation = ProtocolViolation(ResultCode.BAD_PAYLOAD, "the call sent no request")
                await refuse(context, self.rejections, service, violation)
            return message

        if inspect.isasyncgenfunction(inner):

            async def generate(
                requests: AsyncIterator[Any], context: Context
            ) -> AsyncIterator[Any]:
                address = await self._enter(context, service)
                try:
                    async for response in inner(await first(requests, context, address), context):
                        yield response
                finally:
                    self._leave(address)

            return grpc.stream_stream_rpc_method_handler(
                generate,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

        async def call(requests: AsyncIterator[Any], context: Context) -> Any:
            address = await self._enter(context, service)
            try:
                return await inner(await first(requests, context, address), context)
            finally:
                self._leave(address)

        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.stream_unary_rpc_method_handler
        )
        return make(
            call,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    async def _enter(self, context: Context, service: str) -> str:
        """The caller's address, counted in flight; OVERLOADED (raises) beyond its cap."""
        peer = context.peer()
        address = host_of(peer) or peer
        if self.in_flight[address] >= self._limits.max_rpcs_per_address:
            violation = ProtocolViolation(
                ResultCode.OVERLOADED,
                f"{self.in_flight[address]} calls from {address} are in flight here already",
            )
            await refuse(context, self.rejections, service, violation)
        self.in_flight[address] += 1
        return address

    def _leave(self, address: str) -> None:
        self.in_flight[address] -= 1
        if self.in_flight[address] <= 0:
            del self.in_flight[address]

    async def _first(
        self,
        requests: AsyncIterator[Any],
        context: Context,
        address: str,
        service: str,
        streaming: bool,
    ) -> Any:
        """The call's first message (:data:`_ENDED` if none came), or a refusal (raises): too
        late (TIMED_OUT), or pushed out by newer calls from its address (OVERLOADED)."""
        limits = self._limits
        timeout = limits.header_timeout_seconds if streaming else limits.request_timeout_seconds
        loop = asyncio.get_running_loop()
        # The wait can end three ways, whichever settles ``outcome`` first: the message (read
        # by a task of its own), the deadline, or a newer call from the address.
        outcome: asyncio.Future[Any] = loop.create_future()
        waiting = self._waiting.setdefault(address, {})
        waiting[outcome] = None
        if len(waiting) > limits.max_unauthenticated_per_address:
            oldest = next(iter(waiting))
            del waiting[oldest]
            _settle(oldest, _PUSHED_OUT)
        reader = asyncio.ensure_future(anext(requests))
        reader.add_done_callback(functools.partial(_read, outcome))
        timer = loop.call_later(timeout, _settle, outcome, _LATE)
        try:
            result = await outcome
        finally:
            timer.cancel()
            reader.cancel()
            waiting = self._waiting.get(address, {})
            waiting.pop(outcome, None)
            if not waiting:
                self._waiting.pop(address, None)
        if result is _PUSHED_OUT:
            violation = ProtocolViolation(
                ResultCode.OVERLOADED,
                f"{limits.max_unauthenticated_per_address} newer calls from {address} are "
                "waiting for their first message",
            )
        elif result is _LATE:
            what = "header" if streaming else "request"
            violation = ProtocolViolation(ResultCode.TIMED_OUT, f"no {what} within {timeout:g} s")
        else:
            return result
        await refuse(context, self.rejections, service, violation)


def _settle(outcome: asyncio.Future[Any], result: Any) -> None:
    if not outcome.done():
        outcome.set_result(result)


def _read(outcome: asyncio.Future[Any], reader: asyncio.Future[Any]) -> None:
    """Hand a first message's read to ``outcome`` (its outcome is always retrieved: asyncio
    logs an exception nobody retrieved)."""
    if reader.cancelled():
        return
    error = reader.exception()
    if outcome.done():
        return
    if isinstance(error, StopAsyncIteration):
        outcome.set_result(_ENDED)
    elif error is not None:
        outcome.set_exception(error)
    else:
        outcome.set_result(reader.result())


async def _prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if first is _ENDED:
        return
    yield first
    async for message in rest:
        yield message
