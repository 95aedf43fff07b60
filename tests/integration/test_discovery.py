"""Discovery: the contract every backend meets (real DHT nodes on 127.0.0.1): peers find each
other through a bootstrap node, another spec sees nothing and forgeries are refused, records
expire and a graceful leave is immediate, a bootstrap that cannot be joined is named as a cause,
lookups stay bounded with peers frozen; and the hivemind backend's DHT in its own process."""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from swarmgrad.node.discovery.base import (
    BACKENDS,
    Discovery,
    DiscoveryError,
    dht_time,
)
from swarmgrad.node.discovery.envelope import Kind, seal
from swarmgrad.node.discovery.hivemind_dht import HivemindDiscovery, start_dht
from swarmgrad.node.discovery.records import MAX_SPEC_BYTES, PeerRecord
from swarmgrad.node.discovery.start import DiscoveryConfig, start_discovery
from swarmgrad.node.identity import Identity
from swarmgrad.protocol.server import start_server
from tests.helpers import libp2p_peer_id, until
from tests.integration.sealed_records import KEY, RUN, SPEC, ready_record, record, sealed

# -- the backend contract (real DHT nodes on 127.0.0.1), for each backend ----------------------

Starter = Callable[..., Awaitable[Any]]


@pytest.fixture(params=BACKENDS)
async def start(request: pytest.FixtureRequest) -> AsyncIterator[Starter]:
    started: list[Discovery] = []

    async def starter(identity: Identity, **kwargs: Any) -> Any:
        run_id, spec_hash = kwargs.pop("run_id", RUN), kwargs.pop("spec_hash", SPEC)
        config = DiscoveryConfig(backend=request.param, **kwargs)
        node = await start_discovery(config, identity, run_id=run_id, spec_hash=spec_hash)
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
    async def found() -> list[PeerRecord] | None:
        records = await node.find()
        return records if predicate(records) else None

    return await until(
        found, timeout_seconds=seconds, what="the records looked for", interval_seconds=0.1
    )


def live(identity: Identity, ttl: float = 60.0, **changes: object) -> PeerRecord:
    return record(identity, ttl=ttl, now=dht_time(), **changes)


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
async def test_another_spec_sees_nothing_and_the_dht_refuses_forgeries(start: Starter) -> None:
    honest, mallory = Identity.generate(), Identity.generate()
    boot = await start(honest)
    await boot.announce(live(honest))
    other_spec = await start(
        Identity.generate(), spec_hash=b"\x09" * 32, initial_peers=boot.visible_maddrs()
    )
    assert await other_spec.find() == []
    # Specs are listed above the hash, each announcer in its own slot: both specs in use are
    # seen, and announcing the same spec again (as every node does) is no conflict.
    ours, theirs = b'{"spec":"a"}', b'{"spec":"b"}'
    for _ in range(2):
        await boot.announce_spec(ours, expires_at=dht_time() + 30)
        await other_spec.announce_spec(theirs, expires_at=dht_time() + 30)
    specs = await boot.find_specs()
    assert specs == {hashlib.sha256(s).hexdigest(): s for s in (ours, theirs)}
    # What a writer without the right key tries, straight into the DHT: every node refuses it.
    now = dht_time()
    mine = live(mallory)
    genuine = sealed(honest, live(honest), key=KEY)
    forgeries = [
        (honest.peer_id, genuine[:-64] + bytes(64), now + 30),  # an altered copy
        (honest.peer_id, genuine, now + 100),  # the genuine value, to live longer
        (honest.peer_id, b"", now + 30),  # an unsigned leave
        (honest.peer_id, sealed(mallory, mine, key=KEY), mine.expires_at),  # another's slot
        (mallory.peer_id, sealed(mallory, live(mallory, ttl=3000.0), key=KEY), now + 3000),
    ]
    for subkey, value, expires in forgeries:
        assert not await other_spec._store(KEY, subkey, value, expires)
    assert not await other_spec._store(f"run/{RUN}/specs", honest.peer_id, theirs, now + 30)
    assert [r.peer_id for r in await boot.find()] == [honest.peer_id]
    assert await boot.find_specs() == specs


@pytest.mark.slow
async def test_ban_records_live_under_their_run_in_each_publishers_slot(start: Starter) -> None:
    a, b = Identity.generate(), Identity.generate()
    node_a = await start(a)
    node_b = await start(b, initial_peers=node_a.visible_maddrs())
    other_spec = await start(
        Identity.generate(), spec_hash=b"\x09" * 32, initial_peers=node_a.visible_maddrs()
    )
    await node_a.publish_bans(b"evidence", expires_at=dht_time() + 30)

    async def found() -> list[tuple[str, bytes]] | None:
        records = [(e.signer, e.body) for e in await node_b.find_bans()]
        return records or None

    records = await until(found, timeout_seconds=15, what="ban records", interval_seconds=0.1)
    assert records == [(a.peer_id, b"evidence")]
    assert await other_spec.find_bans() == []
    # Ban records belong under .../bans only, and within the size limit.
    now = dht_time()
    misfiled = seal(a, key=KEY, kind=Kind.BANS, body=b"evidence", issued_at=now,
                    expires_at=now + 30)  # fmt: skip
    assert not await node_b._store(KEY, a.peer_id, misfiled, now + 30)
    with pytest.raises(ValueError, match="too large"):
        await node_a.publish_bans(bytes(MAX_SPEC_BYTES + 1), expires_at=now + 30)


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


@pytest.mark.slow
async def test_a_round_withdrawn_can_be_announced_again(start: Starter) -> None:
    """A second attempt at the same round (sync DP retries its step) announces readiness under
    the key it withdrew from: the withdrawal must not outlive that new record. (It once did,
    sized by the longer-lived peer record: the retry was refused by every DHT node.)"""
    a, b = Identity.generate(), Identity.generate()
    node_a = await start(a)
    node_b = await start(b, initial_peers=node_a.visible_maddrs())
    await node_a.announce(live(a, ttl=60.0))
    await node_a.announce_ready(ready_record(a, 11, ttl=20.0, now=dht_time()))
    await node_a.leave("round/11")
    assert await node_b.find_ready(11) == []
    await asyncio.sleep(1.1)  # past the withdrawal's margin over the first record
    await node_a.announce_ready(ready_record(a, 11, ttl=20.0, now=dht_time()))
    assert [r.peer_id for r in await node_b.find_ready(11)] == [a.peer_id]
    assert [r.peer_id for r in await node_b.find()] == [a.peer_id]


async def test_unreachable_bootstrap_is_reported_clearly(
    start: Starter, request: pytest.FixtureRequest
) -> None:
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    tries = r" \(3 tries\)" if "hivemind" in request.node.name else ""
    with pytest.raises(
        DiscoveryError, match=rf"could not join the DHT \(bootstrap: .*tcp/9.*\){tries}:"
    ) as failed:
        await start(Identity.generate(), initial_peers=[dead])
    assert "nobody listens at 127.0.0.1:9 (is the bootstrap node up?" in str(failed.value)


async def test_a_bootstrap_whose_peer_id_changed_is_named_as_a_cause(start: Starter) -> None:
    # A volunteer holding a multiaddr from before the bootstrap restarted with a new key: the
    # address answers, under another peer id.
    live = await start(Identity.generate())
    maddr = next(m for m in live.visible_maddrs() if "/127.0.0.1/" in m)
    other = libp2p_peer_id(Identity.generate().public_key)
    stale = maddr.rsplit("/p2p/", 1)[0] + "/p2p/" + other
    with pytest.raises(DiscoveryError) as failed:
        await start(Identity.generate(), initial_peers=[stale])
    assert "accepts connections, yet joining through it failed" in str(failed.value)
    assert "restarted without --identity" in str(failed.value)


async def test_a_join_that_fails_once_is_tried_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # What a loaded machine saw: the daemon gave up on its first connect to a busy bootstrap.
    from swarmgrad.node.discovery import hivemind_dht

    real, calls = hivemind_dht._start_dht_once, []

    async def first_fails(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["timeout_seconds"])
        if len(calls) == 1:
            error = RuntimeError("Daemon failed to start: failed to connect to bootstrap peers")
            raise hivemind_dht._JoinFailed(error)
        return await real(*args, **kwargs)

    a_id, b_id = Identity.generate(), Identity.generate()
    a = await HivemindDiscovery.start(a_id, DiscoveryConfig(), run_id=RUN, spec_hash=SPEC)
    try:
        monkeypatch.setattr(hivemind_dht, "_start_dht_once", first_fails)
        config = DiscoveryConfig(initial_peers=tuple(a.visible_maddrs()))
        b = await HivemindDiscovery.start(b_id, config, run_id=RUN, spec_hash=SPEC)
        try:
            assert len(calls) == 2
            assert calls[1] < calls[0] <= config.start_timeout_seconds  # one deadline for both
            assert "failed to connect to bootstrap peers); trying again" in caplog.text
            await b.announce(live(b_id))  # b joined a's DHT: what it announces, a finds
            await wait_for(a, lambda records: len(records) == 1)
        finally:
            await b.close()
    finally:
        await a.close()


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
        seconds, short = [], []
        for node in [n for n in nodes if n not in victims]:
            for _ in range(3):
                # Records live on several replicas: the live ones still hold the swarm's. On a
                # loaded machine a live replica may miss a query's deadline (it is then skipped
                # for a while) and one lookup come back short; the node's next one finds them.
                deadline = time.monotonic() + 30
                while True:
                    started = time.monotonic()
                    found = await node.find()
                    seconds.append(time.monotonic() - started)
                    if len(found) >= len(ids) - 2:
                        break
                    short.append(len(found))
                    assert time.monotonic() < deadline, f"lookups found only {short} records"
        assert max(seconds) < 5.0, f"lookups took {sorted(seconds)} s with 2 of 8 frozen"
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)


# -- hivemind backend: its own process ------------------------------------------------------------


def test_a_dht_killed_mid_reply_does_not_hang_the_next_one() -> None:
    # hivemind's DHT processes from one parent shared a lock around their replies: one killed
    # holding it left every later DHT from that fork server unable to say it was ready.
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("dht_dies_replying.py"))],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["victim_exitcode"] == -signal.SIGKILL
    assert result["from_clean_process"]  # from the fork server the victim came from
    assert result["stored"] is False  # it answered (refusing a value that is not sealed)


async def test_a_dht_started_after_grpc_comes_from_a_clean_process() -> None:
    # A fork taken while gRPC's threads run can hang the child: after a gRPC server exists the
    # DHT comes from multiprocessing's fork server, and still works.
    server, _ = await start_server(lambda server: None)
    started: list[HivemindDiscovery] = []
    try:
        a = await HivemindDiscovery.start(
            Identity.generate(), DiscoveryConfig(), run_id=RUN, spec_hash=SPEC
        )
        started.append(a)
        config = DiscoveryConfig(initial_peers=tuple(a.visible_maddrs()))
        b = await HivemindDiscovery.start(Identity.generate(), config, run_id=RUN, spec_hash=SPEC)
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
