"""gRPC plumbing shared by every service: server and channel options, start and graceful stop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

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
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind a gRPC server to {host}:{port}")
    await server.start()
    return server, bound


def open_channel(endpoint: str, limits: ServerLimits | None = None) -> grpc.aio.Channel:
    global _started
    _started = True
    return grpc.aio.insecure_channel(endpoint, options=(limits or ServerLimits()).options())
