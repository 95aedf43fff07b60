"""How a service refuses a bad request (the documented status, a counter, a rate-limited line).

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
from typing import Any, Final, TypeAlias, TypeVar

import grpc
from google.protobuf.message import Message

from swarmgrad.protocol.errors import ProtocolViolation
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

log = logging.getLogger(__name__)
Request = TypeVar("Request", bound=Message)
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


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
