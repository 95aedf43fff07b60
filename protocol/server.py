"""gRPC plumbing shared by every service: server and channel options (``limits.py``), start and
graceful stop; how a service refuses a bad request (``handlers.py``); what every call passes
before any service sees it (``admission.py``). The names services use are re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from swarmgrad.protocol.addresses import host_of
from swarmgrad.protocol.admission import Admission
from swarmgrad.protocol.errors import BindError
from swarmgrad.protocol.handlers import (
    MALFORMED,
    Context,
    Malformed,
    Rejections,
    Request,
    lenient,
    refuse,
    unary,
    unary_stream,
)
from swarmgrad.protocol.limits import ServerLimits

__all__ = [
    "MALFORMED",
    "Admission",
    "Context",
    "Malformed",
    "Rejections",
    "Request",
    "ServerLimits",
    "grpc_started",
    "host_of",
    "lenient",
    "open_channel",
    "refuse",
    "start_server",
    "unary",
    "unary_stream",
]

# gRPC's core threads, once started, make a later fork() of this process unsafe (a forked child
# can inherit their locks held); see ``grpc_started``.
_started = False


def grpc_started() -> bool:
    """Whether this process has made a gRPC server or channel through this module."""
    return _started


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
