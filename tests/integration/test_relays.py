"""Relays on loopback: a real TCP relay carries gRPC to a node behind it on 127.0.0.1:0, refuses
impostors, strangers and malformed frames, bounds its clients and a dialer's connections, and
its client learns within seconds that it died; a hostile relay cannot make its client open
sockets without limit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from typing import Any

import pytest

from swarmgrad.node.identity import Identity
from swarmgrad.node.reachability.relay import RelayError, RelayLimits
from swarmgrad.node.reachability.relay_client import RelayClient
from swarmgrad.node.reachability.relay_server import RelayServer
from swarmgrad.protocol import peer
from swarmgrad.protocol.errors import PeerUnavailable
from swarmgrad.protocol.server import open_channel
from tests.helpers import until
from tests.integration.reachability import (
    FAST,
    RUN,
    SPEC,
    anyone,
    node_fixture,  # noqa: F401  (the fixture node)
    relay_fixture,  # noqa: F401  (the fixture relay)
)


async def test_a_relay_carries_grpc_to_a_node_behind_it(
    node: tuple[Identity, peer.PeerServicer, int], relay: RelayServer
) -> None:
    me, _, port = node
    client = RelayClient(f"127.0.0.1:{relay.port}", me, target=("127.0.0.1", port), limits=FAST)
    endpoint = await client.connect()
    try:
        assert endpoint != f"127.0.0.1:{port}"
        # A channel held open to the same address (as averaging holds one) ...
        held = open_channel(endpoint)
        try:
            await held.channel_ready()
            for _ in range(3):  # ... does not lend its connection: each call has its own
                info = await peer.get_info(endpoint, run_id=RUN, spec_hash=SPEC, timeout_seconds=5)
                assert info.peer_id == me.peer_id
        finally:
            await held.close()
        assert relay.clients == 1
        assert relay.counts["connections"] == 4
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

    full = RelayServer(host="127.0.0.1", admit=anyone, limits=RelayLimits(max_clients=1))
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


async def test_nested_json_from_either_end_of_a_relay_is_a_relay_error(relay: RelayServer) -> None:
    nested = b"[" * 2040 + b"]" * 2040  # 4 KiB, deeper than the JSON parser's stack
    frame = struct.pack(">I", len(nested)) + nested
    # From a client: hung up on and counted, and the relay goes on serving.
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    writer.write(frame)
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5)  # the greeting, then EOF
    writer.close()
    assert relay.counts["refused: protocol"] == 1
    honest = RelayClient(f"127.0.0.1:{relay.port}", Identity.generate(), target=("127.0.0.1", 9))
    try:
        await honest.connect()
    finally:
        await honest.close()

    # From a relay: connect() raises RelayError, which reachability takes as "try another relay".
    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(frame)
        await writer.drain()
        await reader.read()  # until the client hangs up
        writer.close()

    hostile = await asyncio.start_server(greet, "127.0.0.1", 0)
    port = hostile.sockets[0].getsockname()[1]
    client = RelayClient(f"127.0.0.1:{port}", Identity.generate(), target=("127.0.0.1", 9))
    try:
        with pytest.raises(RelayError, match="nested too deeply"):
            await client.connect()
    finally:
        await client.close()
        hostile.close()


async def test_a_client_learns_within_seconds_that_its_relay_died(
    node: tuple[Identity, peer.PeerServicer, int],
) -> None:
    me, _, port = node
    relay = RelayServer(host="127.0.0.1", admit=anyone, limits=FAST)
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


async def test_a_relay_cannot_make_its_client_open_sockets_without_limit() -> None:
    # Each "open" costs the client two sockets (to the relay, to its own server): a relay that
    # asks 400 times gets at most its per-client limit, and one id asked twice is attached once.
    async def frame(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
        body = json.dumps(message).encode()
        writer.write(struct.pack(">I", len(body)) + body)
        await writer.drain()

    to_target: list[asyncio.StreamWriter] = []
    data: list[asyncio.StreamWriter] = []
    controls: list[asyncio.StreamWriter] = []
    control = asyncio.Event()

    async def target(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        to_target.append(writer)

    async def hostile_relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await frame(writer, {"relay": "swarmgrad/1", "nonce": "00" * 16})
        if control.is_set():  # a data connection: hold it open
            data.append(writer)
            return
        control.set()
        controls.append(writer)
        (size,) = struct.unpack(">I", await reader.readexactly(4))
        await reader.readexactly(size)  # the hello
        await frame(writer, {"ready": 40000})
        await frame(writer, {"open": "0" * 32, "from": "127.0.0.9"})
        for i in range(400):
            await frame(writer, {"open": f"{i:032x}", "from": "127.0.0.9"})
        with contextlib.suppress(ConnectionError, RuntimeError):
            while not writer.is_closing():
                await frame(writer, {"ping": 0})
                await asyncio.sleep(0.5)

    target_server = await asyncio.start_server(target, "127.0.0.1", 0)
    relay_server = await asyncio.start_server(hostile_relay, "127.0.0.1", 0)
    limits = RelayLimits(max_connections_per_client=8, ping_seconds=0.5, silence_seconds=3)
    client = RelayClient(
        f"127.0.0.1:{relay_server.sockets[0].getsockname()[1]}",
        Identity.generate(),
        target=("127.0.0.1", target_server.sockets[0].getsockname()[1]),
        limits=limits,
    )
    try:
        await client.connect()

        async def settled() -> bool:
            return client.refused_opens == 400 - 8 + 1 and len(to_target) == 8

        await until(settled, timeout_seconds=10, what="the opens over the limit refused")
        assert len(data) == 8
        assert len(to_target) == 8
    finally:
        await client.close()
        for writer in data + to_target + controls:
            writer.close()
        relay_server.close()
        target_server.close()
        await relay_server.wait_closed()
        await target_server.wait_closed()


async def test_one_dialer_address_cannot_hold_every_connection_of_a_relayed_node(
    node: tuple[Identity, peer.PeerServicer, int],
) -> None:
    me, _, port = node
    limits = RelayLimits(max_connections_per_client=6, max_connections_per_dialer=2)
    relay = RelayServer(host="127.0.0.1", admit=anyone, limits=limits)
    await relay.start()
    client = RelayClient(f"127.0.0.1:{relay.port}", me, target=("127.0.0.1", port), limits=limits)
    relayed_port = int((await client.connect()).split(":")[1])
    held: list[asyncio.StreamWriter] = []
    try:
        for _ in range(2):  # a squatter's idle connections from one address
            _, writer = await asyncio.open_connection(
                "127.0.0.1", relayed_port, local_addr=("127.0.0.2", 0)
            )
            held.append(writer)
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", relayed_port, local_addr=("127.0.0.2", 0)
        )
        held.append(writer)
        async with asyncio.timeout(5):
            assert await reader.read() == b"", "a third connection from one address was kept"
        assert relay.counts["refused: busy dialer"] == 1
        # Everyone else still gets through.
        info = await peer.get_info(
            f"127.0.0.1:{relayed_port}", run_id=RUN, spec_hash=SPEC, timeout_seconds=5
        )
        assert info.peer_id == me.peer_id
    finally:
        for writer in held:
            writer.close()
        await client.close()
        await relay.close()
