"""A relay against hostile peers, on loopback: whom it serves, how many bytes, and for how long.

Real TCP relays and gRPC servers on 127.0.0.1:0. The relay's admission is the node's own
(:class:`RelayAdmission`) over a table of records the test holds, as a node's directory holds
the run's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable

import pytest

from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.identity import Identity
from swarmgrad.node.reachability.relay import MIB, RelayError, RelayLimits
from swarmgrad.node.reachability.relay_admission import RelayAdmission
from swarmgrad.node.reachability.relay_client import RelayClient
from swarmgrad.node.reachability.relay_server import RelayServer
from swarmgrad.protocol import peer
from swarmgrad.protocol.server import start_server
from tests.helpers import until
from tests.integration.reachability import RUN, SPEC, servicer_of

QUICK = {"ping_seconds": 0.2, "silence_seconds": 1.0, "attach_timeout_seconds": 2.0}
#: What one read of a spliced connection may take beyond a client's budget (it waits it out).
CHUNK = 256 * 1024


def record_of(identity: Identity, *, ttl_seconds: float = 60.0) -> PeerRecord:
    return PeerRecord.create(
        identity.peer_id,
        run_id=RUN,
        spec_hash=SPEC,
        endpoint="10.0.0.7:4000",  # a NAT'd node's first record: its LAN address
        now=dht_time(),
        ttl_seconds=ttl_seconds,
    )


class Table:
    """The run's peer records as a node's directory holds them; ``visible`` is what a DHT read
    finds (a record announced since the last read is there, not yet in ``records``)."""

    def __init__(self, *members: Identity) -> None:
        self.records = [record_of(m) for m in members]
        self.visible = list(self.records)
        self.reads = 0

    async def reread(self) -> list[PeerRecord]:
        self.reads += 1
        self.records = list(self.visible)
        return self.records

    def admission(self, allowed: Callable[[str], bool] | None = None) -> RelayAdmission:
        return RelayAdmission(
            peers=lambda: self.records, reread=self.reread, allowed=allowed, reread_seconds=0.2
        )


@contextlib.asynccontextmanager
async def relay_for(table: Table, **limits: float) -> AsyncIterator[RelayServer]:
    server = RelayServer(
        host="127.0.0.1", admit=table.admission(), limits=RelayLimits(**(QUICK | limits))
    )
    await server.start()
    try:
        yield server
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def relayed_node(relay: RelayServer, me: Identity) -> AsyncIterator[tuple[RelayClient, str]]:
    """A node with the Peer service behind ``relay``: its session and relayed endpoint."""
    servicer = servicer_of(me)
    server, port = await start_server(lambda s: peer.add_to_server(servicer, s))
    client = RelayClient(
        f"127.0.0.1:{relay.port}", me, target=("127.0.0.1", port), limits=relay.limits
    )
    try:
        yield client, await client.connect()
    finally:
        await client.close()
        await server.stop(None)


async def _discard(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while await reader.read(1 << 20):
            pass
    writer.close()


@contextlib.asynccontextmanager
async def flooding(relay: RelayServer, me: Identity) -> AsyncIterator[RelayClient]:
    """``me`` takes a slot and pushes bytes through it as fast as it can, both ends its own."""
    sink = await asyncio.start_server(_discard, "127.0.0.1", 0)
    client = RelayClient(
        f"127.0.0.1:{relay.port}",
        me,
        target=("127.0.0.1", sink.sockets[0].getsockname()[1]),
        limits=relay.limits,
    )
    endpoint = await client.connect()
    payload = os.urandom(1 << 20)

    async def push() -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))
        with contextlib.suppress(ConnectionError):
            for _ in range(100_000):  # 100 GB: far more than any test lets through
                writer.write(payload)
                await writer.drain()
        writer.close()

    pusher = asyncio.create_task(push())
    try:
        yield client
    finally:
        pusher.cancel()
        await asyncio.gather(pusher, return_exceptions=True)
        await client.close()
        sink.close()


async def evicted(client: RelayClient, *, timeout_seconds: float) -> str:
    """Why ``client``'s relay ended its session (within the deadline)."""
    async with asyncio.timeout(timeout_seconds):
        with pytest.raises(RelayError) as ended:
            await client.wait_closed()
    return str(ended.value)


async def test_a_stranger_is_refused_and_told_why_and_pushes_no_byte() -> None:
    honest, stranger = Identity.generate(), Identity.generate()
    table = Table(honest)
    async with relay_for(table) as relay:
        with pytest.raises(RelayError, match="no live record in this run"):
            await RelayClient(
                f"127.0.0.1:{relay.port}", stranger, target=("127.0.0.1", 9)
            ).connect()
        assert relay.counts["refused: no live record in this run"] == 1
        assert relay.clients == 0
        assert sum(relay.traffic.values()) == 0  # no port of its own: nothing to push through
        async with relayed_node(relay, honest) as (_, endpoint):
            info = await peer.get_info(endpoint, run_id=RUN, spec_hash=SPEC, timeout_seconds=5)
            assert info.peer_id == honest.peer_id


async def test_a_private_runs_relay_serves_only_the_allowlist() -> None:
    member, outsider = Identity.generate(), Identity.generate()
    table = Table(member, outsider)  # both announced records: anyone may write the DHT
    relay = RelayServer(
        host="127.0.0.1",
        admit=table.admission(allowed=lambda peer_id: peer_id == member.peer_id),
        limits=RelayLimits(**QUICK),
    )
    await relay.start()
    try:
        with pytest.raises(RelayError, match="not on this run's allowlist"):
            await RelayClient(
                f"127.0.0.1:{relay.port}", outsider, target=("127.0.0.1", 9)
            ).connect()
        assert relay.counts["refused: not on this run's allowlist"] == 1
        async with relayed_node(relay, member):
            assert relay.clients == 1
    finally:
        await relay.close()


async def test_a_natd_node_whose_record_is_newer_than_the_relays_table_is_served() -> None:
    # A NAT'd node announces its record (its LAN address) when it joins, then finds out it needs
    # a relay: the relay's table, read before that, does not have it yet. One more read does.
    newcomer = Identity.generate()
    table = Table()
    table.visible.append(record_of(newcomer))
    async with relay_for(table) as relay, relayed_node(relay, newcomer) as (_, endpoint):
        assert table.reads == 1
        info = await peer.get_info(endpoint, run_id=RUN, spec_hash=SPEC, timeout_seconds=5)
        assert info.peer_id == newcomer.peer_id
    # A record that expired is no record.
    stale = Identity.generate()
    table.visible = [record_of(stale, ttl_seconds=-1.0)]
    async with relay_for(table) as relay:
        with pytest.raises(RelayError, match="no live record"):
            await RelayClient(f"127.0.0.1:{relay.port}", stale, target=("127.0.0.1", 9)).connect()


async def test_eight_stranger_keys_cannot_take_the_slots_from_an_honest_peer() -> None:
    honest = Identity.generate()
    table = Table(honest)
    async with relay_for(table) as relay:
        strangers = [
            RelayClient(f"127.0.0.1:{relay.port}", Identity.generate(), target=("127.0.0.1", 9))
            for _ in range(relay.limits.max_clients)
        ]
        try:
            answers = await asyncio.gather(
                *(s.connect() for s in strangers), return_exceptions=True
            )
        finally:
            for stranger in strangers:
                await stranger.close()
        assert all(isinstance(a, RelayError) and "no live record" in str(a) for a in answers)
        assert relay.counts["refused: no live record in this run"] == 8
        assert table.reads < 8  # their hellos share reads of the table
        async with relayed_node(relay, honest) as (_, endpoint):
            info = await peer.get_info(endpoint, run_id=RUN, spec_hash=SPEC, timeout_seconds=5)
            assert info.peer_id == honest.peer_id


async def test_a_client_far_over_its_rate_is_throttled_evicted_and_the_relay_serves_on() -> None:
    flooder, honest = Identity.generate(), Identity.generate()
    table = Table(flooder, honest)
    rate, burst = 2 * MIB, 2 * MIB
    async with (
        relay_for(
            table, rate_bytes_per_second=rate, burst_bytes=burst, max_throttled_seconds=1.5
        ) as relay,
        relayed_node(relay, honest) as (_, endpoint),
    ):
        started = time.monotonic()
        async with flooding(relay, flooder) as flood:

            async def throttled() -> bool:
                return relay.counts["throttled"] > 0

            await until(throttled, timeout_seconds=10, what="the flood throttled")
            # The relay's loop is not taken by the flood: the honest node behind it answers.
            for _ in range(3):
                info = await peer.get_info(endpoint, run_id=RUN, spec_hash=SPEC, timeout_seconds=5)
                assert info.peer_id == honest.peer_id
            why = await evicted(flood, timeout_seconds=10)
            elapsed = time.monotonic() - started
        assert "evicted: over its byte budget" in why
        assert relay.counts["evicted: over its byte budget for 1.5 s"] == 1
        # Everything the relay carried, the honest calls' few KB included, within the budget.
        carried = sum(relay.traffic.values())
        assert carried <= burst + rate * elapsed + 2 * CHUNK + 64 * 1024, (carried, elapsed)
        assert relay.clients == 1  # the slot is free; the honest node keeps its own
        info = await peer.get_info(endpoint, run_id=RUN, spec_hash=SPEC, timeout_seconds=5)
        assert info.peer_id == honest.peer_id


async def test_a_full_relay_evicts_an_idle_or_over_budget_client_for_a_newcomer() -> None:
    quiet, busy, flooder, late, later = (Identity.generate() for _ in range(5))
    table = Table(quiet, busy, flooder, late, later)
    async with relay_for(
        table,
        max_clients=2,
        idle_under_pressure_seconds=0.3,
        rate_bytes_per_second=MIB,
        burst_bytes=MIB,
    ) as relay:
        held: list[RelayClient] = []

        async def join(who: Identity) -> bool:
            client = RelayClient(
                f"127.0.0.1:{relay.port}", who, target=("127.0.0.1", 9), limits=relay.limits
            )
            try:
                await client.connect()
            except RelayError as error:
                if "this relay is full" not in str(error):
                    raise
                return False
            held.append(client)
            return True

        try:
            async with (
                relayed_node(relay, quiet) as (quiet_session, _),
                relayed_node(relay, busy) as (_, busy_endpoint),
            ):
                # Both slots taken. The busy node's relay carries a call; the quiet one's, none.
                await peer.get_info(busy_endpoint, run_id=RUN, spec_hash=SPEC, timeout_seconds=5)
                await until(lambda: join(late), timeout_seconds=10, what="a slot for a newcomer")
                assert "evicted: idle, for a newcomer" in await evicted(
                    quiet_session, timeout_seconds=5
                )
                assert relay.clients == 2
        finally:
            for client in held:
                await client.close()

        async def empty() -> bool:
            return relay.clients == 0

        await until(empty, timeout_seconds=5, what="the sessions closed")
        # A client over its rate now goes first, however busy the others are.
        async with relayed_node(relay, busy), flooding(relay, flooder) as flood:

            async def throttled() -> bool:
                return relay.counts["throttled"] > 0

            await until(throttled, timeout_seconds=10, what="the flood throttled")
            async with relayed_node(relay, later):
                why = await evicted(flood, timeout_seconds=5)
                assert "evicted: over its byte budget, for a newcomer" in why
                assert relay.clients == 2


async def test_an_idle_client_is_evicted_and_told_why() -> None:
    squatter = Identity.generate()
    table = Table(squatter)
    async with relay_for(table, idle_seconds=0.6, idle_under_pressure_seconds=0.3) as relay:
        async with relayed_node(relay, squatter) as (session, _):
            why = await evicted(session, timeout_seconds=5)
        assert "evicted: idle for 0.6 s" in why
        assert relay.counts["evicted: idle for 0.6 s"] == 1
        assert relay.clients == 0
