"""What kind of NAT a machine is behind, told by the ports its peers see its calls come from.

Calls made from one local port to two or more peers (:func:`from_one_port`), each peer saying
the address and port the call came from (``DialBackReply.observed_port``):

* every peer sees this machine's own address and port: no NAT on the way;
* every peer sees the local port: the NAT keeps ports, one mapping for every destination (Linux
  masquerade does): two such peers punch a direct link (``punch.py``);
* every peer sees one other port: a cone NAT (one mapping for every destination): punching can
  work when its filter lets in the peer the machine dialed first;
* the peers see different ports: a symmetric NAT (a new mapping per destination): a punched
  link's port cannot be known in advance, so NAT'd peers reach it through a relay.

One peer cannot tell a cone from a symmetric NAT once the port moved; a relayed call (port 0)
says nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from swarmgrad.node.reachability.punch import punching_socket
from swarmgrad.node.reachability.streams import close_quietly, splice

__all__ = ["NatKind", "Seen", "classify", "from_one_port"]

T = TypeVar("T")

Kind = Literal["none", "keeps-ports", "cone", "symmetric", "unknown"]


@dataclass(frozen=True, slots=True)
class Seen:
    """One call: where it left from (this side of any NAT) and where the peer saw it come from."""

    local: tuple[str, int]
    observed: tuple[str, int]


@dataclass(frozen=True, slots=True)
class NatKind:
    kind: Kind
    said: str


def classify(seen: Sequence[Seen]) -> NatKind:
    """The NAT's kind from calls made from one local port (those a relay carried left out)."""
    seen = [s for s in seen if s.observed[1]]
    if not seen:
        return NatKind("unknown", "no peer saw the port this machine's calls came from")
    if all(s.observed == s.local for s in seen):
        return NatKind("none", "no NAT: peers see this machine's own address and port")
    local_port = seen[0].local[1]
    ports = {s.observed[1] for s in seen}
    if len(ports) > 1:
        return NatKind(
            "symmetric",
            f"a symmetric NAT: {len(seen)} peers saw {len(ports)} different ports for calls "
            f"from one port, so NAT'd peers cannot punch through to it and use a relay",
        )
    (port,) = ports
    if len(seen) < 2:
        if port == local_port:
            return NatKind("keeps-ports", "a NAT that kept the port for the one peer asked")
        return NatKind(
            "unknown", f"a NAT that moved port {local_port} to {port}; one peer asked cannot "
            f"tell a cone from a symmetric NAT",
        )  # fmt: skip
    if port == local_port:
        return NatKind(
            "keeps-ports",
            f"a NAT that keeps ports ({len(seen)} peers saw port {port}): NAT'd peers punch a "
            f"direct link to it",
        )
    return NatKind(
        "cone",
        f"a cone NAT ({len(seen)} peers saw port {local_port} as {port}): NAT'd peers can "
        f"punch a direct link to it",
    )


async def from_one_port(
    remotes: Sequence[tuple[str, int]],
    call: Callable[[int, str], Awaitable[T]],
    *,
    host: str = "0.0.0.0",
    connect_seconds: float = 5.0,
) -> list[tuple[tuple[str, int] | None, T | None]]:
    """``call(i, endpoint)`` for each ``remotes[i]``, the connection to every remote leaving
    from one local port.

    gRPC chooses its own source ports, so each call dials a listener on 127.0.0.1 that is
    spliced to a socket bound to the shared port and connected to the remote. Per remote: where
    the connection left from (None if it could not connect) and what ``call`` returned (None
    where it raised an OSError or timed out: the caller's own errors are its to catch)."""
    first = punching_socket(host, 0)
    port = first.getsockname()[1]
    try:
        return list(
            await asyncio.gather(
                *(
                    _one(remote, host, port, functools.partial(call, i), connect_seconds)
                    for i, remote in enumerate(remotes)
                )
            )
        )
    finally:
        first.close()


async def _one(
    remote: tuple[str, int],
    host: str,
    port: int,
    call: Callable[[str], Awaitable[T]],
    connect_seconds: float,
) -> tuple[tuple[str, int] | None, T | None]:
    loop = asyncio.get_running_loop()
    sock = punching_socket(host, port)
    try:
        async with asyncio.timeout(connect_seconds):
            await loop.sock_connect(sock, remote)
    except (TimeoutError, OSError):
        sock.close()
        return None, None
    local = sock.getsockname()[:2]
    outside = await asyncio.open_connection(sock=sock)
    taken = False
    splices: list[asyncio.Task[None]] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal taken
        if taken:  # the one connection out is spoken for: a second dial fails, as it should
            close_quietly(writer)
            return
        taken = True
        task = asyncio.current_task()
        assert task is not None
        splices.append(task)
        await splice((reader, writer), outside, Counter())

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    listening = server.sockets[0].getsockname()[1]
    try:
        result = await call(f"127.0.0.1:{listening}")
    except (TimeoutError, OSError):
        result = None
    finally:
        server.close()
        close_quietly(outside[1])
        for task in splices:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await asyncio.gather(*splices, return_exceptions=True)
    return (local[0], local[1]), result
