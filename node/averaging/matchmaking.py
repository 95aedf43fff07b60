"""Matchmaking without a leader: peers ready for round r form groups through the DHT.

Each peer announces a signed readiness record under ``round/<r>`` (its endpoint, bandwidth and
weight), then reads the topic until it sees ``group_size`` peers, or every peer whose peer record
says it is at epoch r or r - 1 (a swarm smaller than a group, or one that lost a member a round
ago, need not wait out the timeout), or its matchmaking timeout passes; then it waits
``settle_seconds`` for stragglers' records to spread, and reads once more. The candidates are
then ordered by a hash of (round, peer id), a fresh shuffle each round that every peer computes
alike, and cut into groups of ``group_size`` (a short last group joins the one before it). Peers
that saw the same candidates form the same groups; a peer that saw a different set (a record that
arrived between two peers' reads) ends up in a group whose id its mates do not share, its
all-reduce streams are refused as UNKNOWN_ROUND, and the round counts as failed for it: nothing
hangs and nothing mixes. A peer that finds nobody returns None and trains on.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable

from swarmgrad.node.averaging.group import Group, Member
from swarmgrad.node.discovery.base import Discovery, dht_time
from swarmgrad.node.discovery.envelope import MAX_TTL_SECONDS
from swarmgrad.node.discovery.records import PeerRecord, ReadyRecord
from swarmgrad.node.identity import Identity

log = logging.getLogger(__name__)

#: A readiness record outlives its matchmaking by this much (stragglers still read it).
READY_MARGIN_SECONDS = 30.0
#: The longest matchmaking whose readiness record (and its withdrawal) a DHT still takes.
MAX_MATCHMAKING_TIMEOUT_SECONDS = MAX_TTL_SECONDS - READY_MARGIN_SECONDS - 30.0
#: How often matchmaking reads the candidates, and the run's peer records, while it waits.
POLL_SECONDS = 0.1
EXPECTED_REFRESH_SECONDS = 1.0


def group_order(round_: int, peer_id: str) -> bytes:
    """Where ``peer_id`` falls in round ``round_``'s shuffle of the candidates."""
    return hashlib.blake2b(f"{round_}:{peer_id}".encode(), digest_size=16).digest()


def assign_groups(round_: int, peer_ids: list[str], group_size: int) -> list[list[str]]:
    """Deterministic groups of ``group_size`` (the last one may be up to 2x - 1 larger): the
    candidates in :func:`group_order`, cut into consecutive runs."""
    if group_size < 2:
        raise ValueError("group_size must be at least 2")
    shuffled = sorted(set(peer_ids), key=lambda peer_id: group_order(round_, peer_id))
    groups = [shuffled[i : i + group_size] for i in range(0, len(shuffled), group_size)]
    if len(groups) > 1 and len(groups[-1]) < group_size:
        groups[-2].extend(groups.pop())
    return [sorted(g) for g in groups if len(g) >= 2]


class Matchmaker:
    def __init__(
        self,
        discovery: Discovery,
        identity: Identity,
        *,
        group_size: int,
        matchmaking_timeout_seconds: float,
        settle_seconds: float = 0.5,
        peers: Callable[[], Awaitable[list[PeerRecord]]] | None = None,
        excluded: Callable[[str], bool] | None = None,
    ) -> None:
        """``peers`` reads the run's peer records (the node's directory; default: the DHT);
        ``excluded`` says which peers this node no longer groups with (its trust ledger's bans):
        their readiness records are not candidates and they are not waited for."""
        if group_size < 2:
            raise ValueError("group_size must be at least 2")
        if not 0 < matchmaking_timeout_seconds <= MAX_MATCHMAKING_TIMEOUT_SECONDS:
            raise ValueError(
                f"matchmaking_timeout_seconds must be in (0, {MAX_MATCHMAKING_TIMEOUT_SECONDS:g}]"
            )
        self._discovery, self._identity = discovery, identity
        self._peers = peers or discovery.find
        self.group_size = group_size
        self.timeout_seconds = matchmaking_timeout_seconds
        self.settle_seconds = settle_seconds
        self._excluded = excluded or (lambda _peer: False)

    async def form_group(
        self, round_: int, *, endpoint: str, bandwidth: float = 1.0, weight: float = 1.0
    ) -> Group | None:
        """This peer's group for ``round_``, or None if it found nobody in time."""
        now = dht_time()
        ready = ReadyRecord(
            peer_id=self._identity.peer_id,
            run_id=self._discovery.run_id,
            spec_hash=self._discovery.spec_hash.hex(),
            endpoint=endpoint,
            round=round_,
            bandwidth=bandwidth,
            weight=weight,
            issued_at=now,
            expires_at=now + self.timeout_seconds + READY_MARGIN_SECONDS,
        )
        await self._discovery.announce_ready(ready)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_seconds
        me = self._identity.peer_id
        candidates = await self._candidates(round_)
        expected, ahead = await self._census(round_)
        checked = loop.time()
        while len(candidates) < self.group_size and loop.time() < deadline:
            seen = {r.peer_id for r in candidates}
            if len(seen) >= 2 and expected <= seen:
                break
            if ahead and expected == {me} and seen <= {me}:
                # Everyone else has moved past this round (this node lost one): nobody will
                # come, and the sooner it says so the sooner it catches up by state sync
                # (while they wait for it, one round behind, as "expected").
                log.info("round %d: the other peers are past this round", round_)
                break
            await asyncio.sleep(POLL_SECONDS)
            candidates = await self._candidates(round_)
            if loop.time() - checked > EXPECTED_REFRESH_SECONDS:
                (expected, ahead), checked = await self._census(round_), loop.time()
        await asyncio.sleep(self.settle_seconds)
        candidates = await self._candidates(round_)
        by_id = {r.peer_id: r for r in candidates}
        for members in assign_groups(round_, list(by_id), self.group_size):
            if self._identity.peer_id in members:
                if not any(by_id[p].bandwidth > 0 for p in members):
                    log.info("round %d: no member of the group can be dialed", round_)
                    return None
                return Group(
                    round=round_,
                    members=tuple(
                        Member(
                            peer_id=p,
                            endpoint=by_id[p].endpoint,
                            bandwidth=by_id[p].bandwidth,
                            weight=by_id[p].weight,
                        )
                        for p in members
                    ),
                )
        log.info("round %d: no group (%d candidates)", round_, len(candidates))
        return None

    async def _census(self, round_: int) -> tuple[set[str], bool]:
        """Peers who should be ready for ``round_``, and whether any other peer is past it.

        Expected are those whose records say they are at it, or one behind (a peer that just
        finished the last round may not have announced it yet; a peer that died in it is waited
        for once, then its record falls two behind)."""
        peers = [p for p in await self._peers() if not self._excluded(p.peer_id)]
        me = self._identity.peer_id
        expected = {p.peer_id for p in peers if p.epoch in (round_ - 1, round_)}
        ahead = any(p.epoch > round_ for p in peers if p.peer_id != me)
        return expected | {me}, ahead

    async def _candidates(self, round_: int) -> list[ReadyRecord]:
        return [
            r
            for r in await self._discovery.find_ready(round_)
            if r.weight > 0 and r.bandwidth >= 0 and not self._excluded(r.peer_id)
        ]
