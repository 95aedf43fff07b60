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
    relay  -> client: {"ready": port} | {"open": id, "from": host} | {"ping": 0}
                      | {"error": why} (refused at hello, or evicted later; then it hangs up)
    client -> relay:  {"ping": 0}

``from`` is the address the dialer connected from, as the relay saw it: the client's gRPC server
sees every relayed connection come from the client itself, and ``Peer.Punch`` must know who really
called (it punches only towards its caller). :attr:`RelayClient.origins` maps the local end of each
spliced connection to that address while the connection lasts.

Both sides ping every ``ping_seconds`` and give up on silence after ``silence_seconds``, so a
client learns within seconds that its relay died. Load is bounded (clients per relay, pending and
open connections per client and per dialer address) and counted.

A relay is not a forwarder for anyone. It serves only the peers its node admits (``admit``, asked
at hello; a node's is a :class:`RelayAdmission`: a live record in its run and, in a private run,
a place on the allowlist). Each client's spliced bytes, both ways together, spend a token bucket (a
sustained rate and a burst, :class:`RelayLimits`): past it the relay stops reading that client's
connections until the budget refills, and TCP pushes back on the sender, so what a client moves
and the relay's CPU for it are bounded. A client that wanted more than its rate for
``max_throttled_seconds`` in a row, or carried nothing (no byte, no new connection) for
``idle_seconds``, is evicted; when every slot is taken, a newcomer first evicts a client over its
rate now or idle for ``idle_under_pressure_seconds``, and is refused only if there is none. A
refused or evicted client is told why (``{"error": why}``) and the relay counts it by reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import struct
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.identity import Identity, peer_id_of, verify
from swarmgrad.node.metrics import parse_address
from swarmgrad.node.reachability.streams import close_quietly, splice
from swarmgrad.node.tasks import TaskSet
from swarmgrad.protocol.errors import PeerUnavailable
from swarmgrad.protocol.peer import endpoint_of

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 4096
PROTOCOL = "swarmgrad/1"
MIB = 1 << 20

#: Whether the relay serves a peer, asked at its hello: None if so, else why not (told to the
#: peer and counted, so a short fixed phrase).
Admit = Callable[[str], Awaitable[str | None]]


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
    #: Each client's byte budget, both ways together: a token bucket refilled at this rate that
    #: holds at most ``burst_bytes``. Only connections *to* a relayed node cross its relay (it
    #: dials out directly): the parts of the vector it owns, and the state it serves. A round
    #: moves ~2 x (members - 1) x its part through it (int8): the demo model (0.67 M values) at
    #: most ~1.4 MB; a 125 M model in a group of 8, ~25 MB as the one relayed member (a relayed
    #: member owns a tenth of a direct one's share), ~220 MB were all 8 relayed; a 1 B model
    #: ~200 MB as the one relayed member. The burst carries each of those without a pause; the
    #: rate (134 Mbit/s, above most home uplinks, which limit first) then carries 1 GB a minute,
    #: and costs the relay ~4% of a core per client flat out (benchmarks/relay_abuse.py). A
    #: state download from a relayed donor is slowed to the rate (downloads use several donors).
    rate_bytes_per_second: float = 16 * MIB
    burst_bytes: int = 256 * MIB
    #: A client that wanted more than its rate this long in a row is evicted: its slot is freed.
    max_throttled_seconds: float = 120.0
    #: A client with no byte spliced and no new connection this long is evicted (honest ones
    #: see a round's connections every few minutes, and take another relay when evicted).
    idle_seconds: float = 900.0
    #: With every slot taken, a newcomer evicts a client idle this long (or over its rate now).
    idle_under_pressure_seconds: float = 30.0

    def __post_init__(self) -> None:
        if (
            self.max_clients < 0
            or self.max_connections_per_client < 1
            or self.max_connections_per_dialer < 1
        ):
            raise ValueError("relay limits must be positive")
        if not 0 < self.ping_seconds < self.silence_seconds:
            raise ValueError("ping_seconds must be positive and below silence_seconds")
        if not (self.rate_bytes_per_second > 0 and self.burst_bytes > 0):
            raise ValueError("a relay client's rate and burst must be positive")
        if not (
            0 < self.idle_under_pressure_seconds <= self.idle_seconds
            and self.max_throttled_seconds > 0
        ):
            raise ValueError(
                "idle_under_pressure_seconds must be positive and at most idle_seconds, and "
                "max_throttled_seconds positive"
            )


def frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">I", len(body)) + body


async def write_frame(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    writer.write(frame(message))
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
class _Budget:
    """A client's token bucket. A take beyond what it holds puts it in debt, and the taker waits
    the debt out: the relay stops reading, and TCP pushes back on the sender."""

    rate: float  # bytes a second
    burst: float
    level: float
    at: float  # loop time of ``level``
    #: When it went into debt and has stayed there (None: it has not, or it no longer asks).
    throttled_since: float | None = None

    def _level(self, now: float) -> float:
        return min(self.burst, self.level + (now - self.at) * self.rate)

    def take(self, size: int, now: float) -> float:
        """Spend ``size`` bytes; the seconds to wait before they go on."""
        self.level, self.at = self._level(now) - size, now
        if self.level >= 0:
            self.throttled_since = None
            return 0.0
        if self.throttled_since is None:
            self.throttled_since = now
        return -self.level / self.rate

    def throttled_for(self, now: float) -> float:
        """How long it has wanted more than its rate, up to now (0: not now)."""
        # Over its rate, its bytes leave as fast as they refill: the level never gets back to a
        # MiB (a few reads' worth). Once it does, the client stopped asking.
        if self.throttled_since is None or self._level(now) >= min(self.burst, MIB):
            return 0.0
        return now - self.throttled_since

    def full(self, now: float) -> bool:
        return self._level(now) >= self.burst


@dataclass(slots=True)
class _Client:
    peer_id: str
    writer: asyncio.StreamWriter
    budget: _Budget
    #: The last spliced byte or new connection (loop time).
    active_at: float
    server: asyncio.Server | None = None
    port: int = 0
    pending: dict[str, asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = field(
        default_factory=dict
    )
    connections: int = 0
    #: Connections pending or open, by the dialer's address.
    dialers: Counter[str] = field(default_factory=Counter)
    #: The tasks serving its connections (cancelled when it is dropped).
    handlers: set[asyncio.Task[Any]] = field(default_factory=set)
    #: The task serving its control connection.
    session: asyncio.Task[Any] | None = None


class RelayServer:
    """Serves relay clients on ``host:port``; each client gets a port of its own on ``host``.
    ``admit`` says, at each hello, whether the relay serves that peer (:data:`Admit`)."""

    def __init__(
        self, *, host: str, admit: Admit, port: int = 0, limits: RelayLimits | None = None
    ) -> None:
        self._host, self._port = host, port
        self._admit = admit
        self.limits = limits or RelayLimits()
        self._server: asyncio.Server | None = None
        self._clients: dict[str, _Client] = {}
        self._pending: dict[str, _Client] = {}  # connection id -> its client
        #: By peer id, kept after a client leaves until it would be full again: reconnecting
        #: does not buy a fresh burst.
        self._budgets: dict[str, _Budget] = {}
        self._tasks = TaskSet()
        #: Bytes relayed: "in" (dialers to clients) and "out".
        self.traffic: Counter[str] = Counter()
        #: Clients and connections accepted; refused and evicted clients, by reason; reads held
        #: back by a client's budget ("throttled").
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
        sessions = {c.session for c in self._clients.values() if c.session is not None}
        for client in list(self._clients.values()):
            self._drop(client)
        if sessions:  # each ends as it reads its closed connection: a cancelled one is logged
            await asyncio.wait(sessions, timeout=self.limits.ping_seconds)
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
            refused = await self._refusal(peer_id)
            if refused is not None:
                self.counts[f"refused: {refused}"] += 1
                log.info("relay refused %s: %s", peer_id, refused)
                await write_frame(writer, {"error": refused})
                close_quietly(writer)
                return
            client = self._register(peer_id, writer)
            try:
                client.server = await asyncio.start_server(
                    lambda r, w: self._dialed(client, r, w), self._host, 0
                )
            except BaseException:
                self._drop(client)
                raise
            client.port = client.server.sockets[0].getsockname()[1]
            self.counts["clients"] += 1
            await write_frame(writer, {"ready": client.port})
            log.info("relaying for %s on port %d", peer_id, client.port)
        except (RelayError, ConnectionError) as error:
            self.counts["refused: protocol"] += 1
            log.debug("relay handshake failed: %s", error)
            close_quietly(writer)
            return
        await self._serve_client(client, reader)

    async def _refusal(self, peer_id: str) -> str | None:
        """Why ``peer_id`` is not served now (None: it is); may evict a client to make room."""
        try:  # half the handshake's deadline: the answer must reach the client within it
            async with asyncio.timeout(self.limits.handshake_timeout_seconds / 2):
                refused = await self._admit(peer_id)
        except TimeoutError:
            refused = "its record could not be read in time"
        if refused is not None:
            return refused
        if peer_id in self._clients:  # a client reconnecting: its old session is stale
            self._drop(self._clients[peer_id])
        if len(self._clients) < self.limits.max_clients:
            return None
        victim = self._victim()
        if victim is None:
            return "this relay is full"
        self._evict(*victim)
        return None

    def _register(self, peer_id: str, writer: asyncio.StreamWriter) -> _Client:
        """Take a slot for ``peer_id`` now, before anything else awaits: two hellos at once
        cannot both take the last one."""
        now = asyncio.get_running_loop().time()
        for other in [p for p, b in self._budgets.items() if b.full(now)]:
            if other not in self._clients:
                del self._budgets[other]
        budget = self._budgets.get(peer_id)
        if budget is None:
            burst = self.limits.burst_bytes
            budget = _Budget(self.limits.rate_bytes_per_second, burst, burst, now)
            self._budgets[peer_id] = budget
        client = _Client(peer_id, writer, budget, active_at=now, session=asyncio.current_task())
        self._clients[peer_id] = client
        return client

    def _victim(self) -> tuple[_Client, str] | None:
        """With every slot taken: the client a newcomer evicts, and why (None: keep them all)."""
        if not self._clients:  # a relay of no slots
            return None
        now = asyncio.get_running_loop().time()
        throttled = max(self._clients.values(), key=lambda c: c.budget.throttled_for(now))
        if throttled.budget.throttled_for(now) > 0:
            return throttled, "over its byte budget, for a newcomer"
        idle = min(self._clients.values(), key=lambda c: c.active_at)
        if now - idle.active_at >= self.limits.idle_under_pressure_seconds:
            return idle, "idle, for a newcomer"
        return None

    def _overstayed(self, client: _Client) -> str | None:
        """Why ``client`` is evicted now, if it is."""
        now = asyncio.get_running_loop().time()
        if client.budget.throttled_for(now) >= self.limits.max_throttled_seconds:
            return f"over its byte budget for {self.limits.max_throttled_seconds:g} s"
        if now - client.active_at >= self.limits.idle_seconds:
            return f"idle for {self.limits.idle_seconds:g} s"
        return None

    def _evict(self, client: _Client, why: str) -> None:
        self.counts[f"evicted: {why}"] += 1
        log.info("relay evicted %s: %s", client.peer_id, why)
        with contextlib.suppress(RuntimeError):  # closing already: it learns from the hang-up
            client.writer.write(frame({"error": f"evicted: {why}"}))  # the close flushes it
        self._drop(client)

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
                self._drop(client)

    async def _ping(self, client: _Client) -> None:
        """Ping ``client`` every ``ping_seconds``, and evict it when it overstays."""
        with contextlib.suppress(ConnectionError):
            while True:
                why = self._overstayed(client)
                if why is not None:
                    self._evict(client, why)
                    return
                await write_frame(client.writer, {"ping": 0})
                await asyncio.sleep(self.limits.ping_seconds)

    def _drop(self, client: _Client) -> None:
        if self._clients.get(client.peer_id) is client:
            del self._clients[client.peer_id]
        if client.server is not None:
            client.server.close()
        for connection_id, future in client.pending.items():
            self._pending.pop(connection_id, None)
            future.cancel()
        me = asyncio.current_task()
        for handler in client.handlers:  # its spliced connections go with it
            if handler is not me:
                handler.cancel()
        close_quietly(client.writer)

    async def _spend(self, client: _Client, size: int) -> None:
        """``size`` bytes of ``client``'s connections go on when its budget allows."""
        now = asyncio.get_running_loop().time()
        client.active_at = now
        wait = client.budget.take(size, now)
        if wait > 0:
            self.counts["throttled"] += 1
            await asyncio.sleep(wait)

    async def _dialed(
        self, client: _Client, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Someone connected to ``client``'s relayed port: ask the client to attach, splice."""
        dialer = writer.get_extra_info("peername")
        origin = str(dialer[0]) if isinstance(dialer, tuple) else ""
        if self._clients.get(client.peer_id) is not client:  # dropped as it was dialed
            close_quietly(writer)
            return
        if client.connections >= self.limits.max_connections_per_client:
            self.counts["refused: busy"] += 1
            close_quietly(writer)
            return
        if client.dialers[origin] >= self.limits.max_connections_per_dialer:
            self.counts["refused: busy dialer"] += 1
            close_quietly(writer)
            return
        me = asyncio.current_task()
        if me is not None:
            client.handlers.add(me)
        client.active_at = asyncio.get_running_loop().time()
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
            await splice((reader, writer), other, self.traffic, lambda n: self._spend(client, n))
        except (TimeoutError, ConnectionError, asyncio.CancelledError) as error:
            if not isinstance(error, asyncio.CancelledError):
                self.counts["refused: no attach"] += 1
            close_quietly(writer)
            # Cancelled as its client was dropped: over. Otherwise (the loop is ending): say so.
            if (
                isinstance(error, asyncio.CancelledError)
                and self._clients.get(client.peer_id) is client
            ):
                raise
        finally:
            if me is not None:
                client.handlers.discard(me)
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
                if "error" in message:  # evicted: say why, not just "connection closed"
                    raise RelayError(f"relay {self.relay}: {str(message['error'])[:200]}")
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


# -- whom a node's relay serves -----------------------------------------------------------------


class RelayAdmission:
    """A node's :data:`Admit`: peers with a live record in its run, and on its allowlist if the run
    is private (``allowed``; None: an open run).

    A NAT'd node announces its record (its LAN address, reachability unknown) when it joins,
    before its dial-back checks find it needs a relay; but ``peers``, the node's table of the
    run, may be older than that. So a peer not in it waits for the table to be read again
    (``reread``), one read every ``reread_seconds`` at most, shared by every hello waiting: a
    stranger's hellos cost the DHT one read every few seconds, not one each. Any record will do,
    whatever reachability it announces."""

    def __init__(
        self,
        *,
        peers: Callable[[], Sequence[PeerRecord]],
        reread: Callable[[], Awaitable[object]],
        allowed: Callable[[str], bool] | None = None,
        reread_seconds: float = 2.0,
    ) -> None:
        self._peers, self._reread, self._allowed = peers, reread, allowed
        self._reread_seconds = reread_seconds
        self._read_started = float("-inf")  # loop time
        self._reading: asyncio.Future[object] | None = None

    async def __call__(self, peer_id: str) -> str | None:
        if self._allowed is not None and not self._allowed(peer_id):
            return "not on this run's allowlist"
        if self._live(peer_id):
            return None
        await self._read_since(asyncio.get_running_loop().time())
        return None if self._live(peer_id) else "no live record in this run"

    def _live(self, peer_id: str) -> bool:
        now = dht_time()
        return any(p.peer_id == peer_id and p.expires_at > now for p in self._peers())

    async def _read_since(self, asked_at: float) -> None:
        """Until a read of the table that began at ``asked_at`` or later has ended."""
        loop = asyncio.get_running_loop()
        while True:
            began_after = self._read_started >= asked_at
            if self._reading is not None:
                # Shielded: one waiter's deadline does not cancel the read others wait on.
                await asyncio.shield(self._reading)
                if began_after:
                    return
            elif began_after:
                return
            else:
                wait = self._read_started + self._reread_seconds - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                else:
                    self._read_started = loop.time()
                    self._reading = asyncio.ensure_future(self._read())

    async def _read(self) -> object:
        try:
            return await self._reread()
        finally:
            self._reading = None
