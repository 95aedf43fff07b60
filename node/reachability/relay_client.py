"""A relayed node's side (``relay.py`` says what a relay is): its control connection to its relay,
and a data connection to the relay and one to its own gRPC server for each dialer, spliced."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter

from swarmgrad.node.identity import Identity
from swarmgrad.node.metrics import parse_address
from swarmgrad.node.reachability.relay import (
    PROTOCOL,
    RelayError,
    RelayLimits,
    read_frame,
    write_frame,
)
from swarmgrad.node.reachability.streams import close_quietly, splice
from swarmgrad.node.tasks import TaskSet
from swarmgrad.protocol.addresses import endpoint_of

log = logging.getLogger(__name__)


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

    @property
    def alive(self) -> bool:
        """Connected, and the relay has not gone away."""
        return self._session is not None and not self._session.done()

    async def wait_closed(self) -> None:
        """Until the session ends (its error, if it failed). Cancelling the wait leaves the
        session running: only :meth:`close` ends it."""
        assert self._session is not None, "connect first"
        await asyncio.shield(self._session)

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
