"""The Peer service and a relay on 127.0.0.1 for the reachability tests: a run's identity, a
node's servicer, and the fixtures ``node`` and ``relay``.

The fixtures' functions are named ``*_fixture`` (pytest knows them by their ``name``): a test
file imports them by that name, and its tests' ``node`` and ``relay`` arguments shadow no import.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from swarmgrad.node.identity import Identity
from swarmgrad.node.reachability.relay import RelayLimits
from swarmgrad.node.reachability.relay_server import RelayServer
from swarmgrad.protocol import peer
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.server import start_server

RUN, SPEC = "run-r", b"\x05" * 32


def identity_of(me: Identity) -> peer.PeerIdentity:
    return peer.PeerIdentity(
        peer_id=me.peer_id, run_id=RUN, spec_hash=SPEC, software_version="t", codecs=("none",)
    )


def servicer_of(me: Identity, **options: Any) -> peer.PeerServicer:
    return peer.PeerServicer(identity_of(me), signer=me, verifier=Verifier(me.peer_id), **options)


@pytest.fixture(name="node")
async def node_fixture() -> AsyncIterator[tuple[Identity, peer.PeerServicer, int]]:
    """A gRPC server with the Peer service on 127.0.0.1 (what every node runs)."""
    me = Identity.generate()
    servicer = servicer_of(me)
    server, port = await start_server(lambda s: peer.add_to_server(servicer, s))
    try:
        yield me, servicer, port
    finally:
        await server.stop(None)


FAST = RelayLimits(ping_seconds=0.2, silence_seconds=1.0, attach_timeout_seconds=2.0)


async def anyone(peer_id: str) -> str | None:
    """Admits every peer: these tests are about carrying bytes (``test_relay_limits.py``: whom)."""
    return None


@pytest.fixture(name="relay")
async def relay_fixture() -> AsyncIterator[RelayServer]:
    server = RelayServer(host="127.0.0.1", admit=anyone, limits=FAST)
    await server.start()
    try:
        yield server
    finally:
        await server.close()
