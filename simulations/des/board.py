"""The model's state of one peer (``ModelPeer``: its life, its DHT record, its counts) and of
one round (``Board``: the readiness records, who decided which group, the exchanges)."""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import simpy

from swarmgrad.node.averaging.grouping import bucket_of
from swarmgrad.node.reachability.service import LIVENESS_TIMEOUT_SECONDS
from swarmgrad.simulations.des.config import UNCAPPED_BYTES_PER_SECOND
from swarmgrad.simulations.des.groups import Candidates
from swarmgrad.simulations.des.traffic import Traffic
from swarmgrad.simulations.profiles import PeerProfile


@dataclass(slots=True)
class ModelPeer:
    index: int
    peer_id: str
    profile: PeerProfile
    alive: bool = False
    paused: bool = False
    finished: bool = False
    epoch: int = 0
    record_epoch: int = -1  # what its live DHT peer record says (-1: none)
    record_token: int = 0  # which announcement that record is (a lapse checks it)
    state: Hashable = "init"  # which replica state it holds (its checksum, in the node)
    record_state: Hashable = "init"  # the state its live record announces
    record_lapses_at: float = math.inf  # when its record goes, once it stopped announcing
    process: simpy.Process | None = None
    relay: int | None = None  # a relayed peer's relay (a direct peer's index)
    exchange: Exchange | None = None  # the all-reduce it is in now
    flight: simpy.Process | None = None  # an overlapped round in flight
    sending: int = 0  # the samples the round it is in sends
    samples: int = 0
    unaveraged: int = 0  # samples since its last averaged round
    dropped: int = 0  # samples thrown away: by a resync (the swarm's state), or a crash
    compute_seconds: float = 0.0
    communication_seconds: float = 0.0
    online_seconds: float = 0.0  # its ended sessions' time (a pause counts: the node runs on)
    online_since: float = 0.0  # when its current session began
    trained_online: float = 0.0  # its time online at its last inner step (for tokens/s)
    bytes_sent: int = 0
    bytes_received: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    history: list[dict[str, Any]] = field(default_factory=list)
    sessions: int = 0

    @property
    def up(self) -> float:
        return self.profile.upload_bytes_per_second or UNCAPPED_BYTES_PER_SECOND

    @property
    def down(self) -> float:
        link = self.profile.download_bytes_per_second or UNCAPPED_BYTES_PER_SECOND
        if self.profile.loss > 0:  # TCP under random loss (Mathis et al.): MSS / (RTT sqrt(p))
            rtt = max(2 * self.latency_seconds, 0.001)
            return min(link, 1.22 * 1460 / (rtt * math.sqrt(self.profile.loss)))
        return link

    @property
    def latency_seconds(self) -> float:
        return self.profile.latency_ms / 1000.0


@dataclass(slots=True)
class Exchange:
    """One group's all-reduce among the members that agreed on it."""

    group: tuple[str, ...]
    members: tuple[int, ...]  # peer indices taking part
    done: simpy.Event
    process: simpy.Process | None = None
    dead: list[int] = field(default_factory=list)
    traffic: dict[int, Traffic] = field(default_factory=dict)
    #: The share of the vector's chunks averaged: less than 1 when the round deadline passed
    #: first (the rest is missing), 0 when no chunk made it (the node's RoundAborted).
    share: float = 1.0
    #: What each member brought as it entered: the state it held and the samples it sent.
    inputs: dict[int, tuple[Hashable, int]] = field(default_factory=dict)


@dataclass(slots=True)
class Bucket:
    visible: Candidates
    changed: simpy.Event


class Board:
    """Round r's readiness records: who is visible (in each bucket of each bucket count in
    use, by slot), who decided which group, the exchanges."""

    def __init__(self, env: simpy.Environment, round_: int, group_size: int) -> None:
        self.env = env
        self.round = round_
        self.group_size = group_size
        #: Visible records: each peer's slot (``slots.in_slot``; None: signed past its grace, a
        #: candidate for nobody; 0 for every record of rounds without slots).
        self.visible: dict[str, int | None] = {}
        self.buckets: dict[tuple[int, int], dict[int, Bucket]] = {}
        self.expected: dict[int, tuple[float, dict[int, dict[str, ModelPeer]]]] = {}
        self.bucket_count: tuple[float, int] | None = None  # (read at, count)
        self.decided: dict[str, tuple[tuple[str, ...] | None, float]] = {}
        self.waiting: dict[tuple[str, ...], simpy.Event] = {}
        #: The groups whose exchange waits for a peer's decision, by peer.
        self.watchers: dict[str, list[tuple[str, ...]]] = {}
        self.exchanges: dict[tuple[str, ...], Exchange] = {}
        #: Each peer's latest readiness record (a number per announcement) and its slot.
        self.records: dict[str, tuple[int, int | None]] = {}

    def bucket(self, buckets: int, index: int, slot: int = 0) -> Bucket:
        partition = self.buckets.get((buckets, slot))
        if partition is None:
            partition = self.buckets[(buckets, slot)] = {}
        bucket = partition.get(index)
        if bucket is None:
            bucket = partition[index] = Bucket(
                Candidates(self.round, self.group_size), self.env.event()
            )
            for peer_id, its_slot in self.visible.items():
                if its_slot == slot and bucket_of(self.round, peer_id, buckets) == index:
                    bucket.visible.add(peer_id)
        return bucket

    def _buckets_of(self, peer_id: str, slot: int | None) -> list[Bucket]:
        if slot is None:
            return []
        return [
            bucket
            for (count, its_slot), partition in self.buckets.items()
            if its_slot == slot
            and (bucket := partition.get(bucket_of(self.round, peer_id, count))) is not None
        ]

    def show(self, peer_id: str, record: int) -> None:
        held = self.records.get(peer_id)
        if held is not None and held[0] == record:
            slot = self.visible[peer_id] = held[1]
            for bucket in self._buckets_of(peer_id, slot):
                bucket.visible.add(peer_id)
                changed, bucket.changed = bucket.changed, self.env.event()
                changed.succeed()

    def withdraw(self, peer_id: str, record: int) -> None:
        """Withdraw (or let expire) ``peer_id``'s record, if it is still that announcement."""
        held = self.records.get(peer_id)
        if held is not None and held[0] == record:
            del self.records[peer_id]
            slot = self.visible.pop(peer_id, None)
            for bucket in self._buckets_of(peer_id, slot):
                bucket.visible.remove(peer_id)


#: States' checksums, once each: a state names its group (up to 256 peer ids), and every
#: resync's census compares the states it sees.
_CHECKSUMS: dict[Hashable, bytes] = {}


def checksum(state: Hashable) -> bytes:
    found = _CHECKSUMS.get(state)
    if found is None:
        if len(_CHECKSUMS) >= 1 << 16:
            _CHECKSUMS.clear()
        found = _CHECKSUMS[state] = hashlib.blake2b(repr(state).encode(), digest_size=8).digest()
    return found


def majority(votes: Counter[Hashable]) -> Hashable:
    """The state most of ``votes`` hold; ties go to the smallest checksum (``pick_donors``)."""
    return min(votes, key=lambda state: (-votes[state], checksum(state)))


def probe_answer(peer: ModelPeer) -> float:
    """How long after a matchmaking asks ``peer`` whether it is alive (``PROBE_AFTER_SECONDS``
    into it) the answer is in, while it does not run: a dead one's connection is refused (a
    round trip), a paused one's deadline passes. Until then it is waited for; a running one is
    waited for as long as its record says it is in the round."""
    return LIVENESS_TIMEOUT_SECONDS if peer.alive else 2 * peer.latency_seconds
