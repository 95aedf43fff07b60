"""The NAT's kind from the ports peers see one local port's calls come from (doctor's
reachability line): the rule on its cases, the calls from one port over real loopback sockets,
and a helper that answers with a port no socket has."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from swarmgrad.node.identity import Identity
from swarmgrad.node.reachability.nat_kind import Seen, classify, from_one_port
from swarmgrad.protocol import peer
from swarmgrad.protocol.errors import PeerUnavailable
from swarmgrad.protocol.v1 import peer_pb2

HOME = ("192.168.1.2", 40000)


def _seen(*observed: tuple[str, int], local: tuple[str, int] = HOME) -> list[Seen]:
    return [Seen(local, o) for o in observed]


def test_the_ports_peers_saw_tell_the_nat_kind() -> None:
    assert classify(_seen(HOME, HOME)).kind == "none"
    kept = classify(_seen(("11.7.0.101", 40000), ("11.7.0.101", 40000)))
    assert kept.kind == "keeps-ports"
    assert "2 peers saw port 40000" in kept.said
    assert classify(_seen(("11.7.0.101", 51000), ("11.7.0.101", 51000))).kind == "cone"
    symmetric = classify(_seen(("11.7.0.101", 51000), ("11.7.0.101", 52345)))
    assert symmetric.kind == "symmetric"
    assert "relay" in symmetric.said
    # One peer cannot tell a cone from a symmetric NAT once the port moved; relayed calls say
    # nothing about the port, and are left out.
    assert classify(_seen(("11.7.0.101", 51000))).kind == "unknown"
    assert classify(_seen(("11.7.0.101", 40000))).kind == "keeps-ports"
    assert classify(_seen(("11.7.0.101", 0), ("11.7.0.101", 0))).kind == "unknown"
    assert classify(_seen(("11.7.0.101", 0), ("11.7.0.101", 40000))).kind == "keeps-ports"
    assert classify([]).kind == "unknown"


async def test_calls_to_several_peers_leave_from_one_port() -> None:
    async def say_port(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = writer.get_extra_info("peername")[:2]
        writer.write(f"{host}:{port}\n".encode())
        await writer.drain()
        writer.close()

    servers = [await asyncio.start_server(say_port, "127.0.0.1", 0) for _ in range(3)]
    closed = await asyncio.start_server(say_port, "127.0.0.1", 0)
    nobody = closed.sockets[0].getsockname()[:2]
    closed.close()
    await closed.wait_closed()
    remotes = [s.sockets[0].getsockname()[:2] for s in servers] + [nobody]

    async def ask(i: int, endpoint: str) -> tuple[int, str]:
        host, port = endpoint.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        line = (await reader.readline()).decode().strip()
        writer.close()
        return i, line

    try:
        calls = await asyncio.wait_for(from_one_port(remotes, ask, host="127.0.0.1"), 30)
    finally:
        for server in servers:
            server.close()
    assert calls[3] == (None, None)  # nobody listens there: not connected, not called
    locals_ = {local for local, _ in calls[:3]}
    assert len(locals_) == 1  # one local port for every remote
    (local,) = locals_
    assert local is not None
    assert [result for _, result in calls[:3]] == [(i, f"{local[0]}:{local[1]}") for i in range(3)]


async def test_a_helper_that_names_an_impossible_port_is_not_believed() -> None:
    helper = Identity.generate()

    async def dial_back(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        reply = peer_pb2.DialBackReply(reachable=True, observed_host="127.0.0.1",
                                       observed_port=70000)  # fmt: skip
        return reply.SerializeToString()

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(dial_back)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(peer.SERVICE, {"DialBack": handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        with pytest.raises(PeerUnavailable, match="malformed port"):
            await peer.ask_dial_back(
                f"127.0.0.1:{port}", signer=Identity.generate(), helper_id=helper.peer_id,
                port=1234, run_id="r", spec_hash=b"h", timeout_seconds=10,
            )  # fmt: skip
    finally:
        await server.stop(grace=None)
