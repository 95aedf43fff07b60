"""The node's gRPC transport: one server for every service, cached channels, upload pacing.

Every service (Averaging, State, Peer) registers on the node's one ``grpc.aio`` server before it
starts, so they share its port, its limits, its admission (what one caller address may hold)
and its graceful stop. Clients borrow the cached
channel to a peer from :meth:`Transport.channel`, with the same limits; a route hook (hole
punching) may send the connection elsewhere. The cache holds the :data:`MAX_CHANNELS` channels
used last (endpoints come from peers' records: many peers, or one peer announcing endpoint
after endpoint, would otherwise hold a socket each for good); one pushed out closes after the
grace period its calls get. Every upload (a member's chunks, an owner's results,
a donor's state chunks) passes through :meth:`Transport.pace`, a token bucket when the node caps
its uplink (simulated slow links), nothing otherwise.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from swarmgrad.node.transport.throttle import TokenBucket
from swarmgrad.protocol.addresses import endpoint_of
from swarmgrad.protocol.server import (
    Admission,
    Rejections,
    ServerLimits,
    open_channel,
    start_server,
)

Register = Callable[[grpc.aio.Server], None]

#: Channels kept open at once, the most recently used (a group, its donors and relays are far
#: fewer).
MAX_CHANNELS = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, read back once bound
    public_host: str = ""  # the address peers dial, if not host (a container's name)
    limits: ServerLimits = field(default_factory=ServerLimits)
    #: Cap on this node's uploads (a token bucket), for simulated slow links.
    upload_bytes_per_second: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.upload_bytes_per_second is not None and not self.upload_bytes_per_second > 0:
            raise ValueError("upload_bytes_per_second must be positive")


class Transport:
    """``transport.register(...)`` for each service, then ``async with transport``."""

    def __init__(
        self,
        config: TransportConfig,
        *,
        route: Callable[[str], str] | None = None,
        rejections: Rejections | None = None,
    ) -> None:
        """``route`` maps a peer's endpoint to the one to dial (a punched link's local end);
        ``rejections`` counts the calls the server's admission refuses (the node's, shared by
        its services)."""
        self.config = config
        self.limits = config.limits
        #: What one caller address may hold of the server (``protocol/server.py``).
        self.admission = Admission(config.limits, rejections)
        self._route = route
        self._services: list[Register] = []
        self._server: grpc.aio.Server | None = None
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()
        self._bucket = (
            TokenBucket(config.upload_bytes_per_second)
            if config.upload_bytes_per_second is not None
            else None
        )
        self.port = 0
        self.endpoint = ""

    def register(self, service: Register) -> None:
        """Add a service (``add_XServicer_to_server``) to the server, before it starts."""
        if self._server is not None:
            raise RuntimeError("services register before the transport starts")
        self._services.append(service)

    async def __aenter__(self) -> Transport:
        self._server, self.port = await start_server(
            self._register_all,
            host=self.config.host,
            port=self.config.port,
            limits=self.limits,
            admission=self.admission,
        )
        self.endpoint = endpoint_of(self.config.public_host or self.config.host, self.port)
        return self

    def _register_all(self, server: grpc.aio.Server) -> None:
        for register in self._services:
            register(server)

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop serving (streams get the grace period to finish), then close every channel."""
        if self._server is not None:
            await self._server.stop(self.limits.grace_seconds)
            self._server = None
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        await asyncio.gather(*self._closing)

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        """The cached channel to ``endpoint`` (routed), with the node's transport limits."""
        if self._route is not None:
            endpoint = self._route(endpoint)
        channel = self._channels.get(endpoint)
        if channel is not None:
            self._channels.move_to_end(endpoint)
            return channel
        channel = self._channels[endpoint] = open_channel(endpoint, self.limits)
        while len(self._channels) > MAX_CHANNELS:
            _, oldest = self._channels.popitem(last=False)
            closing = asyncio.get_running_loop().create_task(
                oldest.close(self.limits.grace_seconds), name="close-channel"
            )
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        return channel

    async def pace(self, num_bytes: int) -> None:
        """Wait until ``num_bytes`` more may go up the node's link (at once if it is uncapped)."""
        if self._bucket is not None:
            await self._bucket.take(num_bytes)

    @property
    def paced(self) -> bool:
        return self._bucket is not None
