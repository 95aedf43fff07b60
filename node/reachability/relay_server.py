"""A relay's side (``relay.py`` says what a relay is, its frames and its limits): it listens for
its clients' control connections, opens a port per client, splices dialers to the client's data
connections, and spends each client's budget (:class:`RelayServer`). Whom a node's relay serves is
``relay_admission.py``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from swarmgrad.node.identity import peer_id_of, verify
from swarmgrad.node.reachability.relay import (
    MIB,
    PROTOCOL,
    Admit,
    RelayError,
    RelayLimits,
    frame,
    read_frame,
    write_frame,
)
from swarmgrad.node.reachability.streams import close_quietly, splice
from swarmgrad.node.tasks import TaskSet

log = logging.getLogger(__name__)


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
