"""An in-memory transport: the node's services called in one process, without sockets (tests).

:class:`MemoryTransport` is a :class:`~swarmgrad.node.transport.transport.Transport` whose
server is a table of the services registered on it and whose channels call into the table of
the transport listening at the endpoint they dial, through a :class:`MemoryNetwork` the
transports share. Everything above the socket is the real thing: each request is serialized by
the client's serializer and parsed by the service's own (lenient) parser, each response the
other way; a service answers with the same ``context.abort`` statuses, which the caller sees as
``grpc.aio.AioRpcError``; deadlines give DEADLINE_EXCEEDED; a caller that cancels its call
cancels the service's handler, as a closed stream does. What it leaves out is the network:
HTTP/2 framing, message-size limits, flow control and the server's admission per address (a
stream's responses are buffered a couple deep, which is the backpressure a round needs).

Unary-unary and stream-stream methods are served (what the averaging round uses).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from swarmgrad.node.transport.transport import Transport, TransportConfig

__all__ = ["MemoryNetwork", "MemoryTransport"]

#: Responses a stream buffers before its service's writes wait for the caller to read.
_STREAM_BUFFER = 2


class MemoryNetwork:
    """The transports of one process that can call each other, by endpoint."""

    def __init__(self) -> None:
        self._servers: dict[str, _Server] = {}
        self._ports = itertools.count(1)

    def listen(self, server: _Server) -> str:
        endpoint = f"memory-{next(self._ports)}:1"
        self._servers[endpoint] = server
        return endpoint

    def close(self, endpoint: str) -> None:
        self._servers.pop(endpoint, None)

    def lookup(self, endpoint: str, method: str) -> grpc.RpcMethodHandler:
        server = self._servers.get(endpoint)
        if server is None:
            raise _error(grpc.StatusCode.UNAVAILABLE, f"nothing listens at {endpoint}")
        handler = server.find(method)
        if handler is None:
            raise _error(grpc.StatusCode.UNIMPLEMENTED, f"{method} is not served at {endpoint}")
        return handler


class MemoryTransport(Transport):
    """A :class:`Transport` on a :class:`MemoryNetwork` (register services, then ``async
    with``); ``upload_bytes_per_second`` in its config still paces uploads."""

    def __init__(self, network: MemoryNetwork, config: TransportConfig | None = None) -> None:
        super().__init__(config or TransportConfig())
        self._network = network

    async def __aenter__(self) -> MemoryTransport:
        server = _Server()
        for register in self._services:
            register(server)  # it has what services call: add_generic_rpc_handlers
        self.endpoint = self._network.listen(server)
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        return self

    async def close(self) -> None:
        self._network.close(self.endpoint)

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        return _Channel(self._network, endpoint, caller=self.endpoint)


class _Server:
    """What services register on: their generic handlers."""

    def __init__(self) -> None:
        self._handlers: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: tuple[grpc.GenericRpcHandler, ...]) -> None:
        self._handlers.extend(handlers)

    def find(self, method: str) -> grpc.RpcMethodHandler | None:
        details = _CallDetails(method)
        for handler in self._handlers:
            found = handler.service(details)
            if found is not None:
                return found
        return None


@dataclass(frozen=True, slots=True)
class _CallDetails:
    method: str
    invocation_metadata: tuple[tuple[str, str], ...] = ()


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """The service's side of one call."""

    def __init__(
        self,
        caller: str,
        write: Callable[[Any], Any] | None = None,
        metadata_sent: asyncio.Event | None = None,
    ) -> None:
        self._caller, self._write, self._metadata_sent = caller, write, metadata_sent

    def peer(self) -> str:
        return f"memory:{self._caller}"

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise _Aborted(code, details)

    async def send_initial_metadata(self, metadata: Any) -> None:
        """The caller's :meth:`_StreamCall.initial_metadata` returns (no metadata is kept)."""
        if self._metadata_sent is not None:
            self._metadata_sent.set()

    async def write(self, message: Any) -> None:
        assert self._write is not None  # only streams write
        if self._metadata_sent is not None:
            self._metadata_sent.set()  # the first message carries it, as in gRPC
        await self._write(message)


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _Channel:
    """A channel to one endpoint of a :class:`MemoryNetwork`."""

    def __init__(self, network: MemoryNetwork, endpoint: str, *, caller: str) -> None:
        self._network, self._endpoint, self._caller = network, endpoint, caller

    def unary_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes],
        response_deserializer: Callable[[bytes], Any],
    ) -> Callable[..., Any]:
        async def call(request: Any, *, timeout: float | None = None, **_: Any) -> Any:  # noqa: ASYNC109 - gRPC's signature
            handler = self._network.lookup(self._endpoint, method)
            parsed = handler.request_deserializer(request_serializer(request))
            try:
                async with asyncio.timeout(timeout):
                    reply = await handler.unary_unary(parsed, _Context(self._caller))
            except TimeoutError:
                raise _error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded") from None
            except _Aborted as aborted:
                raise _error(aborted.code, aborted.details) from None
            except Exception as error:  # what gRPC answers for a handler's own failure
                raise _error(grpc.StatusCode.UNKNOWN, repr(error)) from None
            return response_deserializer(handler.response_serializer(reply))

        return call

    def stream_stream(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes],
        response_deserializer: Callable[[bytes], Any],
    ) -> Callable[..., _StreamCall]:
        def call(requests: AsyncIterator[Any], *, timeout: float | None = None, **_: Any) -> Any:
            return _StreamCall(
                self._network.lookup(self._endpoint, method),
                requests,
                request_serializer,
                response_deserializer,
                timeout=timeout,
                caller=self._caller,
            )

        return call

    async def close(self, grace: float | None = None) -> None:
        """Nothing to close: calls end with their handlers."""


class _StreamCall:
    """A stream-stream call in flight: the service's handler runs as a task, fed by the
    caller's requests, its writes read with :meth:`read`."""

    def __init__(
        self,
        handler: grpc.RpcMethodHandler,
        requests: AsyncIterator[Any],
        serialize: Callable[[Any], bytes],
        deserialize: Callable[[bytes], Any],
        *,
        timeout: float | None,
        caller: str,
    ) -> None:
        self._responses: asyncio.Queue[Any] = asyncio.Queue(maxsize=_STREAM_BUFFER)
        self._ended: BaseException | None = None
        self._done = asyncio.Event()
        self._metadata_sent = asyncio.Event()
        parse = handler.request_deserializer

        async def inbound() -> AsyncIterator[Any]:
            async for request in requests:
                yield parse(serialize(request))

        async def write(message: Any) -> None:
            await self._responses.put(deserialize(handler.response_serializer(message)))

        async def serve() -> None:
            try:
                async with asyncio.timeout(timeout):
                    await handler.stream_stream(
                        inbound(), _Context(caller, write, self._metadata_sent)
                    )
            except TimeoutError:
                self._ended = _error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
            except _Aborted as aborted:
                self._ended = _error(aborted.code, aborted.details)
            except asyncio.CancelledError:
                self._ended = _error(grpc.StatusCode.CANCELLED, "cancelled")
                raise
            except Exception as error:  # what gRPC answers for a handler's own failure
                self._ended = _error(grpc.StatusCode.UNKNOWN, repr(error))
            finally:
                self._done.set()
                self._metadata_sent.set()  # nothing more to wait for

        self._task = asyncio.get_running_loop().create_task(serve(), name="memory-stream")

    async def read(self) -> Any:
        """The next response, ``grpc.aio.EOF`` once the handler returned, or the call's error."""
        if self._responses.empty() and not self._done.is_set():
            got = asyncio.ensure_future(self._responses.get())
            ended = asyncio.ensure_future(self._done.wait())
            try:
                await asyncio.wait({got, ended}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                ended.cancel()
                if not got.done():
                    got.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await got
            if got.done() and not got.cancelled():
                return got.result()
        if not self._responses.empty():
            return self._responses.get_nowait()
        if self._ended is not None:
            raise self._ended
        return grpc.aio.EOF

    async def initial_metadata(self) -> grpc.aio.Metadata:
        """Once the service sent its initial metadata, or the call ended (none is kept)."""
        await self._metadata_sent.wait()
        return grpc.aio.Metadata()

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> bool:
        return self._task.cancel()
