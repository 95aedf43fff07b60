"""Dial-back and relays on loopback: real gRPC servers and TCP relays on 127.0.0.1:0.

The NAT lab tests (``test_nat.py``) put the same parts behind real masquerading routers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import grpc
import pytest

from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.identity import Identity
from swarmgrad.node.kinds import Reach
from swarmgrad.node.reachability.dialback import Reachability, ReachabilityConfig
from swarmgrad.node.reachability.punch import PunchResponder
from swarmgrad.node.reachability.relay import RelayError, RelayLimits
from swarmgrad.node.reachability.relay_client import RelayClient
from swarmgrad.node.reachability.relay_server import RelayServer
from swarmgrad.protocol import peer
from swarmgrad.protocol.addresses import endpoint_of
from swarmgrad.protocol.auth import Verifier, sign_request
from swarmgrad.protocol.errors import STATUS_OF, PeerUnavailable, ProtocolViolation
from swarmgrad.protocol.peer import DialBack
from swarmgrad.protocol.server import open_channel, start_server
from swarmgrad.protocol.v1 import peer_pb2
from tests.helpers import until

RUN, SPEC = "run-r", b"\x05" * 32


def identity_of(me: Identity) -> peer.PeerIdentity:
    return peer.PeerIdentity(
        peer_id=me.peer_id, run_id=RUN, spec_hash=SPEC, software_version="t", codecs=("none",)
    )


def servicer_of(me: Identity, **options: Any) -> peer.PeerServicer:
    return peer.PeerServicer(identity_of(me), signer=me, verifier=Verifier(me.peer_id), **options)


@pytest.fixture
async def node() -> AsyncIterator[tuple[Identity, peer.PeerServicer, int]]:
    """A gRPC server with the Peer service on 127.0.0.1 (what every node runs)."""
    me = Identity.generate()
    servicer = servicer_of(me)
    server, port = await start_server(lambda s: peer.add_to_server(servicer, s))
    try:
        yield me, servicer, port
    finally:
        await server.stop(None)


async def ask(helper: tuple[Identity, int], me: Identity, port: int, **options: Any) -> Any:
    return await peer.ask_dial_back(
        f"127.0.0.1:{helper[1]}",
        signer=me,
        helper_id=helper[0].peer_id,
        port=port,
        run_id=options.pop("run_id", RUN),
        spec_hash=SPEC,
        **options,
    )


class _Impostor(peer.PeerServicer):
    """Answers GetInfo with another peer's id (it does not hold that peer's key)."""

    claimed = ""

    async def GetInfo(self, request: Any, context: Any) -> peer_pb2.PeerInfo:
        info = await super().GetInfo(request, context)
        info.peer_id = self.claimed
        return info


async def test_a_node_that_answers_is_told_it_is_reachable_and_where(
    node: tuple[Identity, peer.PeerServicer, int],
) -> None:
    helper_id, helper, helper_port = node
    me = Identity.generate()
    server, port = await start_server(lambda s: peer.add_to_server(servicer_of(me), s))
    other = Identity.generate()
    impostor = _Impostor(identity_of(other), signer=other, verifier=Verifier(other.peer_id))
    impostor.claimed = me.peer_id
    fake, fake_port = await start_server(lambda s: peer.add_to_server(impostor, s))
    try:
        verdict = await ask((helper_id, helper_port), me, port)
        assert verdict.reachable
        assert verdict.observed_host == "127.0.0.1"
        # Another peer's own port, claimed by me: whoever answers there is not me.
        verdict = await ask((helper_id, helper_port), other, port)
        assert not verdict.reachable
        assert "answered as" in verdict.detail
        # A server that says it is me, but cannot sign the helper's challenge with my key.
        verdict = await ask((helper_id, helper_port), me, fake_port)
        assert not verdict.reachable
        assert "could not prove the key" in verdict.detail
        assert helper.dial_backs == {"reachable": 1, "unreachable": 2}
    finally:
        await server.stop(None)
        await fake.stop(None)


async def test_a_port_nobody_answers_is_unreachable_within_the_deadline(
    node: tuple[Identity, peer.PeerServicer, int],
) -> None:
    helper_id, helper, helper_port = node
    # A port that was bound and released: nothing listens there.
    server, dead_port = await start_server(lambda s: None)
    await server.stop(None)
    loop = asyncio.get_running_loop()
    started = loop.time()
    verdict = await ask((helper_id, helper_port), Identity.generate(), dead_port)
    assert not verdict.reachable
    assert loop.time() - started < peer.DIAL_BACK_TIMEOUT_SECONDS + 2
    assert helper.dial_backs["unreachable"] == 1


async def _raw(port: int, method: str, request: bytes) -> grpc.aio.AioRpcError | None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            await channel.unary_unary(f"/{peer.SERVICE}/{method}")(request, timeout=10)
        except grpc.aio.AioRpcError as error:
            return error
    return None


async def test_bad_peer_requests_get_their_statuses_counted_not_tracebacks(
    node: tuple[Identity, peer.PeerServicer, int], caplog: pytest.LogCaptureFixture
) -> None:
    helper_id, helper, port = node
    me, mallory = Identity.generate(), Identity.generate()
    with pytest.raises(ProtocolViolation, match="says WRONG_RUN"):
        await ask((helper_id, port), me, 1, run_id="other")
    with pytest.raises(ProtocolViolation, match="says BAD_PAYLOAD: bad port"):
        await ask((helper_id, port), me, 0)
    # Dial-back in another's name: mallory signs a request that names me.
    request = peer_pb2.DialBackRequest(
        run_id=RUN, spec_hash=SPEC, port=80, peer_id=me.peer_id, receiver=helper_id.peer_id
    )
    request.auth.CopyFrom(
        sign_request(mallory, "/swarmgrad.v1.Peer/DialBack", helper_id.peer_id, [])
    )
    with caplog.at_level("INFO"):
        error = await _raw(port, "DialBack", request.SerializeToString())
        assert error is not None
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        for method in ("GetInfo", "DialBack", "Punch"):  # bytes that are no message at all
            for _ in range(20):
                error = await _raw(port, method, b"\x0a\xff\xff" + b"y" * 300)
                assert error is not None
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "y" * 20 not in (error.details() or "")
    assert helper.rejections.by_code("Peer") == {
        "WRONG_RUN": 1,
        "BAD_PAYLOAD": 61,
        "UNAUTHENTICATED": 1,
    }
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) <= 3
    with pytest.raises(PeerUnavailable):  # and a helper that is gone is only unavailable
        await peer.ask_dial_back(
            "127.0.0.1:1",
            signer=me,
            helper_id=helper_id.peer_id,
            port=80,
            run_id=RUN,
            spec_hash=SPEC,
            timeout_seconds=2,
        )


class _Flipper(peer.PeerServicer):
    """Signs its answer, then says the opposite of whether it has left the round asked about
    (what a tampering hop in between would do)."""

    async def GetInfo(self, request: Any, context: Any) -> peer_pb2.PeerInfo:
        info = await super().GetInfo(request, context)
        info.left_round = not info.left_round
        return info


async def test_a_peer_says_whether_it_has_left_a_round_and_signs_what_it_says() -> None:
    """The round's question of a peer gone quiet in it (``node/averaging/quiet.py``): GetInfo
    naming a round answers whether the peer has left it, from its registry of rounds. What it
    says is signed over the caller's challenge: flipped on the way, either way, the answer no
    longer proves the peer's key. A group id over 32 bytes is refused with its status."""
    me = Identity.generate()
    left = {(4, b"g" * 32)}
    options: dict[str, Any] = {"verifier": Verifier(me.peer_id), "round_left": left.__contains__}
    honest, flipper = (
        kind(identity_of(me), signer=me, **options) for kind in (peer.PeerServicer, _Flipper)
    )
    servers = [
        await start_server(lambda s, x=x: peer.add_to_server(x, s)) for x in (honest, flipper)
    ]
    try:
        (_, port), (_, flipped_port) = servers

        async def asked(at: int, round_key: tuple[int, bytes] | None) -> bool:
            info = await peer.get_info(
                f"127.0.0.1:{at}", run_id=RUN, spec_hash=SPEC, timeout_seconds=5,
                expected_peer=me.peer_id, round_key=round_key,
            )  # fmt: skip
            return info.left_round

        assert await asked(port, (4, b"g" * 32))  # finished (or given up on) here
        assert not await asked(port, (5, b"g" * 32))  # in it, not started, or never known
        assert not await asked(port, (4, b"h" * 32))  # another group's round 4
        assert not await asked(port, None)  # a question without a round: as before
        for round_key in ((4, b"g" * 32), (5, b"g" * 32)):
            with pytest.raises(ProtocolViolation, match="could not prove the key"):
                await asked(flipped_port, round_key)
        oversize = peer_pb2.GetInfoRequest(run_id=RUN, spec_hash=SPEC, group_id=b"x" * 33)
        error = await _raw(port, "GetInfo", oversize.SerializeToString())
        assert error is not None
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "a group id over 32 bytes" in (error.details() or "")
        assert honest.rejections.by_code("Peer") == {"BAD_PAYLOAD": 1}
    finally:
        for server, _ in servers:
            await server.stop(None)


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


FAST = RelayLimits(ping_seconds=0.2, silence_seconds=1.0, attach_timeout_seconds=2.0)


async def anyone(peer_id: str) -> str | None:
    """Admits every peer: these tests are about carrying bytes (``test_relay_limits.py``: whom)."""
    return None


@pytest.fixture
async def relay() -> AsyncIterator[RelayServer]:
    server = RelayServer(host="127.0.0.1", admit=anyone, limits=FAST)
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


def reachability_of(
    me: Identity,
    port: int,
    records: list[PeerRecord],
    config: ReachabilityConfig,
    changed: Any = lambda: None,
) -> Reachability:
    """A node's reachability checks for its server on 127.0.0.1:``port``, reading ``records``
    as the run's peers."""

    async def peers() -> list[PeerRecord]:
        return records

    transport = SimpleNamespace(config=SimpleNamespace(host="127.0.0.1", public_host=""), port=port)
    spec = SimpleNamespace(run=SimpleNamespace(id=RUN), hash=SPEC)
    return Reachability(
        me,
        cast(Any, spec),
        cast(Any, transport),
        peers=peers,
        changed=changed,
        admit=anyone,
        config=config,
    )


async def test_a_node_that_leaves_its_relay_for_a_mapped_port_stays_reachable_through_it(
    node: tuple[Identity, peer.PeerServicer, int], relay: RelayServer, monkeypatch: Any
) -> None:
    """A NAT'd node holds a relay while its router is asked for a port; once the mapped port is
    dialed back it announces that instead. A peer that read the relayed endpoint a moment
    before (a round's group is formed from records) still reaches the node through it for the
    handover time, then the relay lets the slot go. (Before: the link closed at once, and in
    the NAT lab the first round of the node's group failed on the address it had just left.)"""
    me, _, port = node
    offer = PeerRecord.create(
        "sgrelay",
        run_id=RUN,
        spec_hash=SPEC,
        endpoint="127.0.0.1:1",
        now=dht_time(),
        ttl_seconds=60,
        relay=f"127.0.0.1:{relay.port}",
        reachability=Reach.DIRECT.value,
    )

    verdicts: list[tuple[Reach, str]] = []
    mapped = asyncio.Event()  # the router answers when the test says so
    config = ReachabilityConfig(
        retry_seconds=0.05,
        handover_seconds=1.5,
        relay_limits=dataclasses.replace(FAST, max_clients=0),  # pings as the relay expects
    )
    reach = reachability_of(
        me, port, [offer], config, changed=lambda: verdicts.append((reach.kind, reach.endpoint))
    )

    async def probe(port: int) -> DialBack:  # the node's own port is not reachable from outside
        return DialBack("helper", False, "127.0.0.1", "")

    async def mapped_endpoint() -> str:
        await mapped.wait()
        return f"127.0.0.1:{port}"  # as a helper dialed it back

    monkeypatch.setattr(reach, "_probe", probe)
    monkeypatch.setattr(reach, "_mapped_endpoint", mapped_endpoint)
    task = asyncio.create_task(reach.run())
    try:
        await until(lambda: reach.kind == Reach.RELAYED, timeout_seconds=10, what="relayed")
        relayed = reach.endpoint
        assert relay.clients == 1
        mapped.set()
        await until(lambda: reach.kind == Reach.UPNP, timeout_seconds=10, what="mapped")
        assert [kind for kind, _ in verdicts] == [Reach.RELAYED, Reach.UPNP]
        left_at = asyncio.get_running_loop().time()
        # The peer that read the old record still gets through, right after the switch.
        info = await peer.get_info(relayed, run_id=RUN, spec_hash=SPEC, timeout_seconds=5)
        assert info.peer_id == me.peer_id
        assert relay.clients == 1
        # Then the handover ends: the relay's slot is free and the relayed endpoint is gone.
        await until(lambda: relay.clients == 0, timeout_seconds=10, what="the slot let go")
        assert asyncio.get_running_loop().time() - left_at >= 1.0
        with pytest.raises(PeerUnavailable):
            await peer.get_info(relayed, run_id=RUN, spec_hash=SPEC, timeout_seconds=2)
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert relay.clients == 0


async def test_the_only_reachable_node_is_confirmed_by_peers_it_relays_for(
    node: tuple[Identity, peer.PeerServicer, int],
) -> None:
    """A swarm's first public node, its other peers NAT'd: the only helpers it can ask are
    relayed through it. They dial back where the relay says the call came from, so it learns it
    is reachable within a check, not after the first round's 15 s wait for a verdict."""
    me, _, port = node
    natd = Identity.generate()
    client: list[RelayClient] = []
    servicer = servicer_of(natd, origin=lambda local: client[0].origins.get(local))
    server, natd_port = await start_server(lambda s: peer.add_to_server(servicer, s))
    relay = RelayServer(host="127.0.0.1", admit=anyone, limits=FAST)
    await relay.start()
    client.append(
        RelayClient(f"127.0.0.1:{relay.port}", natd, target=("127.0.0.1", natd_port), limits=FAST)
    )
    relayed = await client[0].connect()
    record = PeerRecord.create(
        natd.peer_id,
        run_id=RUN,
        spec_hash=SPEC,
        endpoint=relayed,
        now=dht_time(),
        ttl_seconds=60,
        reachability=Reach.RELAYED.value,
        via=me.peer_id,
    )

    config = ReachabilityConfig(retry_seconds=0.1, relay_limits=RelayLimits(max_clients=0))
    reach = reachability_of(me, port, [record], config)
    task = asyncio.create_task(reach.run())
    try:
        async with asyncio.timeout(10):
            await reach.settled.wait()
        assert (reach.kind, reach.endpoint) == (Reach.DIRECT, f"127.0.0.1:{port}")
        assert servicer.dial_backs["reachable"] >= 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client[0].close()
        await relay.close()
        await server.stop(None)


def test_grpc_peer_strings_parse() -> None:
    assert peer.host_of("ipv4:11.7.0.101:34567") == "11.7.0.101"
    assert peer.host_of("ipv6:[::1]:5") == "::1"
    assert peer.host_of("unix:/tmp/x") == ""
    assert endpoint_of("::1", 5) == "[::1]:5"


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
