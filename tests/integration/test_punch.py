"""Punch and a relayed call's origin on loopback: a node punches only towards the address a call
came from, within its limit under a burst; through a relay, punch and dial-back go where the
relay says the dialer connected from, never to the node's own sockets."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from swarmgrad.node.identity import Identity
from swarmgrad.node.reachability.punch import PunchResponder
from swarmgrad.node.reachability.relay_client import RelayClient
from swarmgrad.node.reachability.relay_server import RelayServer
from swarmgrad.protocol import peer
from swarmgrad.protocol.errors import STATUS_OF, ProtocolViolation
from swarmgrad.protocol.server import start_server
from tests.integration.reachability import (
    FAST,
    RUN,
    SPEC,
    anyone,
    relay_fixture,  # noqa: F401  (the fixture relay)
    servicer_of,
)


@pytest.fixture
async def puncher() -> AsyncIterator[tuple[Identity, peer.PeerServicer, PunchResponder, int]]:
    """A node that can punch (it believes its public address is 127.0.0.1)."""
    me = Identity.generate()
    responder = PunchResponder(host="127.0.0.1", target=None, public_host=lambda: "127.0.0.1")
    servicer = servicer_of(me, punch=responder)
    server, port = await start_server(lambda s: peer.add_to_server(servicer, s))
    responder.target = ("127.0.0.1", port)
    try:
        yield me, servicer, responder, port
    finally:
        await responder.close()
        await server.stop(None)


async def test_punch_goes_only_towards_the_caller_and_its_limit_holds_under_a_burst(
    puncher: tuple[Identity, peer.PeerServicer, PunchResponder, int],
) -> None:
    callee, servicer, responder, port = puncher
    caller = Identity.generate()
    silent = socket.socket()  # bound, not listening: every punch to it is refused and retried
    silent.bind(("127.0.0.1", 0))

    async def punch(host: str) -> grpc.StatusCode:
        try:
            await peer.ask_punch(
                f"127.0.0.1:{port}",
                signer=caller,
                callee=callee.peer_id,
                host=host,
                port=silent.getsockname()[1],
                run_id=RUN,
                spec_hash=SPEC,
            )
        except ProtocolViolation as error:
            return STATUS_OF[error.code]
        return grpc.StatusCode.OK

    try:
        # A host the call did not come from: refused, and nothing is dialed.
        assert await punch("10.9.8.7") == grpc.StatusCode.PERMISSION_DENIED
        assert servicer.punches == 0
        fds = len(os.listdir("/proc/self/fd"))
        statuses = await asyncio.gather(*(punch("127.0.0.1") for _ in range(60)))
        assert statuses.count(grpc.StatusCode.OK) == 4
        assert statuses.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 56
        assert responder.counts["refused"] == 56
        assert len(os.listdir("/proc/self/fd")) < fds + 20
        assert servicer.rejections.by_code("Peer") == {"WRONG_ADDRESS": 1, "OVERLOADED": 56}
    finally:
        silent.close()


async def test_through_a_relay_punch_knows_who_really_called(relay: RelayServer) -> None:
    # A relayed call reaches the node's server from its own relay client (127.0.0.1 here, as
    # anywhere); the relay tells the client where the dialer connected from, and Punch asks that.
    me, caller = Identity.generate(), Identity.generate()
    looked_up: list[str | None] = []
    clients: list[RelayClient] = []

    def origin(local: str) -> str | None:
        looked_up.append(clients[0].origins.get(local))
        return looked_up[-1]

    responder = PunchResponder(host="127.0.0.1", target=None, public_host=lambda: "127.0.0.1")
    servicer = servicer_of(me, punch=responder, origin=origin)
    server, port = await start_server(lambda s: peer.add_to_server(servicer, s))
    responder.target = ("127.0.0.1", port)
    clients.append(RelayClient(f"127.0.0.1:{relay.port}", me, target=("127.0.0.1", port)))
    try:
        relayed = await clients[0].connect()
        host, _ = await peer.ask_punch(
            relayed,
            signer=caller,
            callee=me.peer_id,
            host="127.0.0.1",
            port=9,
            run_id=RUN,
            spec_hash=SPEC,
        )
        assert host == "127.0.0.1"
        assert looked_up == ["127.0.0.1"]  # the relay-reported origin, not a guess
        assert servicer.punches == 1
    finally:
        await clients[0].close()
        await responder.close()
        await server.stop(None)


async def _forward_from(source_host: str, target: tuple[str, int]) -> tuple[asyncio.Server, int]:
    """A loopback port whose connections reach ``target`` from ``source_host`` (so a relay sees
    a dialer at another address than the node's own)."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        far_reader, far_writer = await asyncio.open_connection(*target, local_addr=(source_host, 0))
        await asyncio.gather(pipe(reader, far_writer), pipe(far_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_a_relayed_dial_back_dials_the_caller_not_the_nodes_own_sockets() -> None:
    # The node's server sees a relayed call come from its own relay client (127.0.0.1): dialing
    # "the caller" there would reach any port of the node's own machine (a port scanner behind
    # its NAT). The relay says the dialer came from 127.0.0.2; that is where it dials.
    me, caller = Identity.generate(), Identity.generate()
    clients: list[RelayClient] = []
    servicer = servicer_of(me, origin=lambda local: clients[0].origins.get(local))
    server, port = await start_server(lambda s: peer.add_to_server(servicer, s), host="127.0.0.1")
    relay = RelayServer(host="127.0.0.3", admit=anyone, limits=FAST)
    await relay.start()
    reached: list[object] = []

    async def private(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reached.append(writer.get_extra_info("peername"))
        writer.close()

    local_service = await asyncio.start_server(private, "127.0.0.1", 0)
    local_port = local_service.sockets[0].getsockname()[1]
    clients.append(RelayClient(f"127.0.0.3:{relay.port}", me, target=("127.0.0.1", port)))
    relayed = await clients[0].connect()
    forwarder, via = await _forward_from("127.0.0.2", ("127.0.0.3", int(relayed.split(":")[1])))

    async def dial_back() -> peer.DialBack:
        return await peer.ask_dial_back(
            f"127.0.0.1:{via}",
            signer=caller,
            helper_id=me.peer_id,
            port=local_port,
            run_id=RUN,
            spec_hash=SPEC,
        )

    try:
        reply = await dial_back()
        assert reply.observed_host == "127.0.0.2"
        assert not reply.reachable
        assert reached == [], "the node dialed a socket of its own machine for a stranger"
        # A relayed call whose dialer the relay did not name is refused, not dialed locally.
        clients[0].origins = _Unnamed()
        with pytest.raises(ProtocolViolation, match="did not name"):
            await dial_back()
        assert reached == []
    finally:
        forwarder.close()
        local_service.close()
        await clients[0].close()
        await relay.close()
        await server.stop(None)


class _Unnamed(dict[str, str]):
    """Origins as a relay that names no dialer leaves them: every relayed end maps to ""."""

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return ""
