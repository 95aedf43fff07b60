"""Dial-back and relays on loopback: real gRPC servers and TCP relays on 127.0.0.1:0.

The NAT lab tests (tests/test_nat.py) put the same parts behind real masquerading routers.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator

import pytest

from swarmgrad.node.identity import Identity
from swarmgrad.node.relay import RelayClient, RelayError, RelayLimits, RelayServer
from swarmgrad.protocol import peer
from swarmgrad.protocol.errors import PeerUnavailable, ProtocolViolation
from swarmgrad.protocol.server import start_server

RUN, SPEC = "run-r", b"\x05" * 32


def identity_of(me: Identity) -> peer.PeerIdentity:
    return peer.PeerIdentity(
        peer_id=me.peer_id, run_id=RUN, spec_hash=SPEC, software_version="t", codecs=("none",)
    )


@pytest.fixture
async def node() -> AsyncIterator[tuple[Identity, peer.PeerServicer, int]]:
    """A gRPC server with the Peer service on 127.0.0.1 (what every node runs)."""
    me = Identity.generate()
    servicer = peer.PeerServicer(identity_of(me))
    server, port = await start_server(lambda s: peer.add_to_server(servicer, s))
    try:
        yield me, servicer, port
    finally:
        await server.stop(None)


async def test_a_node_that_answers_is_told_it_is_reachable_and_where(
    node: tuple[Identity, peer.PeerServicer, int],
) -> None:
    _, helper, helper_port = node
    me = Identity.generate()
    mine = peer.PeerServicer(identity_of(me))
    server, port = await start_server(lambda s: peer.add_to_server(mine, s))
    try:
        verdict = await peer.ask_dial_back(
            f"127.0.0.1:{helper_port}", port=port, peer_id=me.peer_id, run_id=RUN, spec_hash=SPEC
        )
        assert verdict.reachable
        assert verdict.observed_host == "127.0.0.1"
        # The same port claimed by another peer id: whoever answers there is not that peer.
        other = Identity.generate().peer_id
        verdict = await peer.ask_dial_back(
            f"127.0.0.1:{helper_port}", port=port, peer_id=other, run_id=RUN, spec_hash=SPEC
        )
        assert not verdict.reachable
        assert "answered as" in verdict.detail
        assert helper.dial_backs == {"reachable": 1, "unreachable": 1, "refused": 0}
    finally:
        await server.stop(None)


async def test_a_port_nobody_answers_is_unreachable_within_the_deadline(
    node: tuple[Identity, peer.PeerServicer, int],
) -> None:
    _, helper, helper_port = node
    # A port that was bound and released: nothing listens there.
    server, dead_port = await start_server(lambda s: None)
    await server.stop(None)
    loop = asyncio.get_running_loop()
    started = loop.time()
    verdict = await peer.ask_dial_back(
        f"127.0.0.1:{helper_port}", port=dead_port, peer_id="sgx", run_id=RUN, spec_hash=SPEC
    )
    assert not verdict.reachable
    assert loop.time() - started < peer.DIAL_BACK_TIMEOUT_SECONDS + 2
    assert helper.dial_backs["unreachable"] == 1


async def test_bad_dial_back_requests_get_clear_statuses(
    node: tuple[Identity, peer.PeerServicer, int],
) -> None:
    _, helper, port = node
    endpoint = f"127.0.0.1:{port}"
    with pytest.raises(ProtocolViolation, match="says WRONG_RUN"):
        await peer.ask_dial_back(endpoint, port=1, peer_id="sgx", run_id="other", spec_hash=SPEC)
    with pytest.raises(ProtocolViolation, match="INVALID_ARGUMENT"):
        await peer.ask_dial_back(endpoint, port=0, peer_id="sgx", run_id=RUN, spec_hash=SPEC)
    with pytest.raises(ProtocolViolation, match="INVALID_ARGUMENT"):
        await peer.ask_dial_back(endpoint, port=80, peer_id="", run_id=RUN, spec_hash=SPEC)
    assert helper.dial_backs["refused"] == 3
    with pytest.raises(PeerUnavailable):  # and a helper that is gone is only unavailable
        await peer.ask_dial_back(
            "127.0.0.1:1", port=80, peer_id="sgx", run_id=RUN, spec_hash=SPEC, timeout_seconds=2
        )


FAST = RelayLimits(ping_seconds=0.2, silence_seconds=1.0, attach_timeout_seconds=2.0)


@pytest.fixture
async def relay() -> AsyncIterator[RelayServer]:
    server = RelayServer(host="127.0.0.1", limits=FAST)
    await server.start()
    try:
        yield server
    finally:
        await server.close()


async def test_a_relay_carries_grpc_to_a_node_behind_it(
    node: tuple[Identity, peer.PeerServicer, int], relay: RelayServer
) -> None:
    me, _, port = node
    client = RelayClient(f"127.0.0.1:{relay.port}", me, target=("127.0.0.1", port), limits=FAST)
    endpoint = await client.connect()
    try:
        assert endpoint != f"127.0.0.1:{port}"
        for _ in range(3):  # separate connections, each relayed
            info = await peer.get_info(endpoint, run_id=RUN, spec_hash=SPEC, timeout_seconds=5)
            assert info.peer_id == me.peer_id
        assert relay.clients == 1
        assert relay.counts["connections"] == 3
        assert relay.traffic["in"] > 0
        assert relay.traffic["out"] > 0
    finally:
        await client.close()


async def test_a_relay_refuses_impostors_and_strangers_and_bounds_its_clients(
    relay: RelayServer,
) -> None:
    async def hello(message: dict[str, object]) -> dict[str, object]:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        try:
            (size,) = struct.unpack(">I", await reader.readexactly(4))
            await reader.readexactly(size)
            body = json.dumps(message).encode()
            writer.write(struct.pack(">I", len(body)) + body)
            await writer.drain()
            data = await asyncio.wait_for(reader.read(4096), 5)
            return json.loads(data[4:]) if data else {}
        finally:
            writer.close()

    mallory, alice = Identity.generate(), Identity.generate()
    # Mallory claims Alice's peer id with her own key, then signs the wrong nonce.
    forged = {"hello": alice.peer_id, "key": mallory.public_key.hex(), "sig": "00" * 64}
    assert await hello(forged) == {}  # hung up on
    wrong = {
        "hello": mallory.peer_id,
        "key": mallory.public_key.hex(),
        "sig": mallory.sign(b"not the nonce").hex(),
    }
    assert await hello(wrong) == {}
    assert await hello({"data": "no-such-connection"}) == {}
    assert relay.counts["refused: protocol"] == 2
    assert relay.counts["refused: unknown connection"] == 1
    # An oversized frame is refused before it is read.
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    writer.write(struct.pack(">I", 10**9))
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5)  # the greeting, then EOF
    writer.close()

    full = RelayServer(host="127.0.0.1", limits=RelayLimits(max_clients=1))
    await full.start()
    clients = [
        RelayClient(f"127.0.0.1:{full.port}", Identity.generate(), target=("127.0.0.1", 9))
        for _ in range(2)
    ]
    try:
        await clients[0].connect()
        with pytest.raises(RelayError, match="full"):
            await clients[1].connect()
    finally:
        for client in clients:
            await client.close()
        await full.close()


async def test_a_client_learns_within_seconds_that_its_relay_died(
    node: tuple[Identity, peer.PeerServicer, int],
) -> None:
    me, _, port = node
    relay = RelayServer(host="127.0.0.1", limits=FAST)
    await relay.start()
    client = RelayClient(f"127.0.0.1:{relay.port}", me, target=("127.0.0.1", port), limits=FAST)
    endpoint = await client.connect()
    await relay.close()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(RelayError):
        async with asyncio.timeout(5):
            await client.wait_closed()
    assert loop.time() - started <= FAST.silence_seconds + 1
    with pytest.raises(PeerUnavailable):  # and its relayed endpoint is gone with the relay
        await peer.get_info(endpoint, run_id=RUN, spec_hash=SPEC, timeout_seconds=2)
    await client.close()


def test_grpc_peer_strings_parse() -> None:
    assert peer.host_of("ipv4:11.7.0.101:34567") == "11.7.0.101"
    assert peer.host_of("ipv6:[::1]:5") == "::1"
    assert peer.host_of("unix:/tmp/x") == ""
    assert peer.endpoint_of("::1", 5) == "[::1]:5"
