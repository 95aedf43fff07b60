"""Unit tests of the node's network parts, no sockets: UPnP port mapping (no gateway, a gateway
without a public address, the address a dial-back saw), the channel cache, and the punch routes
kept for relayed peers."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace
from typing import Any, cast

import grpc
import pytest

from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.identity import Identity
from swarmgrad.node.reachability import routes as routes_module
from swarmgrad.node.reachability.dialback import Reach, Reachability, ReachabilityConfig
from swarmgrad.node.reachability.portmap import PortMapError, map_port
from swarmgrad.node.reachability.relay import RelayLimits
from swarmgrad.node.reachability.routes import PunchRoutes
from swarmgrad.node.transport.transport import MAX_CHANNELS, Transport, TransportConfig
from swarmgrad.protocol.peer import DialBack


async def test_no_upnp_gateway_is_said_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    class NobodyAnswers:  # miniupnpc when no gateway answers: errno's text for "no error"
        discoverdelay = 0

        def discover(self) -> int:
            raise Exception("Success")  # what the library raises

    monkeypatch.setitem(sys.modules, "miniupnpc", SimpleNamespace(UPnP=NobodyAnswers))
    with pytest.raises(PortMapError, match=r"^no UPnP gateway answered on this network$"):
        await map_port("127.0.0.1", 1234, discover_ms=1)


class _Gateway:
    """miniupnpc.UPnP as a LAN gateway answers it; ``external`` is its WAN address answer."""

    discoverdelay = 0
    lanaddr = "192.168.1.10"
    external = ""

    def discover(self) -> int:
        return 1

    def selectigd(self) -> str:
        return "http://gateway/control"

    def externalipaddress(self) -> str:
        return type(self).external

    def addportmapping(self, *args: object) -> bool:
        return True

    def deleteportmapping(self, *args: object) -> bool:
        return True


async def test_a_gateway_without_a_public_address_maps_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "miniupnpc", SimpleNamespace(UPnP=_Gateway))
    for answer in ("", "0.0.0.0", "not an address"):  # "" while the WAN link is still down
        monkeypatch.setattr(_Gateway, "external", answer)
        with pytest.raises(PortMapError, match="no usable public address"):
            await map_port("127.0.0.1", 1234, discover_ms=1)


async def test_upnp_announces_the_address_dialed_back_and_a_failed_check_is_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Behind a second NAT the gateway's own WAN address (100.64.x.x, carrier-grade NAT) reaches
    # nobody: the node announces where the helper's dial-back reached it. A check that fails
    # with an error nobody foresaw is logged, counted and tried again: the checks go on.
    monkeypatch.setitem(sys.modules, "miniupnpc", SimpleNamespace(UPnP=_Gateway))
    monkeypatch.setattr(_Gateway, "external", "100.64.3.9")
    spec = SimpleNamespace(run=SimpleNamespace(id="run"), hash=b"\5" * 32)
    transport = SimpleNamespace(config=SimpleNamespace(host="0.0.0.0", public_host=""), port=4242)

    async def no_peers() -> list[PeerRecord]:
        return []

    async def nobody(peer_id: str) -> str | None:
        return "no relay here"

    mapped = asyncio.Event()  # unreachable (no relay offered) while the gateway is asked
    reach = Reachability(
        cast(Any, SimpleNamespace(peer_id="me")),
        cast(Any, spec),
        cast(Any, transport),
        peers=no_peers,
        changed=lambda: mapped.set() if reach.kind == Reach.UPNP else None,
        admit=nobody,  # never asked: this node offers no relay
        config=ReachabilityConfig(retry_seconds=0.01, relay_limits=RelayLimits(max_clients=0)),
    )
    probes: list[int] = []

    async def probe(port: int) -> DialBack:
        probes.append(port)
        if len(probes) == 1:
            raise RuntimeError("a bug in the first check")
        # The node's own port is not reachable; the mapped one is, seen at 203.0.113.7.
        return DialBack("helper", len(probes) > 2, "203.0.113.7", "")

    monkeypatch.setattr(reach, "_probe", probe)
    task = asyncio.create_task(reach.run())
    try:
        async with asyncio.timeout(5):
            await mapped.wait()
        assert reach.endpoint == "203.0.113.7:4242"
        assert reach.failures == 1
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_channel_cache_keeps_the_channels_used_last() -> None:
    """Endpoints come from peers' records; one peer naming endpoint after endpoint must not
    make the node hold a channel to each for good. (Channels connect lazily: no socket here.)"""
    transport = Transport(TransportConfig())
    first = transport.channel("127.0.0.1:1")
    kept = transport.channel("127.0.0.1:2")
    for port in range(3, MAX_CHANNELS + 3):
        transport.channel(f"127.0.0.1:{port}")
        transport.channel("127.0.0.1:2")  # in use all along: never the oldest
    assert transport.channel("127.0.0.1:2") is kept
    assert len(transport._channels) == MAX_CHANNELS
    await transport.close()
    assert first.get_state() is grpc.ChannelConnectivity.SHUTDOWN  # pushed out, then closed
    assert transport.channel("127.0.0.1:1") is not first  # opened afresh when needed again
    await transport.close()


async def test_punch_routes_keep_one_route_a_peer_and_a_bounded_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A relayed peer's endpoint changes with every relay it takes (and a peer may announce a
    # new one every round): each route holds a listening socket, so old ones must go.
    me = Identity.generate()
    spec = cast(Any, SimpleNamespace(run=SimpleNamespace(id="run"), hash=b"\5" * 32))
    monkeypatch.setattr(routes_module, "MAX_ROUTES", 4)
    routes = PunchRoutes(me, spec, host="127.0.0.1", public_host=lambda: "127.0.0.1", enabled=True)

    def relayed(peer: Identity, port: int) -> PeerRecord:
        return PeerRecord.create(
            peer.peer_id,
            run_id="run",
            spec_hash=spec.hash,
            endpoint=f"127.0.0.1:{port}",
            now=0.0,
            ttl_seconds=60,
            reachability="relayed",
            via="relay",
        )

    try:
        mover = Identity.generate()
        for port in range(20000, 20050):  # one peer, a new relay port each round
            record = relayed(mover, port)
            await routes.prepare([record.endpoint], [record])
        assert list(routes._routes) == ["127.0.0.1:20049"]
        assert routes.resolve("127.0.0.1:20048") == "127.0.0.1:20048"  # the old one: no route
        others = [relayed(Identity.generate(), 21000 + i) for i in range(6)]
        await routes.prepare([r.endpoint for r in others], others)
        assert len(routes._routes) == 4
        assert set(routes._routes) == {r.endpoint for r in others[2:]}
    finally:
        await routes.close()
    assert not routes._routes
