"""The rules that cut a round's candidates into groups, alike on every peer that saw them.

A round's candidates are ordered by a hash of (round, peer id), a fresh shuffle each round that
every peer computes alike (:func:`group_order`); a large swarm is first split into buckets by
the same hash (:func:`bucket_count`, :func:`bucket_of`), and each bucket is cut into groups of
``group_size`` (:func:`assign_groups`).

**Avoidance.** A node that has banned a peer will not average with it, but its ban is its own:
another honest node may not have banned that peer yet, or ever (statistical flags are local).
If each left its banned peers out of the candidates it cut, peers that saw the same records
would cut different groups, and every round in which two honest nodes disagreed about a ban
would be partial for both (the adversary suite's noise run in groups of 8: 27 of 41 honest
rounds). So a node names the peers it avoids in its readiness record (``avoids``: short tags of
its newest bans), and everyone cuts the groups with every record's avoidances as constraints:
two peers of which one avoids the other are never put in one group. The constraints are
symmetric and every peer reads the same records, so every peer still cuts the same groups. An
avoidance only ever separates its own author from someone: a peer that avoids everyone has
isolated itself, and no record can split two peers that do not avoid each other.

Peers are placed in the shuffle's order, least avoided first, each in the first group that has
room and holds nobody it conflicts with (without avoidances: the shuffle cut into consecutive
runs, as before); a short last group joins the one before it, and a peer left alone joins the
first group it may. A peer that many avoid is placed last, where it meets the fewest of them.
"""

from __future__ import annotations

import functools
import hashlib
from collections import Counter
from collections.abc import Collection, Mapping

from swarmgrad.node.discovery.records import avoid_tag

__all__ = ["assign_groups", "bucket_count", "bucket_of", "group_order", "waves"]


@functools.lru_cache(maxsize=1 << 16)  # the census re-hashes every peer each second
def group_order(round_: int, peer_id: str) -> bytes:
    """Where ``peer_id`` falls in round ``round_``'s shuffle of the candidates."""
    return hashlib.blake2b(f"{round_}:{peer_id}".encode(), digest_size=16).digest()


def bucket_count(round_: int, peers: Collection[str], group_size: int) -> int:
    """Buckets round ``round_``'s ``peers`` are split into: the largest power of two that leaves
    each at least two groups' worth of them on average (1 under four groups), halved while a
    bucket would hold fewer than two (a peer alone in its bucket would wait for nobody). Every
    peer with the same census computes the same count; a power of two, so that peers whose
    censuses differ by a few mostly agree, and when they do not, one's buckets split the
    other's in two."""
    buckets = 1
    while len(peers) >= 4 * buckets * group_size:
        buckets *= 2
    while buckets > 1:
        sizes = Counter(bucket_of(round_, p, buckets) for p in peers)
        if len(sizes) == buckets and min(sizes.values()) >= 2:
            break
        buckets //= 2
    return buckets


def bucket_of(round_: int, peer_id: str, buckets: int) -> int:
    """Which of ``buckets`` buckets ``peer_id`` is in for ``round_``."""
    return int.from_bytes(group_order(round_, peer_id)[-8:], "big") % buckets


def waves(issued: Mapping[str, float], window_seconds: float) -> list[list[str]]:
    """A round's candidates in waves by when each issued its readiness record (``issued``:
    peer id -> its signed ``issued_at``): the first wave opens at the earliest and holds every
    candidate issued within ``window_seconds`` of it, the next opens at the earliest of the
    rest, and so on. Groups are cut within a wave, never across.

    Peers that wait for each other up to a timeout and then cut what they saw disagree about a
    straggler that comes after the first peers gave up but before the last ones cut: the
    first cut it out, the last in, and their rounds fail (an 8-node swarm under a readiness
    flood, where training slowed unevenly: 3 of 21 rounds in two runs). Waves put it where
    every peer that reads its record puts it, by the time it signed: in a wave of its own, or
    with the other latecomers, who average among themselves."""
    if window_seconds <= 0:
        raise ValueError("a wave's window must be positive")
    found: list[list[str]] = []
    opened = 0.0
    for peer in sorted(issued, key=lambda p: (issued[p], p)):
        if not found or issued[peer] > opened + window_seconds:
            found.append([])
            opened = issued[peer]
        found[-1].append(peer)
    return found


def assign_groups(
    round_: int,
    peer_ids: Collection[str],
    group_size: int,
    avoids: Mapping[str, Collection[str]] | None = None,
) -> list[list[str]]:
    """Deterministic groups of ``group_size`` (a last one may be up to 2x - 1 larger), none
    holding two peers of which one avoids the other. ``avoids`` maps a candidate to the tags
    (:func:`avoid_tag`) of the peers its record says it avoids. Peers that fit in no group of
    two or more are left out."""
    if group_size < 2:
        raise ValueError("group_size must be at least 2")
    ids = set(peer_ids)
    conflicts, avoided = _conflicts(ids, avoids or {})
    order = sorted(ids, key=lambda p: (avoided[p], group_order(round_, p)))
    groups: list[list[str]] = []
    for peer in order:
        for group in groups:
            if len(group) < group_size and conflicts[peer].isdisjoint(group):
                group.append(peer)
                break
        else:
            groups.append([peer])
    if len(groups) > 1 and len(groups[-1]) < group_size and _fit(groups[-1], groups[-2], conflicts):
        groups[-2].extend(groups.pop())
    for alone in [g for g in groups if len(g) == 1]:
        home = next((g for g in groups if len(g) > 1 and _fit(alone, g, conflicts)), None)
        if home is not None:
            home.extend(alone)
            groups.remove(alone)
    return [sorted(g) for g in groups if len(g) >= 2]


def _conflicts(
    ids: set[str], avoids: Mapping[str, Collection[str]]
) -> tuple[dict[str, set[str]], Counter[str]]:
    """Each candidate's conflicts (the candidates it avoids and those that avoid it), and how
    many candidates avoid each."""
    conflicts: dict[str, set[str]] = {p: set() for p in ids}
    avoided: Counter[str] = Counter()
    if not any(avoids.get(p) for p in ids):
        return conflicts, avoided
    by_tag: dict[str, list[str]] = {}
    for p in ids:
        by_tag.setdefault(avoid_tag(p), []).append(p)
    for p in ids:
        for tag in set(avoids.get(p, ())):
            for q in by_tag.get(tag, ()):
                if q != p:
                    conflicts[p].add(q)
                    conflicts[q].add(p)
                    avoided[q] += 1
    return conflicts, avoided


def _fit(these: list[str], group: list[str], conflicts: Mapping[str, set[str]]) -> bool:
    return all(conflicts[p].isdisjoint(group) for p in these)
