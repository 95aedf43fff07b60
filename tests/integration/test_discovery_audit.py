"""Discovery against a hostile or failing DHT, on real nodes of each backend: one key's entries
bounded, a store the DHT refused reported as refused, and the libp2p sidecar restarted when its
port is taken or its bootstrap peer is gone. (libp2p runs in its sidecar processes only.)"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from swarmgrad.node.discovery.base import BACKENDS, Discovery, DiscoveryError, dht_time
from swarmgrad.node.discovery.budget import MAX_ENTRIES_PER_KEY
from swarmgrad.node.discovery.envelope import Kind, seal
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.discovery.start import DiscoveryConfig, start_discovery
from swarmgrad.node.identity import Identity
from swarmgrad.protocol.errors import BindError
from tests.helpers import until, wait_until

RUN, SPEC = "run-audit", b"\x0b" * 32
PEERS = f"run/{RUN}/{SPEC.hex()}/peers"
Starter = Callable[..., Awaitable[Any]]


def starter_for(backend: str, started: list[Discovery]) -> Starter:
    async def starter(identity: Identity, **kwargs: Any) -> Any:
        config = DiscoveryConfig(backend=backend, **kwargs)
        node = await start_discovery(config, identity, run_id=RUN, spec_hash=SPEC)
        started.append(node)
        return node

    return starter


@pytest.fixture(params=BACKENDS)
async def start(request: pytest.FixtureRequest) -> AsyncIterator[Starter]:
    started: list[Discovery] = []
    try:
        yield starter_for(request.param, started)
    finally:
        for node in started:
            await node.close()


@pytest.fixture
async def start_libp2p() -> AsyncIterator[Starter]:
    started: list[Discovery] = []
    try:
        yield starter_for("libp2p", started)
    finally:
        for node in started:
            await node.close()


def live(identity: Identity, *, now: float | None = None, ttl: float = 60.0) -> PeerRecord:
    return PeerRecord.create(
        identity.peer_id,
        run_id=RUN,
        spec_hash=SPEC,
        endpoint="127.0.0.1:1",
        now=dht_time() if now is None else now,
        ttl_seconds=ttl,
    )


def leave(identity: Identity, expires: float) -> bytes:
    return seal(identity, key=PEERS, kind=Kind.LEAVE, body=b"", issued_at=dht_time(),
                expires_at=expires)  # fmt: skip


@pytest.mark.slow
async def test_a_dht_node_keeps_at_most_4096_entries_under_one_key(start: Starter) -> None:
    # hivemind kept every sealed value a stranger stored under a key (5001 seen, +116 MiB).
    node = await start(Identity.generate(), call_timeout_seconds=30.0)
    expires = dht_time() + 120
    signers = [Identity.generate() for _ in range(MAX_ENTRIES_PER_KEY)]
    for first in range(0, len(signers), 64):
        batch = signers[first : first + 64]
        stored = await asyncio.gather(
            *(node._store(PEERS, s.peer_id, leave(s, expires), expires) for s in batch)
        )
        assert all(stored), f"refused before the key was full (from entry {first + 1})"
    late = Identity.generate()
    assert not await node._store(PEERS, late.peer_id, leave(late, expires), expires)
    # A signer already there still renews its own slot.
    renewed = signers[0]
    assert await node._store(PEERS, renewed.peer_id, leave(renewed, expires + 5), expires + 5)


async def test_a_record_the_dht_refuses_is_not_reported_stored(start: Starter) -> None:
    # libp2p's replicas answered "ok" to a store they refused (they hold a later expiry): the
    # node believed its new record was out while peers kept reading the old one.
    me = Identity.generate()
    node = await start(me)
    now = dht_time()
    await node.announce(live(me, now=now))
    with pytest.raises(DiscoveryError, match="no DHT node accepted"):
        await node.announce(live(me, now=now - 40))  # the clock stepped back: expires earlier
    assert [r.expires_at for r in await node.find()] == [now + 60]


async def test_a_taken_dht_port_is_a_setup_error_on_both_backends(start: Starter) -> None:
    # Both said "could not join the DHT" (a DiscoveryError: the CLI's exit 4, an unreachable
    # swarm) where the docs promise exit 2 (a configuration to fix) for a port in use
    # (docs/running-a-node.md, "Configuration layers").
    taken = socket.create_server(("127.0.0.1", 0))
    with taken, pytest.raises(BindError, match="in use"):
        await start(Identity.generate(), port=taken.getsockname()[1])


def port_of(node: Any) -> int:
    return int(node.visible_maddrs()[0].split("/tcp/")[1].split("/")[0])


@pytest.mark.timeout(300)  # the restart alone may take 120 s on a loaded machine
async def test_a_taken_port_fails_the_start_and_a_restart_moves_on(
    start_libp2p: Starter,
) -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    try:  # a setup error (the CLI's exit 2), not an unreachable swarm (exit 4)
        with pytest.raises(BindError, match="is the port in use"):
            await start_libp2p(Identity.generate(), port=taken.getsockname()[1])
    finally:
        taken.close()
    # The sidecar dies and another program takes its port before the restart: it used to end
    # the supervisor (IndexError), leaving discovery down for good.
    me = Identity.generate()
    node = await start_libp2p(me, call_timeout_seconds=3.0)
    await node.announce(live(me))
    port, pid = port_of(node), node.sidecar.pid
    os.kill(pid, signal.SIGKILL)
    _wait_until_dead(pid)  # blocking: the loop must not see the death before the port is taken
    with socket.create_server(("127.0.0.1", port)):
        # A bound on the supervisor restarting at all: each try is a new interpreter importing
        # py-libp2p (CI, beside a swarm test: over 30 s for the restart).
        async with asyncio.timeout(120):
            await node.sidecar.restarted.wait()
        assert port_of(node) != port
        assert [r.peer_id for r in await node.find()] == [me.peer_id]


def _wait_until_dead(pid: int) -> None:
    wait_until(
        lambda: _state(pid) in ("gone", "Z"),
        timeout_seconds=10,
        what="the sidecar's death",
        interval_seconds=0.01,
    )


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.slow
async def test_a_sidecar_restarts_through_known_peers_once_the_bootstrap_left(
    start_libp2p: Starter,
) -> None:
    boot = await start_libp2p(Identity.generate())
    b_id, c_id = Identity.generate(), Identity.generate()
    b = await start_libp2p(b_id, initial_peers=boot.visible_maddrs())
    c = await start_libp2p(c_id, initial_peers=boot.visible_maddrs())
    await c.announce(live(c_id))
    c_peer = c.visible_maddrs()[0].rsplit("/p2p/", 1)[1]

    async def b_knows_c() -> bool:
        return any(p.endswith(c_peer) for p in b.sidecar.known_peers)

    await until(b_knows_c, timeout_seconds=20, what="b's sidecar telling of c")
    await boot.close()
    os.kill(b.sidecar.pid, signal.SIGKILL)
    async with asyncio.timeout(30):
        await b.sidecar.restarted.wait()
    assert [r.peer_id for r in await b.find()] == [c_id.peer_id]


async def test_a_wrong_dht_secret_is_named_as_a_cause(start_libp2p: Starter) -> None:
    # Under another network key the handshake fails like an unreachable peer: the message says
    # which setting to check.
    private = await start_libp2p(Identity.generate(), network_secret="our run")
    with pytest.raises(DiscoveryError, match="or this node's --dht-secret differs"):
        await start_libp2p(Identity.generate(), initial_peers=private.visible_maddrs())
