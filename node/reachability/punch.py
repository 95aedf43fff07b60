"""Hole punching: a direct TCP link between two peers that are both behind NATs.

Linux-style NATs keep a connection's local port as its public port and admit packets from an
address + port the inside host has contacted (a port-restricted cone). So if A connects from port
``pa`` to ``B:pb`` while B connects from ``pb`` to ``A:pa``, each NAT sees its own host's packet
go out first and lets the other's in: a TCP simultaneous open, and the two hold one connection.
A learns B's public address and punching port by calling ``Peer.Punch`` through B's relay; B
starts connecting before it answers. Failed attempts are retried until a deadline (a first SYN
that meets a NAT with no mapping yet is dropped, not refused: routers here drop unsolicited
inbound packets, and must, or the mapping moves).

The callee keeps the links it punched open while they carry traffic, but at most
``max_links_per_peer`` per requesting key and ``max_links`` in all (each holds three file
descriptors: the punched socket, the splice to the gRPC server, and the server's end): beyond
them the oldest link goes, of that key, or of the key holding the most (one key once held 184).
An honest dialer holds one or two (its channel, a liveness call), and redials a closed one.

The dialing side runs a :class:`PunchRoute` per peer: a listener on 127.0.0.1 that gRPC channels
dial instead of the peer's relayed endpoint. Each connection accepted there is punched through
afresh and spliced to the punched socket; if punching fails (a symmetric NAT, a firewall), it is
spliced to the relayed endpoint instead, so a channel always works. Both outcomes are counted.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from swarmgrad.node.metrics import parse_address
from swarmgrad.node.reachability.streams import close_quietly, splice
from swarmgrad.node.tasks import TaskSet

log = logging.getLogger(__name__)

PUNCH_DEADLINE_SECONDS = 4.0  # the kernel resends a SYN after 1 s and 3 s
_RETRY_SECONDS = 0.2
#: Punched links a callee keeps open for one requesting key, and in all (as many as a dialer
#: keeps routes: ``routes.py``'s MAX_ROUTES).
MAX_LINKS_PER_PEER = 4
MAX_LINKS = 64
Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def punching_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host:port`` that other sockets may bind too (for retries)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setblocking(False)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def simultaneous_open(
    first: socket.socket, remote: tuple[str, int], *, deadline_seconds: float
) -> Streams:
    """Connect from ``first``'s local address to ``remote`` until it works or the deadline
    passes; TimeoutError if it never did.

    One attempt lets the kernel retransmit its SYN (a first SYN dropped by the far NAT is resent
    a second later, by which time the far side's own SYN has opened the way). Only a refused
    attempt (a reset) is retried, from a new socket on the same port."""
    loop = asyncio.get_running_loop()
    host, port = first.getsockname()[:2]
    deadline = loop.time() + deadline_seconds
    sock: socket.socket | None = first
    while True:
        if sock is None:
            sock = punching_socket(host, port)
        try:
            async with asyncio.timeout(max(0.0, deadline - loop.time())):
                await loop.sock_connect(sock, remote)
            return await asyncio.open_connection(sock=sock)
        except (TimeoutError, OSError):
            sock.close()
            sock = None
            if loop.time() >= deadline - _RETRY_SECONDS:
                raise TimeoutError(f"could not punch through to {remote[0]}:{remote[1]}") from None
            await asyncio.sleep(_RETRY_SECONDS)
        except BaseException:  # cancelled mid-connect: the socket is ours to close
            sock.close()
            raise


@dataclass(eq=False, slots=True)
class _Link:
    """A punched link the callee holds: whose, and its two ends (closing them ends the splice)."""

    requester: str
    ends: tuple[asyncio.StreamWriter, asyncio.StreamWriter]

    def close(self) -> None:
        for writer in self.ends:
            close_quietly(writer)


class PunchResponder:
    """The callee's side: answers Punch requests and splices punched links to its gRPC server
    (``target``, set once the server is bound). At most ``max_punching`` punches are under way
    at once; the count is taken in the same step as the check, so a burst of calls cannot slip
    past it. Established links are bounded per requesting key and in all (module docstring)."""

    def __init__(
        self,
        *,
        host: str,
        target: tuple[str, int] | None,
        public_host: Callable[[], str],
        max_punching: int = 4,
        max_links_per_peer: int = MAX_LINKS_PER_PEER,
        max_links: int = MAX_LINKS,
    ) -> None:
        if min(max_punching, max_links_per_peer, max_links) < 1:
            raise ValueError("punching limits must be positive")
        self._host, self.target, self._public_host = host, target, public_host
        self._max = max_punching
        self._max_links_per_peer, self._max_links = max_links_per_peer, max_links
        self._punching = 0
        self._links: dict[_Link, None] = {}  # established, oldest first
        self._tasks = TaskSet()
        #: "punched" and "failed" links, punches "refused" as too many, links "closed" to make
        #: room for newer ones, and the bytes carried.
        self.counts: Counter[str] = Counter()
        self.traffic: Counter[str] = Counter()

    def can_punch(self) -> bool:
        return bool(self._public_host()) and self.target is not None

    def links(self, requester: str | None = None) -> int:
        """Punched links open now (``requester``'s only, if given)."""
        return sum(1 for link in self._links if requester in (None, link.requester))

    def try_start(self, remote: tuple[str, int], requester: str) -> tuple[str, int] | None:
        """Start connecting to ``remote`` for the peer ``requester`` (authenticated): this
        side's public address and port, or None if ``max_punching`` punches are under way."""
        if self._punching >= self._max:
            self.counts["refused"] += 1
            return None
        first = punching_socket(self._host)
        self._punching += 1
        self._tasks.spawn(self._link(first, remote, requester))
        return self._public_host(), first.getsockname()[1]

    async def _link(self, first: socket.socket, remote: tuple[str, int], requester: str) -> None:
        try:
            assert self.target is not None  # can_punch said so before this started
            punched = await simultaneous_open(
                first, remote, deadline_seconds=PUNCH_DEADLINE_SECONDS
            )
            local = await asyncio.open_connection(*self.target)
        except (TimeoutError, OSError) as error:
            self.counts["failed"] += 1
            log.info("no punched link from %s:%d: %s", *remote, error)
            return
        finally:
            self._punching -= 1
        self.counts["punched"] += 1
        link = _Link(requester, (punched[1], local[1]))
        self._hold(link)
        try:
            await splice(punched, local, self.traffic)
        finally:
            self._links.pop(link, None)

    def _hold(self, link: _Link) -> None:
        """Keep ``link``, closing the oldest of its key's beyond ``max_links_per_peer``, then
        the oldest of the key holding the most beyond ``max_links``."""
        self._links[link] = None
        own = [held for held in self._links if held.requester == link.requester]
        if len(own) > self._max_links_per_peer:
            self._close(own[0])
        if len(self._links) > self._max_links:
            held = Counter(other.requester for other in self._links)
            most = max(held.values())
            self._close(next(other for other in self._links if held[other.requester] == most))

    def _close(self, link: _Link) -> None:
        del self._links[link]
        link.close()
        self.counts["closed"] += 1

    async def close(self) -> None:
        await self._tasks.close()


#: Asks the callee (through its relay) to punch with us: (our host, our port) -> (its host, port).
PunchCall = Callable[[str, int], Awaitable[tuple[str, int]]]


class PunchRoute:
    """A local endpoint standing for one NAT'd peer: punched links, or its relay as a fallback."""

    def __init__(
        self, *, host: str, relayed: str, public_host: Callable[[], str], call: PunchCall
    ) -> None:
        self._host, self._relayed = host, relayed
        self._public_host, self._call = public_host, call
        self._server: asyncio.Server | None = None
        self._tasks = TaskSet()
        #: Links by how they went: "punched" or "relayed" (punching failed).
        self.counts: Counter[str] = Counter()
        self.traffic: Counter[str] = Counter()
        self.endpoint = ""

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        self.endpoint = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.endpoint

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A task of our own: cancelling asyncio's handler task on close logs an error (3.11).
        self._tasks.spawn(self._serve(reader, writer))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        other = await self._punch()
        if other is None:
            try:
                async with asyncio.timeout(PUNCH_DEADLINE_SECONDS):
                    other = await asyncio.open_connection(*parse_address(self._relayed))
            except (TimeoutError, OSError, ValueError) as error:
                log.info("relayed endpoint %s unreachable too: %s", self._relayed, error)
                writer.close()
                return
            self.counts["relayed"] += 1
        else:
            self.counts["punched"] += 1
        await splice((reader, writer), other, self.traffic)

    async def _punch(self) -> Streams | None:
        if not self._public_host():
            return None
        first = punching_socket(self._host)
        try:
            host, port = await self._call(self._public_host(), first.getsockname()[1])
            return await simultaneous_open(
                first, (host, port), deadline_seconds=PUNCH_DEADLINE_SECONDS
            )
        except Exception as error:  # any failure to punch falls back to the relay
            first.close()
            log.info("punching through to %s failed (%s); relaying", self._relayed, error)
            return None

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._tasks.close()
        self._server = None
