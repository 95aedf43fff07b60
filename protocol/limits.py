"""What a node's gRPC server and channels allow: message sizes, concurrent calls and streams,
per-address slots, keepalive, the first message's deadlines (:class:`ServerLimits`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
