"""Groups under avoidance: nodes whose bans differ still cut the same groups, and a record that
avoids peers separates only its author from them (``node/averaging/grouping.py``)."""

from __future__ import annotations

import asyncio
import random
from typing import Any, cast

import pytest

from swarmgrad.node.averaging.grouping import assign_groups
from swarmgrad.node.averaging.matchmaking import Hooks, Matchmaker
from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.discovery.records import (
    MAX_AVOIDS,
    MAX_READY_BYTES,
    PeerRecord,
    ReadyRecord,
    RecordError,
    avoid_tag,
    pack_avoids,
)
from swarmgrad.node.identity import Identity
from tests.unit.test_matchmaking_rules import RUN, SPEC, Board


def tags(*peers: str) -> frozenset[str]:
    return frozenset(avoid_tag(p) for p in peers)


def conflicted(group: list[str], avoids: dict[str, frozenset[str]]) -> bool:
    return any(avoid_tag(q) in avoids.get(p, ()) for p in group for q in group if q != p)


def test_without_avoidances_the_groups_are_the_shuffle_cut_in_runs() -> None:
    peers = [f"p{i}" for i in range(11)]
    plain = assign_groups(3, peers, 4)
    assert assign_groups(3, peers, 4, {}) == plain
    assert assign_groups(3, peers, 4, {p: frozenset() for p in peers}) == plain
    assert [len(g) for g in plain] == [4, 7]  # the short last run joins the one before


def test_a_peer_is_never_grouped_with_one_it_avoids_or_that_avoids_it() -> None:
    peers = [f"p{i}" for i in range(8)]
    for round_ in range(20):
        avoids = {"p0": tags("p5")}  # p0 banned p5; nobody else did
        groups = assign_groups(round_, peers, 8, avoids)
        assert not any(conflicted(g, avoids) for g in groups)
        # The one avoided goes, not the one that avoids: p0 stays with the other six.
        assert ["p0", "p1", "p2", "p3", "p4", "p6", "p7"] in groups
        assert all("p5" not in g for g in groups)  # alone: it sits this round out
        # Whatever order the records were read in, the same groups.
        shuffled = random.Random(round_).sample(peers, len(peers))
        assert assign_groups(round_, shuffled, 8, avoids) == groups


def test_two_avoided_peers_are_grouped_together_apart_from_their_banners() -> None:
    peers = [f"p{i}" for i in range(8)]
    avoids = {"p0": tags("p6", "p7"), "p1": tags("p6")}
    groups = assign_groups(4, peers, 8, avoids)
    assert sorted(groups) == [["p0", "p1", "p2", "p3", "p4", "p5"], ["p6", "p7"]]


def test_an_avoidance_separates_only_its_author() -> None:
    """A keyed member that names every honest peer as avoided (or names peers at random)
    cannot split the honest peers: it only keeps itself away from them."""
    honest = [f"h{i}" for i in range(7)]
    spiteful = "x"
    avoids = {spiteful: tags(*honest)}
    for round_ in range(20):
        groups = assign_groups(round_, [*honest, spiteful], 8, avoids)
        assert groups == [honest]
    rng = random.Random(3)
    for round_ in range(50):
        peers = [f"q{i}" for i in range(rng.randint(2, 40))]
        liars = rng.sample(peers, k=min(3, len(peers)))
        avoids = {liar: tags(*rng.sample(peers, k=min(16, len(peers)))) for liar in liars}
        groups = assign_groups(round_, peers, 4, avoids)
        assert not any(conflicted(g, avoids) for g in groups)
        placed = [p for g in groups for p in g]
        assert len(placed) == len(set(placed))
        assert all(len(g) >= 2 for g in groups)
        # Everyone that nobody avoids and that avoids nobody has a group.
        free = {
            p
            for p in peers
            if p not in liars and not any(avoid_tag(p) in a for a in avoids.values())
        }
        assert free <= set(placed) or len(peers) < 2


def test_a_lone_peer_joins_a_group_it_may_rather_than_sit_out() -> None:
    peers = [f"p{i}" for i in range(9)]  # groups of 4: 4 + 5 without avoidances
    avoids = {"p0": tags("p1", "p2", "p3")}
    groups = assign_groups(2, peers, 4, avoids)
    assert sorted(p for g in groups for p in g) == peers  # nobody left out
    assert not any(conflicted(g, avoids) for g in groups)


def test_the_avoids_field_is_checked_like_the_rest_of_a_readiness_record() -> None:
    now = dht_time()
    longest = "h" * 63 + "." + "o" * 63 + "." + "s" * 63 + "." + "t" * 57 + ":65535"
    record = ReadyRecord(
        peer_id=Identity.from_seed("g").peer_id, run_id="r" * 64, spec_hash=SPEC.hex(),
        endpoint=longest, round=2**40, bandwidth=1e300, weight=1e300, issued_at=now,
        expires_at=now + 60, avoids=pack_avoids(f"peer-{i}" for i in range(3 * MAX_AVOIDS)),
    )  # fmt: skip
    assert len(record.avoided()) == MAX_AVOIDS  # the newest bans only
    assert len(record.body()) <= MAX_READY_BYTES
    assert ReadyRecord.parse(record.body()) == record
    for bad in ("x" * 12, "ABCDEF012345", "0" * 11, ",".join(["0" * 12] * (MAX_AVOIDS + 1)),
                "0" * 12 + ",", "0" * 12 + ", " + "1" * 12):  # fmt: skip
        raw = record.body().replace(record.avoids.encode(), bad.encode())
        with pytest.raises(RecordError, match="avoids"):
            ReadyRecord.parse(raw)


async def test_nodes_whose_bans_differ_still_cut_the_same_groups() -> None:
    """The adversary suite's noise run in groups of 8: two of eight nodes have banned the two
    attackers, four have not (yet). With each node leaving its banned peers out of what it cut,
    the two would have grouped without them and the four with them: different groups, and a
    partial round for all six. Named as avoided, they are cut alike by all."""
    ids = [Identity.from_seed(f"grouping/{i}") for i in range(8)]
    names = [i.peer_id for i in ids]
    attackers = set(names[6:])
    banners = set(names[:2])
    peers = [
        PeerRecord.create(n, run_id=RUN, spec_hash=SPEC, endpoint=f"{n[:8]}:1", now=dht_time(),
                          ttl_seconds=60, epoch=5)
        for n in names
    ]  # fmt: skip

    async def read() -> list[PeerRecord]:
        return peers

    board = Board()

    def maker(identity: Identity) -> Matchmaker:
        bans = sorted(attackers) if identity.peer_id in banners else []
        return Matchmaker(
            cast(Any, board), identity, group_size=8, matchmaking_timeout_seconds=10.0,
            settle_seconds=0.2,
            hooks=Hooks(peers=read, excluded=lambda p: p in bans, avoiding=lambda: bans),
        )  # fmt: skip

    groups = await asyncio.gather(
        *(maker(i).form_group(5, endpoint=f"{i.peer_id[:8]}:1") for i in ids)
    )
    cut = {
        n: tuple(m.peer_id for m in g.members) if g else None
        for n, g in zip(names, groups, strict=True)
    }
    honest = [n for n in names if n not in attackers]
    # Every member of a group has that same group.
    for members in cut.values():
        assert members is None or all(cut[m] == members for m in members), cut
    # The banners are never with an attacker; the honest stay together.
    assert cut[honest[0]] == tuple(sorted(honest))
    assert cut[names[6]] == tuple(sorted(attackers))
