"""Relays: a reachable peer carries TCP connections for one that nobody can dial (behind a NAT).

The unreachable node (the *client*) keeps one outbound *control* connection open to a relay
peer. The relay listens on a port of its own for that client (its *relayed endpoint*, which the
client announces as its gRPC endpoint). When someone connects there, the relay sends ``open``
with a fresh random id over the control connection; the client opens a *data* connection to the
relay carrying that id (possession of the id is the proof) and one to its own gRPC server, and
both ends copy bytes until either side closes. gRPC runs over that unchanged: HTTP/2 end to end.

Frames on the relay port are a 4-byte big-endian length and a JSON object (at most 4 KiB):

    relay  -> any:    {"relay": "swarmgrad/1", "nonce": hex}
    client -> relay:  {"hello": peer_id, "key": hex, "sig": hex(Ed25519(nonce + peer_id))}
                      or {"data": id}
    relay  -> client: {"ready": port} | {"error": why} | {"open": id, "from": host} | {"ping": 0}
    client -> relay:  {"ping": 0}

``from`` is the address the dialer connected from, as the relay saw it: the client's gRPC server
sees every relayed connection come from the client itself, and ``Peer.Punch`` must know who really
called (it punches only towards its caller). :attr:`RelayClient.origins` maps the local end of each
spliced connection to that address while the connection lasts.

Both sides ping every ``ping_seconds`` and give up on silence after ``silence_seconds``, so a
client learns within seconds that its relay died. Load is bounded (clients per relay, pending and
open connections per client and per dialer address) and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from swarmgrad.node.identity import Identity, peer_id_of, verify
from swarmgrad.node.metrics import parse_address
from swarmgrad.node.reachability.streams import close_quietly, splice
from swarmgrad.node.tasks import TaskSet
from swarmgrad.protocol.errors import PeerUnavailable
from swarmgrad.protocol.peer import endpoint_of

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 4096
PROTOCOL = "swarmgrad/1"


class RelayError(PeerUnavailable):
    """A relay refused this client, broke the protocol, or went silent."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayLimits:
    max_clients: int = 8
    max_connections_per_client: int = 32  # pending + open
    #: Of those, from any one dialer address: one host cannot hold every slot of a client.
    max_connections_per_dialer: int = 8
    handshake_timeout_seconds: float = 5.0
    #: How long a dialer waits for the client to attach its side before it is hung up on.
    attach_timeout_seconds: float = 10.0
    ping_seconds: float = 2.0
    silence_seconds: float = 6.0

    def __post_init__(self) -> None:
        if (
            self.max_clients < 0
            or self.max_connections_per_client < 1
            or self.max_connections_per_dialer < 1
        ):
            raise ValueError("relay limits must be positive")
        if not 0 < self.ping_seconds < self.silence_seconds:
            raise ValueError("ping_seconds must be positive and below silence_seconds")


async def write_frame(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    writer.write(struct.pack(">I", len(body)) + body)
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader, timeout_seconds: float) -> dict[str, Any]:
    """One frame, within the deadline; RelayError for anything malformed or oversized."""
    try:
        async with asyncio.timeout(timeout_seconds):
            (size,) = struct.unpack(">I", await reader.readexactly(4))
            if size > MAX_FRAME_BYTES:
                raise RelayError(f"a frame of {size} bytes (the limit is {MAX_FRAME_BYTES})")
            body = await reader.readexactly(size)
    except TimeoutError:
        raise RelayError(f"nothing heard in {timeout_seconds:g} s") from None
    except (asyncio.IncompleteReadError, ConnectionError) as error:
        raise RelayError(f"connection closed: {error}") from None
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise RelayError("a frame that is not JSON") from None
    except RecursionError:  # 4 KiB of "[[[[..." is deeper than the parser's stack allows
        raise RelayError("a frame nested too deeply") from None
    if not isinstance(message, dict) or len(message) > 4:
        raise RelayError("a frame that is not a small JSON object")
    return message


# -- the relay ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Client:
    peer_id: str
    writer: asyncio.StreamWriter
    server: asyncio.Server | None = None
    port: int = 0
    pending: dict[str, asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = field(
        default_factory=dict
    )
    connections: int = 0
    #: Connections pending or open, by the dialer's address.
    dialers: Counter[str] = field(default_factory=Counter)


class RelayServer:
    """Serves relay clients on ``host:port``; each client gets a port of its own on ``host``."""

    def __init__(self, *, host: str, port: int = 0, limits: RelayLimits | None = None) -> None:
        self._host, self._port = host, port
        self.limits = limits or RelayLimits()
        self._server: asyncio.Server | None = None
        self._clients: dict[str, _Client] = {}
        self._pending: dict[str, _Client] = {}  # connection id -> its client
        self._tasks = TaskSet()
        #: Bytes relayed: "in" (dialers to clients) and "out".
        self.traffic: Counter[str] = Counter()
        #: Clients and connections accepted, and refused by reason.
        self.counts: Counter[str] = Counter()
        self.port = 0

    @property
    def clients(self) -> int:
        return len(self._clients)

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, self._host, self._port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for client in list(self._clients.values()):
            await self._drop(client)
        await self._tasks.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def _spawn(self, coro: Any) -> None:
        self._tasks.spawn(coro)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonce = secrets.token_bytes(16)
        try:
            await write_frame(writer, {"relay": PROTOCOL, "nonce": nonce.hex()})
            first = await read_frame(reader, self.limits.handshake_timeout_seconds)
            if "data" in first:
                return self._attach(str(first["data"]), reader, writer)
            peer_id = self._authenticate(first, nonce)
            if peer_id in self._clients:  # a client reconnecting: its old session is stale
                await self._drop(self._clients[peer_id])
            if len(self._clients) >= self.limits.max_clients:
                self.counts["refused: full"] += 1
                await write_frame(writer, {"error": "this relay is full"})
                close_quietly(writer)
                return
            client = _Client(peer_id, writer)
            client.server = await asyncio.start_server(
                lambda r, w: self._dialed(client, r, w), self._host, 0
            )
            client.port = client.server.sockets[0].getsockname()[1]
            self._clients[peer_id] = client
            self.counts["clients"] += 1
            await write_frame(writer, {"ready": client.port})
            log.info("relaying for %s on port %d", peer_id, client.port)
        except (RelayError, ConnectionError) as error:
            self.counts["refused: protocol"] += 1
            log.debug("relay handshake failed: %s", error)
            close_quietly(writer)
            return
        await self._serve_client(client, reader)

    def _authenticate(self, hello: dict[str, Any], nonce: bytes) -> str:
        peer_id, key, sig = hello.get("hello"), hello.get("key"), hello.get("sig")
        if not (isinstance(peer_id, str) and isinstance(key, str) and isinstance(sig, str)):
            raise RelayError("a hello without peer id, key and signature")
        try:
            public_key, signature = bytes.fromhex(key), bytes.fromhex(sig)
            if peer_id_of(public_key) != peer_id:
                raise RelayError(f"the key of another peer than {peer_id[:64]}")
        except ValueError:
            raise RelayError("a malformed key or signature") from None
        if not verify(public_key, signature, nonce + peer_id.encode()):
            raise RelayError(f"a bad signature from {peer_id}")
        return peer_id

    async def _serve_client(self, client: _Client, reader: asyncio.StreamReader) -> None:
        """Ping the client; hear from it at least every ``silence_seconds``; drop it otherwise."""
        pinger = asyncio.create_task(self._ping(client))
        try:
            while True:
                await read_frame(reader, self.limits.silence_seconds)
        except RelayError as error:
            log.info("relay client %s left: %s", client.peer_id, error)
        finally:
            pinger.cancel()
            await asyncio.gather(pinger, return_exceptions=True)
            if self._clients.get(client.peer_id) is client:
                await self._drop(client)

    async def _ping(self, client: _Client) -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                await write_frame(client.writer, {"ping": 0})
                await asyncio.sleep(self.limits.ping_seconds)

    async def _drop(self, client: _Client) -> None:
        self._clients.pop(client.peer_id, None)
        if client.server is not None:
            client.server.close()
        for connection_id, future in client.pending.items():
            self._pending.pop(connection_id, None)
            future.cancel()
        close_quietly(client.writer)

    async def _dialed(
        self, client: _Client, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Someone connected to ``client``'s relayed port: ask the client to attach, splice."""
        dialer = writer.get_extra_info("peername")
        origin = str(dialer[0]) if isinstance(dialer, tuple) else ""
        if client.connections >= self.limits.max_connections_per_client:
            self.counts["refused: busy"] += 1
            close_quietly(writer)
            return
        if client.dialers[origin] >= self.limits.max_connections_per_dialer:
            self.counts["refused: busy dialer"] += 1
            close_quietly(writer)
            return
        client.connections += 1
        client.dialers[origin] += 1
        connection_id = secrets.token_hex(16)
        attached: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
        attached = asyncio.get_running_loop().create_future()
        client.pending[connection_id] = attached
        self._pending[connection_id] = client
        try:
            await write_frame(client.writer, {"open": connection_id, "from": origin})
            async with asyncio.timeout(self.limits.attach_timeout_seconds):
                other = await attached
            self.counts["connections"] += 1
            await splice((reader, writer), other, self.traffic)
        except (TimeoutError, ConnectionError, asyncio.CancelledError) as error:
            if not isinstance(error, asyncio.CancelledError):
                self.counts["refused: no attach"] += 1
            close_quietly(writer)
            if isinstance(error, asyncio.CancelledError) and client.peer_id in self._clients:
                raise
        finally:
            client.pending.pop(connection_id, None)
            self._pending.pop(connection_id, None)
            client.connections -= 1
            client.dialers[origin] -= 1
            if not client.dialers[origin]:
                del client.dialers[origin]

    def _attach(
        self, connection_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        client = self._pending.pop(connection_id, None)
        future = client.pending.get(connection_id) if client is not None else None
        if future is None or future.done():
            self.counts["refused: unknown connection"] += 1
            close_quietly(writer)
            return
        future.set_result((reader, writer))


# -- the client ---------------------------------------------------------------------------------


class RelayClient:
    """This node's session with one relay: announces ``endpoint``; ``wait_closed`` returns (or
    raises RelayError) when the relay is gone, so the caller can find another."""

    def __init__(
        self,
        relay: str,
        identity: Identity,
        *,
        target: tuple[str, int],
        limits: RelayLimits | None = None,
    ) -> None:
        self.relay = relay
        self._identity = identity
        self._target = target
        self.limits = limits or RelayLimits()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._tasks = TaskSet()
        self._session: asyncio.Task[None] | None = None
        self._address: tuple[str, int] | None = None
        self.traffic: Counter[str] = Counter()
        #: For each relayed connection spliced to the target now: the local end's ``host:port``
        #: (what the target sees as its peer) -> the host the dialer connected to the relay from
        #: ("" if the relay did not say).
        self.origins: dict[str, str] = {}
        self._opening: set[str] = set()  # connection ids attaching or attached
        #: ``open`` requests ignored: over the limit, or a connection id already attaching.
        self.refused_opens = 0
        self.endpoint = ""

    async def connect(self) -> str:
        """Open the control connection and get a relayed port; returns the relayed endpoint."""
        try:  # the address comes from a peer's record: it may be anything
            self._address = parse_address(self.relay)
        except ValueError as error:
            raise RelayError(f"relay {self.relay[:64]!r}: {error}") from None
        timeout = self.limits.handshake_timeout_seconds
        try:
            async with asyncio.timeout(timeout):
                self._reader, self._writer = await asyncio.open_connection(*self._address)
        except (TimeoutError, OSError) as error:
            raise RelayError(f"could not connect to relay {self.relay}: {error}") from None
        try:
            greeting = await read_frame(self._reader, timeout)
            if greeting.get("relay") != PROTOCOL or not isinstance(greeting.get("nonce"), str):
                raise RelayError(f"{self.relay} is not a swarmgrad relay")
            nonce = bytes.fromhex(greeting["nonce"])
            me = self._identity.peer_id
            await write_frame(
                self._writer,
                {
                    "hello": me,
                    "key": self._identity.public_key.hex(),
                    "sig": self._identity.sign(nonce + me.encode()).hex(),
                },
            )
            answer = await read_frame(self._reader, timeout)
        except (RelayError, ValueError, ConnectionError) as error:
            await self.close()
            raise RelayError(f"relay {self.relay}: {error}") from None
        if "error" in answer or not isinstance(answer.get("ready"), int):
            await self.close()
            raise RelayError(f"relay {self.relay} refused: {answer.get('error', answer)}")
        self.endpoint = endpoint_of(self._address[0], answer["ready"])
        self._session = asyncio.create_task(self._run())
        return self.endpoint

    async def wait_closed(self) -> None:
        assert self._session is not None, "connect first"
        await self._session

    async def _run(self) -> None:
        assert self._reader is not None
        assert self._writer is not None
        pinger = asyncio.create_task(self._ping())
        try:
            while True:
                message = await read_frame(self._reader, self.limits.silence_seconds)
                connection_id = message.get("open")
                if not isinstance(connection_id, str):
                    continue
                if (
                    connection_id in self._opening
                    or len(self._opening) >= self.limits.max_connections_per_client
                ):
                    # A relay asking for more than it may carry (its own limit per client), or
                    # twice for one dialer, is not obeyed: each attach costs two sockets.
                    self.refused_opens += 1
                    continue
                origin = message.get("from")
                self._opening.add(connection_id)
                self._tasks.spawn(
                    self._attach(connection_id, origin if isinstance(origin, str) else "")
                )
        finally:
            pinger.cancel()
            await asyncio.gather(pinger, return_exceptions=True)

    async def _ping(self) -> None:
        assert self._writer is not None
        with contextlib.suppress(ConnectionError):
            while True:
                await write_frame(self._writer, {"ping": 0})
                await asyncio.sleep(self.limits.ping_seconds)

    async def _attach(self, connection_id: str, origin: str) -> None:
        try:
            await self._attach_once(connection_id, origin)
        finally:
            self._opening.discard(connection_id)

    async def _attach_once(self, connection_id: str, origin: str) -> None:
        assert self._address is not None  # connected
        timeout = self.limits.handshake_timeout_seconds
        relay: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            async with asyncio.timeout(timeout):
                relay = await asyncio.open_connection(*self._address)
                await read_frame(relay[0], timeout)  # the greeting
                await write_frame(relay[1], {"data": connection_id})
                local = await asyncio.open_connection(*self._target)
        except (TimeoutError, OSError, RelayError) as error:
            log.debug("could not attach relayed connection: %s", error)
            if relay is not None:
                close_quietly(relay[1])
            return
        sockname = local[1].get_extra_info("sockname")
        here = endpoint_of(sockname[0], sockname[1]) if isinstance(sockname, tuple) else ""
        if here:  # "" when the relay did not say: the server refuses what needs the caller
            self.origins[here] = origin[:64]
        try:
            await splice(relay, local, self.traffic)
        finally:
            self.origins.pop(here, None)

    async def close(self) -> None:
        if self._session is not None:
            self._session.cancel()
            await asyncio.gather(self._session, return_exceptions=True)
        await self._tasks.close()
        if self._writer is not None:
            close_quietly(self._writer)
