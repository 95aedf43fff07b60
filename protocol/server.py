"""gRPC plumbing shared by every service: server and channel options, start and graceful stop,
and how a service refuses a bad request (the documented status, a counter, a rate-limited line).

A request that does not even parse must not reach gRPC's own deserialization error path, which
answers with an undocumented status and logs a traceback per request: every service registers
its methods with :func:`lenient` parsers, which turn a malformed message into :data:`MALFORMED`,
and :func:`unary` / :func:`unary_stream` refuse that with INVALID_ARGUMENT like any other
:class:`ProtocolViolation`.

Before any service sees a call, the server's :class:`Admission` (an interceptor) bounds what
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
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, TypeAlias, TypeVar

import grpc
from google.protobuf.message import Message

from swarmgrad.protocol.errors import BindError, ProtocolViolation
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

log = logging.getLogger(__name__)
Request = TypeVar("Request", bound=Message)
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

# gRPC's core threads, once started, make a later fork() of this process unsafe (a forked child
# can inherit their locks held); see ``grpc_started``.
_started = False


def grpc_started() -> bool:
    """Whether this process has made a gRPC server or channel through this module."""
    return _started


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerLimits:
    """Transport limits; the same values configure servers and the channels that call them.

    The per-address numbers must fit an honest swarm whose peers share one address (a local
    simulation of 4-16 nodes on 127.0.0.1, peers reaching this node through its relay or a
    punched link, which arrive from a local address too). An owner in a 16-node group gets one
    Aggregate stream per member (15; up to ``max_streams_per_peer`` each with overlapping
    rounds), then a few Check calls per member (open runs), and up to four state downloads per
    joining peer: about 60 calls at the busiest moment. ``max_rpcs_per_address`` (192, of the
    server's 512) leaves three times that, and twice that beside a flooder on the same address
    holding every waiting slot. Members open their streams at the same moment and each waits for
    its header well under a millisecond, unless the loop stalls (a fuzz test's 24 workers and 2
    members had 33 waiting at once): ``max_unauthenticated_per_address`` (64) is four times a
    16-node group's burst.
    """

    max_message_bytes: int = 16 * 1024 * 1024
    max_concurrent_rpcs: int = 512
    max_streams_per_peer: int = 4
    #: Calls in flight from one caller address (host, any port), every service and phase.
    max_rpcs_per_address: int = 192
    #: Calls from one address still waiting for their first message (a stream's signed header,
    #: a unary call's request): the oldest is pushed out beyond it.
    max_unauthenticated_per_address: int = 64
    #: HTTP/2 streams one connection may have open at once (more are refused: UNAVAILABLE).
    max_streams_per_connection: int = 192
    #: How long a new stream may take to send its header (honest clients send it at once).
    header_timeout_seconds: float = 2.0
    #: How long a unary call's request may take to arrive (a large one on a slow link).
    request_timeout_seconds: float = 30.0
    keepalive_time_seconds: float = 10.0
    keepalive_timeout_seconds: float = 5.0
    grace_seconds: float = 2.0

    def __post_init__(self) -> None:
        if self.max_message_bytes < 64 * 1024:
            raise ValueError("max_message_bytes must be at least 64 KiB")
        counts = (
            self.max_concurrent_rpcs,
            self.max_streams_per_peer,
            self.max_rpcs_per_address,
            self.max_unauthenticated_per_address,
            self.max_streams_per_connection,
        )
        if min(counts) < 1:
            raise ValueError("every count limit must be positive")
        if self.max_unauthenticated_per_address > self.max_rpcs_per_address:
            raise ValueError("max_unauthenticated_per_address must not exceed max_rpcs_per_address")
        if not self.header_timeout_seconds > 0 or not self.request_timeout_seconds > 0:
            raise ValueError("header_timeout_seconds and request_timeout_seconds must be positive")
        if self.keepalive_timeout_seconds <= 0 or self.keepalive_time_seconds <= 0:
            raise ValueError("keepalive times must be positive")
        if self.grace_seconds < 0:
            raise ValueError("grace_seconds must not be negative")

    def options(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_seconds * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_seconds * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # Accept the peers' keepalive pings at the rate we send ours.
            (
                "grpc.http2.min_ping_interval_without_data_ms",
                int(self.keepalive_time_seconds * 500),
            ),
            # Several tensor streams share one connection; do not let them wait for a BDP probe.
            ("grpc.http2.bdp_probe", 1),
        ]

    def server_options(self) -> list[tuple[str, Any]]:
        """:meth:`options`, and what only a server sets. gRPC binds with SO_REUSEPORT by
        default, so a second node on a port another holds started without a word and the two
        shared its connections: off, a port in use is a bind error."""
        return [
            *self.options(),
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
            ("grpc.so_reuseport", 0),
        ]


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    limits: ServerLimits | None = None,
    admission: Admission | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server with ``register`` adding its servicers; returns it and its port.

    ``port=0`` binds a free port chosen by the OS (read back, never guessed). Every call passes
    ``admission`` (by default one of its own, on ``limits``) before it reaches a service.
    """
    global _started
    _started = True
    limits = limits or ServerLimits()
    server = grpc.aio.server(
        options=limits.server_options(),
        maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
        interceptors=[admission or Admission(limits)],
    )
    register(server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio 1.8x raises where older versions returned 0
        bound = 0
    if bound == 0:
        raise BindError(
            f"cannot listen on {host}:{port}: the port is in use, or {host} is not an address "
            f"of this machine (--host, --port)"
        )
    await server.start()
    return server, bound


def open_channel(
    endpoint: str, limits: ServerLimits | None = None, *, own_connection: bool = False
) -> grpc.aio.Channel:
    """A channel to ``endpoint``. gRPC shares connections between channels to one address (its
    global subchannel pool); ``own_connection`` gives this channel a connection of its own."""
    global _started
    _started = True
    options = (limits or ServerLimits()).options()
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))
    return grpc.aio.insecure_channel(endpoint, options=options)


class Malformed:
    """The type of :data:`MALFORMED`."""

    def __repr__(self) -> str:
        return "MALFORMED"


#: What a :func:`lenient` parser returns for bytes that are not the message it expects.
MALFORMED: Final = Malformed()


def lenient(parse: Callable[[bytes], Request]) -> Callable[[bytes], Request | Malformed]:
    """``parse`` that returns :data:`MALFORMED` instead of raising."""

    def deserialize(data: bytes) -> Request | Malformed:
        try:
            return parse(data)
        except Exception:  # any decode failure of a peer's bytes is the same: malformed
            return MALFORMED

    return deserialize


class Rejections:
    """Requests this node refused, by (service, result code name), each kind logged at most
    once per ``log_interval_seconds`` as one line (a flood of bad requests must not flood the
    log): the counts are what metrics export."""

    def __init__(self, log_interval_seconds: float = 10.0) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self._interval = log_interval_seconds
        self._logged_at: dict[tuple[str, str], float] = {}
        self._since: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()  # the metrics thread reads the counts (snapshot)

    def record(self, service: str, code: str, detail: str) -> None:
        kind = (service, code)
        with self._lock:
            self.counts[kind] += 1
        self._since[kind] += 1
        now = time.monotonic()
        if now - self._logged_at.get(kind, -self._interval) >= self._interval:
            more = self._since[kind] - 1
            log.info(
                "%s refused a request: %s%s",
                service,
                detail[:200],
                f" ({more} more {code} since the last such line)" if more else "",
            )
            self._logged_at[kind] = now
            self._since[kind] = 0

    def by_code(self, service: str | None = None) -> Counter[str]:
        """Refusals by code name, of one service or all."""
        counts: Counter[str] = Counter()
        for (svc, code), n in self.counts.items():
            if service is None or svc == service:
                counts[code] += n
        return counts

    def total(self) -> int:
        return sum(self.counts.values())

    def snapshot(self) -> dict[tuple[str, str], int]:
        """The counts, safe to call from another thread (a metrics scrape)."""
        with self._lock:
            return dict(self.counts)


async def refuse(
    context: Context, rejections: Rejections, service: str, error: ProtocolViolation
) -> None:
    """Count ``error``, log it (rate-limited) and end the call with its status; raises."""
    rejections.record(service, error.code_name, str(error))
    await context.abort(error.status, str(error))


async def _unexpected(
    context: Context, rejections: Rejections, service: str, error: Exception
) -> None:
    rejections.record(service, "INTERNAL", f"{type(error).__name__}: {error}")
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(error).__name__})")


def _checked(request: object) -> None:
    if request is MALFORMED:
        raise ProtocolViolation(ResultCode.BAD_PAYLOAD, "the request is not a valid message")


def unary(
    handler: Callable[[Any, Context], Awaitable[Message]],
    *,
    parse: Callable[[bytes], Message],
    rejections: Rejections,
    service: str,
) -> grpc.RpcMethodHandler:
    """A unary method handler: a malformed request or a ProtocolViolation raised by ``handler``
    ends the call with its documented status, counted in ``rejections``."""

    async def run(request: Any, context: Context) -> Message:
        try:
            _checked(request)
            return await handler(request, context)
        except ProtocolViolation as error:
            await refuse(context, rejections, service, error)
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # a bug of ours: one line, not a traceback per request
            await _unexpected(context, rejections, service, error)
        raise AssertionError("unreachable: abort raises")

    return grpc.unary_unary_rpc_method_handler(
        run, request_deserializer=lenient(parse), response_serializer=_serialize
    )


def unary_stream(
    handler: Callable[[Any, Context], AsyncIterator[bytes]],
    *,
    parse: Callable[[bytes], Message],
    rejections: Rejections,
    service: str,
) -> grpc.RpcMethodHandler:
    """A unary-stream method handler whose ``handler`` yields serialized responses; refusals as
    in :func:`unary`."""

    async def run(request: Any, context: Context) -> AsyncIterator[bytes]:
        try:
            _checked(request)
            async for response in handler(request, context):
                yield response
        except ProtocolViolation as error:
            await refuse(context, rejections, service, error)
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # a bug of ours: one line, not a traceback per request
            await _unexpected(context, rejections, service, error)

    return grpc.unary_stream_rpc_method_handler(run, request_deserializer=lenient(parse))


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


# -- admission: what one caller address may hold ----------------------------------------------


def host_of(peer: str) -> str:
    """The address in a gRPC ``context.peer()`` string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return ""


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
