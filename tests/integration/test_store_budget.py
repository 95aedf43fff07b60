"""A stranger storing a flood of fresh values from throwaway keys into a real hivemind DHT node
(its own process, as a node runs it) is held to its budget of signature checks; another
peer's stores still go in (issue 42, finding 4: one client re-signing readiness records under
the coming round keys took ~40% of a core of each honest DHT process). The libp2p sidecar's
directory meets the same budget: ``tests/unit/test_check_budget.py``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.discovery.check_budget import CHECKS_BURST, CHECKS_PER_SECOND
from swarmgrad.node.discovery.envelope import Kind, seal
from swarmgrad.node.discovery.hivemind_dht import start_dht
from swarmgrad.node.discovery.records import ReadyRecord
from swarmgrad.node.identity import Identity

RUN, SPEC = "run-checks", "0d" * 32
FLOOD = CHECKS_BURST + 400


def readiness(signer: Identity, round_: int) -> tuple[str, str, bytes, float]:
    """``signer``'s sealed readiness for ``round_``: key, subkey, value, expiry."""
    now = dht_time()
    record = ReadyRecord(
        peer_id=signer.peer_id, run_id=RUN, spec_hash=SPEC, endpoint="127.0.0.1:9",
        round=round_, bandwidth=1.0, weight=1.0, issued_at=now, expires_at=now + 120,
    )  # fmt: skip
    key = f"run/{RUN}/{SPEC}/round/{round_}"
    value = seal(signer, key=key, kind=Kind.READY, body=record.body(), issued_at=now,
                 expires_at=record.expires_at)  # fmt: skip
    return key, signer.peer_id, value, record.expires_at


async def store(client: Any, values: list[tuple[str, str, bytes, float]]) -> int:
    """Store ``values`` through ``client`` (a plain hivemind DHT client); how many were taken."""
    async with asyncio.timeout(60):
        answers = await client.store_many(
            keys=[key for key, *_ in values],
            values=[value for _, _, value, _ in values],
            expiration_time=[expires for *_, expires in values],
            subkeys=[subkey for _, subkey, *_ in values],
            exclude_self=True,
        )
    return sum(bool(answers.get((key, subkey))) for key, subkey, *_ in values)


@pytest.fixture
async def dht() -> AsyncIterator[Any]:
    node = await start_dht([], host="127.0.0.1", port=0, start_timeout_seconds=60)
    try:
        yield node
    finally:
        await asyncio.to_thread(node.shutdown)


@pytest.mark.timeout(180)
async def test_a_stranger_flooding_a_dht_node_is_held_to_its_checks(dht: Any) -> None:
    from hivemind.dht.node import DHTNode

    maddrs = [str(a) for a in dht.get_visible_maddrs()]
    stranger = await DHTNode.create(initial_peers=maddrs, client_mode=True, wait_timeout=15)
    honest = await DHTNode.create(initial_peers=maddrs, client_mode=True, wait_timeout=15)
    try:
        # Fresh keys, each its own record, spread over rounds (no key's byte budget binds).
        flood = [readiness(Identity.generate(), 10 + i % 8) for i in range(FLOOD)]
        began = time.monotonic()
        taken = await store(stranger, flood)
        seconds = time.monotonic() - began
        # Its burst and its rate for the time the store took, give or take a batch in flight.
        assert taken <= CHECKS_BURST + CHECKS_PER_SECOND * (seconds + 1.0), (taken, seconds)
        assert taken >= CHECKS_BURST // 2, taken  # the budget is not a wall for a fair peer
        # Another peer's records go in at once, while the stranger's budget is spent.
        mine = [readiness(Identity.generate(), 10) for _ in range(8)]
        assert await store(honest, mine) == len(mine)
        # What the node took is there and whole, and it answers as before.
        found = await honest.get(mine[0][0], latest=True)
        assert found is not None
        assert {subkey for _, subkey, *_ in mine} <= set(found.value)
    finally:
        await stranger.shutdown()
        await honest.shutdown()
    assert dht.is_alive()
