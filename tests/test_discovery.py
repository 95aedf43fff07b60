"""Discovery: signed peer records (unit), and the contract every backend meets (real DHT nodes)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from swarmgrad.node.discovery.base import (
    BACKENDS,
    Discovery,
    DiscoveryError,
    dht_time,
    start_discovery,
)
from swarmgrad.node.discovery.hivemind_dht import HivemindDiscovery, start_dht
from swarmgrad.node.discovery.records import MAX_TTL_SECONDS, PeerRecord, RecordError
from swarmgrad.node.identity import Identity
from swarmgrad.protocol.server import start_server

RUN, SPEC = "run-a", b"\x07" * 32


def record(
    identity: Identity, *, ttl: float = 60.0, now: float = 1000.0, **changes: object
) -> PeerRecord:
    fields: dict[str, object] = {
        "run_id": RUN,
        "spec_hash": SPEC,
        "endpoint": "127.0.0.1:5000",
        "now": now,
        "ttl_seconds": ttl,
    }
    fields.update(changes)
    return PeerRecord.create(identity, **fields)  # type: ignore[arg-type]


# -- records ------------------------------------------------------------------------------------


def test_a_signed_record_verifies_and_round_trips() -> None:
    me = Identity.generate()
    original = record(me, epoch=7, throughput=123.5)
    parsed = PeerRecord.verify(original.sign(me), run_id=RUN, spec_hash=SPEC, now=1001.0)
    assert parsed == original


def tamper(data: bytes, **changes: object) -> bytes:
    body = json.loads(data[:-64])
    body.update(changes)
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode() + data[-64:]


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: tamper(d, epoch=99), "bad signature"),
        (lambda d: tamper(d, peer_id="sgother"), "carries the key"),
        (lambda d: tamper(d, public_key=Identity.generate().public_key.hex()), "carries the key"),
        (lambda d: tamper(d, public_key="zz"), "malformed public key"),
        (lambda d: tamper(d, epoch="7"), "wrong type"),
        (lambda d: tamper(d, reachability=1), "wrong type"),
        (lambda d: tamper(d, reachability="teleported"), "unknown reachability"),
        (lambda d: tamper(d, role="admin"), "unknown role"),
        (lambda d: tamper(d, extra=1), "fields"),
        (lambda d: d[:-1], "bad signature|not JSON"),
        (lambda d: b"\x00" * 100, "not JSON"),
        (lambda d: d + b"x" * 5000, "too large"),
        (lambda d: b"", "too small"),
    ],
)
def test_forged_or_malformed_records_are_refused(
    mutate: Callable[[bytes], bytes], match: str
) -> None:
    me = Identity.generate()
    with pytest.raises(RecordError, match=match):
        PeerRecord.verify(mutate(record(me).sign(me)), run_id=RUN, spec_hash=SPEC, now=1001.0)


def test_records_of_another_run_expired_or_immortal_are_refused() -> None:
    me = Identity.generate()
    data = record(me, ttl=60).sign(me)
    with pytest.raises(RecordError, match="not run-b"):
        PeerRecord.verify(data, run_id="run-b", spec_hash=SPEC, now=1001.0)
    with pytest.raises(RecordError, match="spec"):
        PeerRecord.verify(data, run_id=RUN, spec_hash=b"\x08" * 32, now=1001.0)
    with pytest.raises(RecordError, match="expired"):
        PeerRecord.verify(data, run_id=RUN, spec_hash=SPEC, now=1061.0)
    immortal = record(me, ttl=MAX_TTL_SECONDS + 1).sign(me)
    with pytest.raises(RecordError, match="lifetime"):
        PeerRecord.verify(immortal, run_id=RUN, spec_hash=SPEC, now=1001.0)


def test_only_the_owner_can_sign_its_record() -> None:
    me, other = Identity.generate(), Identity.generate()
    with pytest.raises(ValueError, match="own peer id"):
        record(me).sign(other)


# -- the backend contract (real DHT nodes on 127.0.0.1), for each backend ----------------------

Starter = Callable[..., Awaitable[Any]]


@pytest.fixture(params=BACKENDS)
async def start(request: pytest.FixtureRequest) -> AsyncIterator[Starter]:
    started: list[Discovery] = []

    async def starter(identity: Identity, **kwargs: Any) -> Any:
        kwargs.setdefault("run_id", RUN)
        kwargs.setdefault("spec_hash", SPEC)
        node = await start_discovery(request.param, identity, **kwargs)
        started.append(node)
        return node

    try:
        yield starter
    finally:
        for node in started:
            await node.close()


async def wait_for(
    node: Discovery, predicate: Callable[[list[PeerRecord]], bool], seconds: float = 15
) -> list[PeerRecord]:
    async with asyncio.timeout(seconds):
        while True:
            records = await node.find()
            if predicate(records):
                return records
            await asyncio.sleep(0.1)


def live(identity: Identity, ttl: float = 60.0, **changes: object) -> PeerRecord:
    return record(identity, ttl=ttl, now=dht_time(), **changes)


async def store_raw(node: Any, key: str, subkey: str, value: bytes, expires: float) -> None:
    """Write a value the way a malicious peer would: straight into the DHT, unchecked."""
    assert await node._store(key, subkey, value, expires)


def dht_pids(node: Any) -> list[int]:
    """The processes that make up ``node``'s DHT (hivemind: its process and its p2pd daemon)."""
    if hasattr(node, "_dht"):
        children = f"/proc/{node._dht.pid}/task/{node._dht.pid}/children"
        with open(children) as file:
            return [node._dht.pid, *map(int, file.read().split())]
    return [node.sidecar.pid]


@pytest.mark.slow
async def test_peers_find_each_other_through_a_bootstrap_node(start: Starter) -> None:
    ids = [Identity.generate() for _ in range(3)]
    boot = await start(ids[0])
    nodes = [boot] + [await start(i, initial_peers=boot.visible_maddrs()) for i in ids[1:]]
    for node, identity in zip(nodes, ids, strict=True):
        await node.announce(live(identity, endpoint=f"127.0.0.1:{5000 + len(node.run_id)}"))
    expected = sorted(i.peer_id for i in ids)
    for node in nodes:
        records = await wait_for(node, lambda rs: [r.peer_id for r in rs] == expected)
        assert all(r.run_id == RUN for r in records)


@pytest.mark.slow
async def test_another_spec_sees_nothing_and_forgeries_are_dropped_and_counted(
    start: Starter,
) -> None:
    honest, mallory = Identity.generate(), Identity.generate()
    boot = await start(honest)
    await boot.announce(live(honest))
    other_spec = await start(
        Identity.generate(), spec_hash=b"\x09" * 32, initial_peers=boot.visible_maddrs()
    )
    assert await other_spec.find() == []
    # Specs are listed above the hash, checked against it: both specs in use are seen.
    ours, theirs = b'{"spec":"a"}', b'{"spec":"b"}'
    await boot.for_spec(hashlib.sha256(ours).digest()).announce_spec(
        ours, expires_at=dht_time() + 30
    )
    await other_spec.for_spec(hashlib.sha256(theirs).digest()).announce_spec(
        theirs, expires_at=dht_time() + 30
    )
    await store_raw(other_spec, f"run/{RUN}/specs", "00" * 32, ours, dht_time() + 30)  # a liar
    specs = await boot.find_specs()
    assert specs == {hashlib.sha256(s).hexdigest(): s for s in (ours, theirs)}
    assert boot.rejected["bad spec"] >= 1
    # Mallory writes a record signed by the wrong key, and one under the honest peer's subkey.
    forged = tamper(live(mallory).sign(mallory), epoch=1_000_000)
    key = f"run/{RUN}/{SPEC.hex()}/peers"
    await store_raw(other_spec, key, mallory.peer_id, forged, dht_time() + 30)
    stolen = live(mallory).sign(mallory)
    await store_raw(other_spec, key, honest.peer_id + "x", stolen, dht_time() + 30)
    records = await boot.find()
    assert [r.peer_id for r in records] == [honest.peer_id]
    assert boot.rejected["RecordError"] >= 1
    assert boot.rejected["subkey mismatch"] >= 1


@pytest.mark.slow
async def test_records_expire_and_a_graceful_leave_is_immediate(start: Starter) -> None:
    a, b = Identity.generate(), Identity.generate()
    node_a = await start(a)
    node_b = await start(b, initial_peers=node_a.visible_maddrs())
    await node_a.announce(live(a, ttl=2.0))
    await node_b.announce(live(b, ttl=60.0))
    await wait_for(node_b, lambda rs: len(rs) == 2)
    await wait_for(node_b, lambda rs: [r.peer_id for r in rs] == [b.peer_id], seconds=10)
    await node_b.leave()
    assert await node_a.find() == []


async def test_unreachable_bootstrap_is_reported_clearly(start: Starter) -> None:
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    with pytest.raises(DiscoveryError, match=r"could not join the DHT .*tcp/9"):
        await start(Identity.generate(), initial_peers=[dead])


async def holders(nodes: list[Any], count: int) -> list[Any]:
    """``count`` peers other than the bootstrap, those holding the swarm's records first
    where the backend shows them (libp2p): freezing those is the worst case for a lookup."""
    if hasattr(nodes[0], "sidecar"):
        key = f"run/{RUN}/{SPEC.hex()}/peers"
        peers = (await nodes[0].sidecar.request("closest", 10, key=key))["peers"]
        by_peer = {n.visible_maddrs()[0].rsplit("/p2p/", 1)[1]: n for n in nodes[1:]}
        first = [by_peer[p] for p in peers if p in by_peer]
    else:
        first = []
    return (first + [n for n in nodes[1:] if n not in first])[:count]


@pytest.mark.slow
async def test_frozen_peers_do_not_slow_lookups_past_a_bound(start: Starter) -> None:
    # py-libp2p alone waits 10-20 s (and connect() 120 s) on a peer that stopped answering.
    ids = [Identity.generate() for _ in range(8)]
    boot = await start(ids[0])
    nodes = [boot] + [await start(i, initial_peers=boot.visible_maddrs()) for i in ids[1:]]
    for node, identity in zip(nodes, ids, strict=True):
        await node.announce(live(identity))
    everyone = sorted(i.peer_id for i in ids)
    await wait_for(nodes[-1], lambda rs: [r.peer_id for r in rs] == everyone, seconds=30)
    victims = await holders(nodes, 2)
    frozen = [pid for node in victims for pid in dht_pids(node)]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        seconds = []
        for node in [n for n in nodes if n not in victims]:
            for _ in range(3):
                started = time.monotonic()
                found = await node.find()
                seconds.append(time.monotonic() - started)
                # Records live on several replicas: the live ones still hold the swarm's.
                assert len(found) >= len(ids) - 2
        assert max(seconds) < 5.0, f"lookups took {sorted(seconds)} s with 2 of 8 frozen"
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)


# -- hivemind backend: its own process ------------------------------------------------------------


async def test_a_dht_started_after_grpc_comes_from_a_clean_process() -> None:
    # A fork taken while gRPC's threads run can hang the child: after a gRPC server exists the
    # DHT comes from multiprocessing's fork server, and still works.
    server, _ = await start_server(lambda server: None)
    started: list[HivemindDiscovery] = []
    try:
        a = await HivemindDiscovery.start(Identity.generate(), run_id=RUN, spec_hash=SPEC)
        started.append(a)
        b = await HivemindDiscovery.start(
            Identity.generate(), run_id=RUN, spec_hash=SPEC, initial_peers=a.visible_maddrs()
        )
        started.append(b)
        for node in (a, b):
            assert node._dht.from_clean_process
            with open(f"/proc/{node._dht.pid}/stat") as stat:  # noqa: ASYNC230 (procfs)
                assert int(stat.read().rsplit(")", 1)[1].split()[1]) != os.getpid()  # parent
        await a.announce(live(a._identity))
        await wait_for(b, lambda rs: len(rs) == 1)
    finally:
        for node in started:
            await node.close()
        await server.stop(None)


async def test_a_dht_that_does_not_start_in_time_is_killed() -> None:
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(DiscoveryError, match=r"did not start in 0\.05 s"):
        await start_dht([], host="127.0.0.1", port=0, start_timeout_seconds=0.05)
    left = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert left == []
