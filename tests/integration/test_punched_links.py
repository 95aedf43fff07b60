"""Punched links a callee holds open, on 127.0.0.1: one requesting key cannot hold more than its
share (one key once held 184, the node's open files 17 -> 569), and the links of a key that
holds few survive another key's flood of them."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from swarmgrad.node.identity import Identity
from swarmgrad.node.reachability.punch import PunchResponder
from swarmgrad.protocol import peer
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.server import start_server
from tests.helpers import until

RUN, SPEC = "run-punch", b"\x07" * 32
PER_PEER, IN_ALL = 3, 5


@dataclass
class Dialer:
    """A peer that asks for punched links and accepts them on a listener of its own (on one
    host a simultaneous open is a plain connect), keeping every link open from its side."""

    key: Identity
    links: list[asyncio.StreamReader] = field(default_factory=list)
    closed: int = 0  # links the callee closed (read to their end here)
    server: asyncio.Server | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.links.append(reader)
        task = asyncio.create_task(self._hold(reader, writer))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.read(4096):
                pass
            self.closed += 1
        finally:
            writer.close()

    @property
    def open(self) -> int:
        return len(self.links) - self.closed

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@pytest.fixture
async def callee() -> AsyncIterator[tuple[Identity, PunchResponder, int]]:
    """A node that can punch (it believes its public address is 127.0.0.1), with small limits."""
    me = Identity.generate()
    responder = PunchResponder(
        host="127.0.0.1",
        target=None,
        public_host=lambda: "127.0.0.1",
        max_links_per_peer=PER_PEER,
        max_links=IN_ALL,
    )
    identity = peer.PeerIdentity(
        peer_id=me.peer_id, run_id=RUN, spec_hash=SPEC, software_version="t", codecs=("none",)
    )
    servicer = peer.PeerServicer(
        identity, signer=me, verifier=Verifier(me.peer_id), punch=responder
    )
    server, port = await start_server(lambda s: peer.add_to_server(servicer, s))
    responder.target = ("127.0.0.1", port)
    try:
        yield me, responder, port
    finally:
        await responder.close()
        await server.stop(None)


async def punch(callee: tuple[Identity, PunchResponder, int], dialer: Dialer, port: int) -> None:
    """One punched link from ``dialer``, established before this returns."""
    me, responder, server_port = callee
    punched = responder.counts["punched"]
    await peer.ask_punch(
        f"127.0.0.1:{server_port}",
        signer=dialer.key,
        callee=me.peer_id,
        host="127.0.0.1",
        port=port,
        run_id=RUN,
        spec_hash=SPEC,
    )

    await settled(lambda: responder.counts["punched"] > punched, "a punched link")


async def test_one_key_holds_at_most_its_share_of_punched_links(
    callee: tuple[Identity, PunchResponder, int],
) -> None:
    _, responder, _ = callee
    greedy, modest, late = (Dialer(Identity.generate()) for _ in range(3))
    try:
        ports = [await d.start() for d in (greedy, modest, late)]
        fds = len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            await punch(callee, greedy, ports[0])
            assert responder.links(greedy.key.peer_id) <= PER_PEER
        # The callee closed the oldest as new ones came: the dialer sees them end.
        await settled(
            lambda: greedy.closed == 20 - PER_PEER, "the greedy key's oldest links closed"
        )
        assert greedy.open == PER_PEER
        assert responder.counts["closed"] == 20 - PER_PEER
        # 20 links asked, 3 kept: the files they hold (3 each here, both ends) stay bounded.
        assert len(os.listdir("/proc/self/fd")) < fds + 4 * PER_PEER + 8

        for _ in range(2):
            await punch(callee, modest, ports[1])
        assert responder.links() == IN_ALL
        # One more link beyond the total: it is the key holding the most that gives one up.
        await punch(callee, late, ports[2])
        assert responder.links() == IN_ALL
        assert responder.links(greedy.key.peer_id) == PER_PEER - 1
        assert responder.links(modest.key.peer_id) == 2
        assert responder.links(late.key.peer_id) == 1
        await settled(lambda: greedy.open == PER_PEER - 1, "the greedy key's link closed")
        assert modest.open == 2
        assert late.open == 1
    finally:
        for dialer in (greedy, modest, late):
            await dialer.close()


async def settled(condition: Callable[[], bool], what: str) -> None:
    await until(condition, timeout_seconds=10, what=what)
