"""Matchmaking: deterministic groups (unit), and real DHT peers agreeing on them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from swarmgrad.node.averaging.grouping import assign_groups
from swarmgrad.node.averaging.matchmaking import Matchmaker
from swarmgrad.node.discovery.hivemind_dht import HivemindDiscovery
from swarmgrad.node.identity import Identity
from tests.integration.dht_nodes import hivemind_nodes

RUN, SPEC = "mm", b"\x05" * 32


def test_groups_are_deterministic_disjoint_and_reshuffled_each_round() -> None:
    peers = [f"p{i}" for i in range(10)]
    groups = assign_groups(3, peers, 4)
    assert groups == assign_groups(3, list(reversed(peers)), 4)  # order of discovery is moot
    assert sorted(p for g in groups for p in g) == sorted(peers)
    assert [len(g) for g in groups] == [4, 6]  # the short tail joins the last full group
    assert assign_groups(4, peers, 4) != groups
    assert assign_groups(0, ["only"], 2) == []
    with pytest.raises(ValueError, match="at least 2"):
        assign_groups(0, peers, 1)


@pytest.fixture
async def swarm() -> AsyncIterator[list[tuple[Identity, HivemindDiscovery]]]:
    async with hivemind_nodes(5, run_id=RUN, spec_hash=SPEC) as nodes:
        yield nodes


@pytest.mark.slow
async def test_peers_ready_together_form_the_same_groups(
    swarm: list[tuple[Identity, HivemindDiscovery]],
) -> None:
    four = swarm[:4]
    makers = [
        Matchmaker(node, identity, group_size=2, matchmaking_timeout_seconds=10)
        for identity, node in four
    ]
    groups = await asyncio.gather(
        *(
            m.form_group(7, endpoint=f"127.0.0.1:{7000 + i}", weight=float(i + 1))
            for i, m in enumerate(makers)
        )
    )
    assert all(g is not None for g in groups)
    by_peer = {identity.peer_id: g for (identity, _), g in zip(four, groups, strict=True)}
    for peer_id, group in by_peer.items():
        assert group is not None
        assert len(group.members) == 2
        assert peer_id in [m.peer_id for m in group.members]
        for member in group.members:  # my mates computed the very same group (same id)
            assert by_peer[member.peer_id] == group
    assert len({g.group_id for g in groups if g is not None}) == 2
    weights = {m.peer_id: m.weight for g in groups if g is not None for m in g.members}
    assert sorted(weights.values()) == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.slow
async def test_a_peer_alone_gives_up_in_time_and_trains_on(
    swarm: list[tuple[Identity, HivemindDiscovery]],
) -> None:
    identity, node = swarm[4]
    maker = Matchmaker(node, identity, group_size=2, matchmaking_timeout_seconds=1.0)
    started = time.monotonic()
    assert await maker.form_group(99, endpoint="127.0.0.1:1") is None
    assert time.monotonic() - started < 1.0 + maker.settle_seconds + 5
