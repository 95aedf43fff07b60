"""Dial-back and a node's reachability on loopback: real gRPC servers and TCP relays on
127.0.0.1:0. A helper finds a node reachable only where the answer proves the node's key, bad
requests get their statuses, the Peer service says (signed) whether it has left a round, and a
node's reachability checks move it from a relay to a mapped port without losing its callers.

The NAT lab tests (``test_nat.py``) put the same parts behind real masquerading routers; the
relays themselves are tested in ``test_relays.py``, punch in ``test_punch.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from types import SimpleNamespace
from typing import Any, cast

import grpc
import pytest

from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.identity import Identity
from swarmgrad.node.kinds import Reach
from swarmgrad.node.reachability.dialback import Reachability, ReachabilityConfig
from swarmgrad.node.reachability.relay import RelayLimits
from swarmgrad.node.reachability.relay_client import RelayClient
from swarmgrad.node.reachability.relay_server import RelayServer
from swarmgrad.protocol import peer
from swarmgrad.protocol.addresses import endpoint_of
from swarmgrad.protocol.auth import Verifier, sign_request
from swarmgrad.protocol.errors import PeerUnavailable, ProtocolViolation
from swarmgrad.protocol.peer import DialBack
from swarmgrad.protocol.server import start_server
from swarmgrad.protocol.v1 import peer_pb2
from tests.helpers import until
from tests.integration.reachability import (
    FAST,
    RUN,
    SPEC,
    anyone,
    identity_of,
    node_fixture,  # noqa: F401  (the fixture node)
    relay_fixture,  # noqa: F401  (the fixture relay)
    servicer_of,
)


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
