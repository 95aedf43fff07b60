"""gRPC plumbing shared by every service: server and channel options, start and graceful stop,
and how a service refuses a bad request (the documented status, a counter, a rate-limited line).

A request that does not even parse must not reach gRPC's own deserialization error path, which
answers with an undocumented status and logs a traceback per request: every service registers
its methods with :func:`lenient` parsers, which turn a malformed message into :data:`MALFORMED`,
and :func:`unary` / :func:`unary_stream` refuse that with INVALID_ARGUMENT like any other
:class:`ProtocolViolation`.
"""

from __future__ import annotations

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
    """Transport limits; the same values configure servers and the channels that call them."""

    max_message_bytes: int = 16 * 1024 * 1024
    max_concurrent_rpcs: int = 512
    max_streams_per_peer: int = 4
    keepalive_time_seconds: float = 10.0
    keepalive_timeout_seconds: float = 5.0
    grace_seconds: float = 2.0

    def __post_init__(self) -> None:
        if self.max_message_bytes < 64 * 1024:
            raise ValueError("max_message_bytes must be at least 64 KiB")
        if self.max_concurrent_rpcs < 1 or self.max_streams_per_peer < 1:
            raise ValueError("max_concurrent_rpcs and max_streams_per_peer must be positive")
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


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    limits: ServerLimits | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server with ``register`` adding its servicers; returns it and its port.

    ``port=0`` binds a free port chosen by the OS (read back, never guessed).
    """
    global _started
    _started = True
    limits = limits or ServerLimits()
    server = grpc.aio.server(
        options=limits.options(), maximum_concurrent_rpcs=limits.max_concurrent_rpcs
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
