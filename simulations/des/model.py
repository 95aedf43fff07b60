"""The discrete-event swarm model: peers that train, match, average, resync and churn by the node's
rules, on links drawn from profiles, in simulated time (SimPy).

What each peer does, and whose rule it is:

- **Train**: H inner steps (``algorithm.inner_steps``) of ``step_seconds x slowdown``.
- **Resync**: before a round, a peer behind the newest epoch that a live peer record announces
  (``pick_donors``: a dead peer's record counts until it lapses) downloads the state (theta and
  the outer momentum, fp32) from up to ``StateSyncConfig.max_donors`` donors at once, each
  donor's upload and its own download shared, as ``node/state`` does; a (re)started peer does it
  first. If no holder of that state is alive and running, the download fails (a connection
  refused, or a paused donor's download timeout) and the peer goes on at its own epoch and reads
  the records again at its next round, as the node does; only a download counts as a resync.
- **Match** (``node/averaging/matchmaking.py``): announce readiness (visible to others after a
  DHT write); from the census (peer records at epoch r or r - 1, a dead peer's until its record
  lapses) take the node's bucket count and this peer's bucket; wait until every expected peer of
  the bucket is visible (a dead one is asked after ``PROBE_AFTER_SECONDS`` and no longer waited
  for one round trip later, a paused one after the liveness deadline), or the matchmaking
  timeout; notice at the next poll, wait the settle
  time, read once more and cut the bucket's visible candidates into groups in the node's own
  order (``groups.py``). Readiness records are withdrawn and lapse as the node's do. Peers
  that read different candidate sets can compute different groups: only members that computed
  the same group average together (a group with dissenters is partial, a peer alone in its view
  aborts and tries the round again after more training), as on the wire, where streams with
  another group id are refused.
- **Average** (``node/averaging``): the butterfly over the node's partition by bandwidth and its
  codecs (``traffic.py``); it lasts as long as the member whose link is the bottleneck needs for
  its bytes up or down (a relayed member's bytes also cross its relay's link), plus three
  latencies (stream, chunks, results) and codec time, but never longer than the round deadline
  (``round_timeout_seconds``): past it the chunks not yet through are missing and the round is
  partial, or aborted if no chunk got through (each part's chunks taken to stream at one pace).
  The per-round overhead (the outer step) follows an averaged or partial round. A member that
  dies mid-round leaves its part out (partial) after the sender timeout.
- **Churn**: the run's schedule (``churn.py``: kill, stop, start, pause, resume at an epoch,
  a kill "during" a round or a state download), and random sessions from the profiles
  (``session_seconds``: mean of exponential sessions, then ``offline_seconds`` away). A crash
  loses what the peer trained since its last averaged round (``samples_dropped``); the compute
  or round it was in counts in its time all the same.

Only DiLoCo is modelled (``algorithm.name = "sync"`` is refused). A peer's ``tokens_per_second``
is over its own time online (its sessions together) up to its last inner step, not the run's.

Not modelled: the loss (the model predicts time, bytes and rounds, not convergence), open runs'
checks, contention between different groups on one relay, a partition's local training (a
partitioned peer is modelled as paused), and owners dropping a live member whose chunks come
slower than the sender timeout (a slow link shows as the round deadline, not as that drop).
"""

from __future__ import annotations

import hashlib
import math
import random
import statistics
from collections import Counter
from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import simpy

from swarmgrad.node.averaging.group import Group, Member
from swarmgrad.node.averaging.grouping import bucket_count, bucket_of
from swarmgrad.node.averaging.matchmaking import (
    EXPECTED_REFRESH_SECONDS,
    POLL_SECONDS,
    READY_MARGIN_SECONDS,
)
from swarmgrad.node.averaging.membership import PROBE_AFTER_SECONDS
from swarmgrad.node.averaging.plan import AllReduceConfig
from swarmgrad.node.averaging.rounds import WITHDRAW_MARGIN_SECONDS
from swarmgrad.node.discovery.directory import DirectoryConfig
from swarmgrad.node.reachability.service import LIVENESS_TIMEOUT_SECONDS
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.state.sync import StateSyncConfig
from swarmgrad.node.swarm_config import MATCHMAKING_SETTLE_SECONDS, allreduce_config
from swarmgrad.node.training.model import skeleton
from swarmgrad.simulations.churn import ChurnEvent
from swarmgrad.simulations.des.groups import Candidates
from swarmgrad.simulations.des.traffic import Traffic, round_traffic
from swarmgrad.simulations.profiles import PeerProfile, SimulationError
from swarmgrad.simulations.summary import epoch_curves

Events = Generator[simpy.Event, Any, Any]
#: A link with no cap in the profile (loopback, or a datacentre): 10 Gbit/s.
UNCAPPED_BYTES_PER_SECOND = 1.25e9


def parameter_count(spec: RunSpec) -> int:
    """The run's model size, built on the meta device (no memory, any size)."""
    return sum(p.numel() for p in skeleton(spec.model).parameters())


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """One modelled swarm: ``nodes`` peers from the start (``profiles`` has one per slot, the
    churn schedule's newcomers included), trained to ``rounds`` epochs."""

    spec: RunSpec
    nodes: int
    rounds: int
    profiles: tuple[PeerProfile, ...]
    #: One inner step at slowdown 1 (measure it: ``calibrate.step_seconds``).
    step_seconds: float
    events: tuple[ChurnEvent, ...] = ()
    seed: int = 0
    #: A DHT write becoming visible to readers, or one read.
    dht_seconds: float = 0.05
    #: Per round, besides matchmaking and the transfers: the outer step, bookkeeping.
    round_overhead_seconds: float = 0.0
    #: Values a peer encodes or decodes per second (None: free).
    codec_values_per_second: float | None = None
    #: Stop (and say so) if the swarm is not done by this simulated time.
    max_simulated_seconds: float = 30 * 24 * 3600.0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.rounds < 1:
            raise SimulationError("nodes and rounds must be at least 1")
        if len(self.profiles) < max([self.nodes - 1, *(e.node for e in self.events)]) + 1:
            raise SimulationError("one profile per node slot is needed")
        if not self.step_seconds > 0 or self.dht_seconds < 0 or self.round_overhead_seconds < 0:
            raise SimulationError("step_seconds must be positive, the overheads >= 0")
        if self.spec.algorithm.name != "diloco":
            # Sync averages every step's gradients and its state holds the optimizer's moments:
            # the model's rounds (H inner steps, then one exchange of theta) are DiLoCo's.
            raise SimulationError(
                f"the discrete-event model runs DiLoCo only, not algorithm.name = "
                f'{self.spec.algorithm.name!r}: model the run with algorithm.name = "diloco" '
                f"or simulate it with real processes (--engine processes)"
            )


@dataclass(slots=True)
class _Peer:
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
    exchange: _Exchange | None = None  # the all-reduce it is in now
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
class _Exchange:
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


@dataclass(slots=True)
class _Bucket:
    visible: Candidates
    changed: simpy.Event


class _Board:
    """Round r's readiness records: who is visible (in each bucket of each bucket count in
    use), who decided which group, the exchanges."""

    def __init__(self, env: simpy.Environment, round_: int, group_size: int) -> None:
        self.env = env
        self.round = round_
        self.group_size = group_size
        self.visible: set[str] = set()
        self.buckets: dict[int, dict[int, _Bucket]] = {}
        self.expected: dict[int, tuple[float, dict[int, list[_Peer]]]] = {}
        self.bucket_count: tuple[float, int] | None = None  # (read at, count)
        self.decided: dict[str, tuple[tuple[str, ...] | None, float]] = {}
        self.waiting: dict[tuple[str, ...], simpy.Event] = {}
        #: The groups whose exchange waits for a peer's decision, by peer.
        self.watchers: dict[str, list[tuple[str, ...]]] = {}
        self.exchanges: dict[tuple[str, ...], _Exchange] = {}
        #: Each peer's latest readiness record (a number per announcement).
        self.records: dict[str, int] = {}

    def bucket(self, buckets: int, index: int) -> _Bucket:
        partition = self.buckets.get(buckets)
        if partition is None:
            partition = self.buckets[buckets] = {}
        bucket = partition.get(index)
        if bucket is None:
            bucket = partition[index] = _Bucket(
                Candidates(self.round, self.group_size), self.env.event()
            )
            for peer_id in self.visible:
                if bucket_of(self.round, peer_id, buckets) == index:
                    bucket.visible.add(peer_id)
        return bucket

    def _buckets_of(self, peer_id: str) -> list[_Bucket]:
        return [
            bucket
            for count, partition in self.buckets.items()
            if (bucket := partition.get(bucket_of(self.round, peer_id, count))) is not None
        ]

    def show(self, peer_id: str, record: int) -> None:
        if self.records.get(peer_id) == record:
            self.visible.add(peer_id)
            for bucket in self._buckets_of(peer_id):
                bucket.visible.add(peer_id)
                changed, bucket.changed = bucket.changed, self.env.event()
                changed.succeed()

    def withdraw(self, peer_id: str, record: int) -> None:
        """Withdraw (or let expire) ``peer_id``'s record, if it is still that announcement."""
        if self.records.get(peer_id) == record:
            del self.records[peer_id]
            self.visible.discard(peer_id)
            for bucket in self._buckets_of(peer_id):
                bucket.visible.remove(peer_id)


class SwarmModel:
    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        spec = config.spec
        self.allreduce: AllReduceConfig = allreduce_config(spec)
        self.params = parameter_count(spec)
        self.state_bytes = 2 * 4 * self.params  # theta and the outer momentum, fp32
        self.group_size = spec.averaging.group_size
        self.matchmaking_timeout = spec.averaging.matchmaking_timeout_seconds
        self.record_ttl = DirectoryConfig().record_ttl_seconds
        self.max_donors = StateSyncConfig().max_donors
        self.download_timeout = StateSyncConfig().download_timeout_seconds
        self.inner_steps = spec.algorithm.inner_steps
        self.batch = spec.data.batch_size
        self.env = simpy.Environment()
        self.rng = random.Random(f"swarmgrad-des:{config.seed}")
        self.peers = [
            _Peer(index=i, peer_id=f"peer-{i:06d}", profile=p)
            for i, p in enumerate(config.profiles)
        ]
        self.by_id = {p.peer_id: p for p in self.peers}
        direct = [p.index for p in self.peers if p.profile.nat == "direct"]
        for peer in self.peers:
            if peer.profile.nat == "relayed":
                if not direct:
                    raise SimulationError("a relayed peer needs a direct peer to relay it")
                peer.relay = self.rng.choice(direct)
        self.boards: dict[int, _Board] = {}
        #: The highest epoch any peer reached (the churn schedule's "at epoch").
        self.reached = 0
        #: Rounds that moved a peer's epoch on (the stall guard's measure of progress).
        self.advances = 0
        self.epoch_changed = self.env.event()
        self.fired: list[dict[str, Any]] = []
        self.armed: ChurnEvent | None = None  # a kill waiting for its node to enter a phase
        self.done = self.env.event()
        self.rejoin_seconds: dict[int, list[float]] = {}
        self.stalled = False
        self.live = 0  # peers alive (finished or not)
        self.training: set[int] = set()  # alive and not finished
        self._records = 0
        #: The live peer records, by the epoch they announce (the matchmaking census).
        self.census: dict[int, set[int]] = {}
        #: The states the live records announce, by epoch, and who holds each.
        self.votes: dict[int, Counter[Hashable]] = {}
        self.holders: dict[tuple[int, Hashable], set[int]] = {}

    # -- the run --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        for peer in self.peers[: self.config.nodes]:
            self._start(peer)
        self.env.process(self._churn())
        self.env.process(self._watch())
        self.env.process(self._stall_guard())
        self.env.run(until=simpy.AnyOf(self.env, [self.done, self._cap()]))
        return self.summary()

    def _cap(self) -> simpy.Event:
        return self.env.timeout(self.config.max_simulated_seconds)

    def _stall_guard(self) -> Events:
        """Ends a run in which no peer has reached a new epoch for a long while (a swarm that
        cannot form groups any more): the summary says it stalled."""
        slowest = max(p.slowdown for p in self.config.profiles)
        patience = 10 * (
            self.inner_steps * self.config.step_seconds * slowest
            + self.matchmaking_timeout
            + self.allreduce.round_timeout_seconds
            + max(p.offline_seconds for p in self.config.profiles)
        )
        seen = -1
        while not self.done.triggered:
            if self.advances == seen:
                self.stalled = True
                self.done.succeed()
                return
            seen = self.advances
            yield self.env.timeout(patience)

    def _watch(self) -> Events:
        """Ends the run once every live peer has finished and the schedule is spent."""
        while True:
            yield self.epoch_changed
            if self._all_done() and not self.done.triggered:
                self.done.succeed()
                return

    def _all_done(self) -> bool:
        scheduled = len(self.fired) == len(self.config.events) and self.armed is None
        return scheduled and self.live > 0 and not self.training

    def _advanced(self) -> None:
        changed, self.epoch_changed = self.epoch_changed, self.env.event()
        changed.succeed()

    # -- one peer's life ------------------------------------------------------------------------

    def _start(self, peer: _Peer) -> None:
        peer.alive, peer.paused, peer.finished = True, False, False
        peer.online_since = self.env.now
        self.live += 1
        self.training.add(peer.index)
        self._announce(peer, peer.epoch)
        peer.sessions += 1
        peer.process = self.env.process(self._life(peer, restarted=peer.sessions > 1))
        if peer.profile.session_seconds is not None:
            session = self.rng.expovariate(1.0 / peer.profile.session_seconds)
            self.env.process(self._session(peer, session, peer.sessions))

    def _session(self, peer: _Peer, seconds: float, session: int) -> Events:
        yield self.env.timeout(seconds)
        if peer.alive and peer.sessions == session and not peer.finished:
            self._kill(peer)
            yield self.env.timeout(peer.profile.offline_seconds)
            if not peer.alive:
                self._start(peer)

    def _life(self, peer: _Peer, *, restarted: bool) -> Events:
        env, started = self.env, self.env.now
        computing, since = False, started  # what it is doing now, since when
        try:
            if self._behind(peer):
                if (yield from self._resync(peer)):
                    self._record(peer, "resynced", started, 0)
                    if restarted:
                        self.rejoin_seconds.setdefault(peer.index, []).append(env.now - started)
                else:  # no donor answered: it trains on and reads the records again next round
                    peer.communication_seconds += env.now - started
            while peer.epoch < self.config.rounds:
                compute = self.inner_steps * self.config.step_seconds * peer.profile.slowdown
                computing, since = True, env.now
                yield env.timeout(compute)
                peer.compute_seconds += compute
                peer.samples += self.inner_steps * self.batch
                peer.unaveraged += self.inner_steps * self.batch
                peer.trained_online = peer.online_seconds + env.now - peer.online_since
                computing, since = False, env.now
                round_started = env.now
                yield env.timeout(self.config.dht_seconds)  # the donors' records, read
                if self._behind(peer) and (yield from self._resync(peer)):
                    self._record(peer, "resynced", round_started, 0)
                    continue
                # Not behind, or no donor answered (the node tries again next round).
                outcome, size, state = yield from self._round(peer)
                if outcome in ("averaged", "partial"):
                    peer.unaveraged = 0
                    peer.state = state
                    peer.epoch += 1
                    self._announce(peer, peer.epoch)
                    self.reached = max(self.reached, peer.epoch)
                    self.advances += 1
                self._record(peer, outcome, round_started, size)
            peer.finished = True
            self.training.discard(peer.index)
            self._advanced()
        except simpy.Interrupt:
            # Killed, stopped or paused (the churn that did it set the state): the compute or
            # round it was in took its time all the same.
            if computing:
                peer.compute_seconds += env.now - since
            else:
                peer.communication_seconds += env.now - since

    def _record(self, peer: _Peer, outcome: str, started: float, group_size: int) -> None:
        seconds = self.env.now - started
        peer.communication_seconds += seconds
        peer.outcomes[outcome] += 1
        peer.history.append(
            {
                "epoch": peer.epoch,
                "outcome": outcome,
                "time": self.env.now,
                "samples": peer.samples,
                "group_size": group_size,
                "round_seconds": seconds,
                "bytes_sent": peer.bytes_sent,
                "bytes_received": peer.bytes_received,
            }
        )
        self._advanced()

    def _best(self, epoch: int) -> Hashable | None:
        """The state most live records at ``epoch`` announce (ties: the smallest checksum)."""
        votes = self.votes.get(epoch)
        if not votes:
            return None
        return min(votes, key=lambda state: (-votes[state], _checksum(state)))

    def _newest(self) -> int:
        """The swarm's epoch as ``pick_donors`` reads it: the newest a live peer record announces
        (a dead peer's until it lapses), not the newest ever reached."""
        return max(self.census, default=0)

    def _behind(self, peer: _Peer) -> bool:
        """The node's resync rule (``pick_donors``): the swarm is at a newer epoch, or most peers
        at this one hold another state (a group that averaged apart from the majority's)."""
        if self._newest() > peer.epoch:
            return True
        best = self._best(peer.epoch)
        return best is not None and best != peer.state

    def _resync(self, peer: _Peer) -> Generator[simpy.Event, Any, bool]:
        """Download the swarm's state from the live holders of it; whether it did. With none
        (the records of the donors outlive them until they lapse) the node's download fails:
        after a connection refused, or a paused donor's download timeout."""
        self._fire_armed(peer, "state_download")
        newest = self._newest()
        target = (newest, self._best(newest))
        listed = [self.peers[i] for i in self.holders.get(target, ()) if i != peer.index]
        donors = [d for d in listed if d.alive and not d.paused][: self.max_donors]
        if not donors:
            if any(d.alive for d in listed):  # paused: nobody answers
                yield self.env.timeout(self.config.dht_seconds + self.download_timeout)
            elif listed:  # dead: the connection is refused
                latency = max(peer.latency_seconds + d.latency_seconds for d in listed)
                yield self.env.timeout(self.config.dht_seconds + 2 * latency)
            return False
        rate = min(peer.down, sum(d.up for d in donors))
        latency = max(peer.latency_seconds + d.latency_seconds for d in donors)
        yield self.env.timeout(self.config.dht_seconds + 2 * latency + self.state_bytes / rate)
        peer.epoch, peer.state = target[0], target[1]
        peer.dropped += peer.unaveraged
        peer.unaveraged = 0
        self._announce(peer, peer.epoch)
        return True

    # -- peer records (the census) --------------------------------------------------------------

    def _announce(self, peer: _Peer, epoch: int) -> None:
        self._unlist(peer)
        peer.record_epoch, peer.record_state = epoch, peer.state
        peer.record_lapses_at = math.inf
        peer.record_token += 1
        self.census.setdefault(epoch, set()).add(peer.index)
        self.votes.setdefault(epoch, Counter())[peer.state] += 1
        self.holders.setdefault((epoch, peer.state), set()).add(peer.index)

    def _unlist(self, peer: _Peer) -> None:
        if peer.record_epoch >= 0:
            listed = self.census[peer.record_epoch]
            listed.discard(peer.index)
            if not listed:
                del self.census[peer.record_epoch]
            votes = self.votes[peer.record_epoch]
            votes[peer.record_state] -= 1
            if not votes[peer.record_state]:
                del votes[peer.record_state]
            self.holders[(peer.record_epoch, peer.record_state)].discard(peer.index)
        peer.record_epoch = -1

    def _lapse(self, peer: _Peer) -> Events:
        """A peer that stopped announcing: its record is gone once its time to live passes."""
        token = peer.record_token
        peer.record_lapses_at = self.env.now + self.record_ttl
        yield self.env.timeout(self.record_ttl)
        if peer.record_token == token:
            self._unlist(peer)

    def _bucket_count(self, board: _Board) -> int:
        """The node's bucket count for ``board``'s round from the live peer records at its epoch
        - 1 or later, re-read as often as the node reads its census."""
        cached = board.bucket_count
        if cached is None or self.env.now - cached[0] > EXPECTED_REFRESH_SECONDS:
            peers = [
                self.peers[i].peer_id
                for epoch, ids in self.census.items()
                if epoch >= board.round - 1
                for i in ids
            ]
            cached = board.bucket_count = (
                self.env.now,
                bucket_count(board.round, peers, self.group_size),
            )
        return cached[1]

    def _expected(self, board: _Board, buckets: int, index: int) -> list[_Peer]:
        """The census of ``board``'s round in one bucket, re-read as often as the node does."""
        read = board.expected.get(buckets)
        if read is None or self.env.now - read[0] > EXPECTED_REFRESH_SECONDS:
            by_bucket: dict[int, list[_Peer]] = {}
            for epoch in (board.round - 1, board.round):
                for i in self.census.get(epoch, ()):
                    peer = self.peers[i]
                    by_bucket.setdefault(bucket_of(board.round, peer.peer_id, buckets), []).append(
                        peer
                    )
            read = board.expected[buckets] = (self.env.now, by_bucket)
        return read[1].get(index, [])

    # -- matchmaking and the all-reduce ---------------------------------------------------------

    def _board(self, round_: int) -> _Board:
        board = self.boards.get(round_)
        if board is None:
            board = self.boards[round_] = _Board(self.env, round_, self.group_size)
            self.boards.pop(round_ - 3, None)  # nobody reads that far back
        return board

    def _round(self, peer: _Peer) -> Events:
        """Matchmaking, then the all-reduce: (outcome, group size, the state it leaves)."""
        env, board, me = self.env, self._board(peer.epoch), peer.peer_id
        board.decided.pop(me, None)  # an earlier attempt's
        record = self._records = self._records + 1
        earlier = board.records.get(me)
        if earlier is not None:
            board.withdraw(me, earlier)
        board.records[me] = record
        delay = self.config.dht_seconds + peer.latency_seconds
        env.process(self._after(delay, board.show, me, record))
        # It lapses unless withdrawn sooner (a crashed peer's stays until then).
        lapse = delay + self.matchmaking_timeout + READY_MARGIN_SECONDS
        env.process(self._after(lapse, board.withdraw, me, record))
        started, deadline = env.now, env.now + self.matchmaking_timeout
        while True:
            r = peer.epoch
            buckets = self._bucket_count(board)
            index = bucket_of(r, me, buckets)
            bucket = board.bucket(buckets, index)
            if env.now >= deadline:
                break
            seen = bucket.visible.ids
            wake = deadline
            if len(seen) >= 2 and me in seen:
                expected = self._expected(board, buckets, index)
                awaited = [
                    p
                    for p in expected
                    if p.peer_id not in seen
                    and p.record_epoch in (r - 1, r)
                    and env.now < _gone_at(p, started)
                ]
                if not awaited:
                    break
                # Nothing changes for this peer until one of them shows up (bucket.changed), the
                # record of one that stopped announcing lapses, or a dead one fails its liveness
                # probe: no need to poll till then.
                wake = min(wake, *(min(p.record_lapses_at, _gone_at(p, started)) for p in awaited))
            else:
                wake = min(wake, env.now + EXPECTED_REFRESH_SECONDS)
            wake = max(wake, env.now + POLL_SECONDS)
            yield env.any_of([bucket.changed, env.timeout(wake - env.now)])
        yield env.timeout(POLL_SECONDS / 2 + MATCHMAKING_SETTLE_SECONDS)
        group = bucket.visible.group_of(me)
        if group is not None and all(self.by_id[p].relay is not None for p in group):
            group = None  # the node's "no member of the group can be dialed"
        board.decided[me] = (group, env.now)
        self._settled(board, me)
        if group is None:
            board.withdraw(me, record)
            return "no group", 1, None
        early = MATCHMAKING_SETTLE_SECONDS + WITHDRAW_MARGIN_SECONDS
        env.process(self._after(early, board.withdraw, me, record))
        try:
            return (yield from self._average(peer, board, group))
        finally:
            if peer.alive and not peer.paused:
                board.withdraw(me, record)

    def _average(self, peer: _Peer, board: _Board, group: tuple[str, ...]) -> Events:
        exchange = yield from self._exchange(board, group)
        self._fire_armed(peer, "round")
        if peer.index not in exchange.members:
            return "aborted", len(group), None
        peer.exchange = exchange
        yield exchange.done
        peer.exchange = None
        traffic = exchange.traffic.get(peer.index)
        if traffic is not None:
            peer.bytes_sent += traffic.sent
            peer.bytes_received += traffic.received
        if len(exchange.members) < 2 or exchange.share == 0:
            return "aborted", len(group), None
        if self.config.round_overhead_seconds:
            yield self.env.timeout(self.config.round_overhead_seconds)  # the outer step
        complete = len(exchange.members) == len(group) and not exchange.dead and exchange.share == 1
        # Every member of one exchange ends with the same values; other groups with others.
        state = (peer.epoch, exchange.group, exchange.members, tuple(exchange.dead), exchange.share)
        return ("averaged" if complete else "partial"), len(group), state

    def _after(self, delay: float, action: Callable[[str, int], None], *args: Any) -> Events:
        yield self.env.timeout(delay)
        action(*args)

    def _exchange(self, board: _Board, group: tuple[str, ...]) -> Events:
        """The exchange of ``group``: once every member has decided (or a sender timeout has
        passed), the members that computed this same group average among themselves."""
        exchange = board.exchanges.get(group)
        if exchange is not None:
            return exchange
        if not self._all_decided(board, group):
            waiting = board.waiting.get(group)
            if waiting is None:
                waiting = board.waiting[group] = self.env.event()
                for p in group:
                    board.watchers.setdefault(p, []).append(group)
            yield self.env.any_of(
                [waiting, self.env.timeout(self.allreduce.sender_timeout_seconds)]
            )
        exchange = board.exchanges.get(group)
        if exchange is None:
            agreed = tuple(
                self.by_id[p].index
                for p in group
                if board.decided.get(p, (None, 0.0))[0] == group and self.by_id[p].alive
            )
            exchange = _Exchange(group=group, members=agreed, done=self.env.event())
            board.exchanges[group] = exchange
            exchange.process = self.env.process(self._transfer(exchange, board))
        return exchange

    def _all_decided(self, board: _Board, group: tuple[str, ...]) -> bool:
        return all(p in board.decided or not self.by_id[p].alive for p in group)

    def _settled(self, board: _Board, peer_id: str) -> None:
        """``peer_id`` decided (or died): wake the exchanges that were waiting for it."""
        for group in board.watchers.pop(peer_id, []):
            waiting = board.waiting.get(group)
            if waiting is not None and not waiting.triggered and self._all_decided(board, group):
                waiting.succeed()

    def _transfer(self, exchange: _Exchange, board: _Board) -> Events:
        """The all-reduce: as long as its bytes need, and never past the round deadline
        (``round_timeout_seconds``), where the chunks that had not arrived are missing."""
        env = self.env
        seconds, chunks = self._transfer_seconds(exchange)
        timeout = self.allreduce.round_timeout_seconds
        deadline = env.now + timeout
        end = min(env.now + seconds, deadline)
        while env.now < end:
            try:
                yield env.timeout(end - env.now)
            except simpy.Interrupt:  # a member died: the others drop it after the sender timeout
                end = min(max(end, env.now + self.allreduce.sender_timeout_seconds), deadline)
        if seconds > timeout:
            # The parts stream their chunks side by side: by the deadline, about this share of
            # each part's chunks is through (none at all: the round is aborted), and about this
            # share of each member's bytes has moved.
            moved = timeout / seconds
            exchange.share = math.floor(chunks * moved) / chunks
            exchange.traffic = {
                i: Traffic(sent=int(t.sent * moved), received=int(t.received * moved))
                for i, t in exchange.traffic.items()
            }
        exchange.done.succeed()
        # A later attempt at this round that computes the same group is a new exchange.
        del board.exchanges[exchange.group]
        board.waiting.pop(exchange.group, None)

    def _transfer_seconds(self, exchange: _Exchange) -> tuple[float, int]:
        """How long the all-reduce needs for its bytes, without a deadline, and the most chunks
        one part is cut into."""
        members = [self.by_id[p] for p in exchange.group]
        if len(exchange.members) < 2:
            return 0.0, 1
        group = Group(
            round=0,
            members=tuple(
                Member(
                    peer_id=m.peer_id,
                    endpoint=m.peer_id,
                    bandwidth=m.profile.bandwidth if m.profile.nat == "direct" else 0.0,
                )
                for m in members
            ),
        )
        position = {m.index: i for i, m in enumerate(members)}
        taking = [position[i] for i in exchange.members]
        by_position = round_traffic(group, self.params, self.allreduce, taking)
        chunks = max(
            -(-(end - start) // self.allreduce.chunk_values)
            for start, end in group.partition(self.params)
        )
        exchange.traffic = {members[i].index: t for i, t in by_position.items()}
        up: Counter[int] = Counter()
        down: Counter[int] = Counter()
        for index, t in exchange.traffic.items():
            up[index] += t.sent
            down[index] += t.received
            relay = self.peers[index].relay
            if relay is not None:  # the relay carries both directions of the relayed peer
                up[relay] += t.received
                down[relay] += t.sent
        transfer = max(
            max(b / self.peers[i].up for i, b in up.items()),
            max(b / self.peers[i].down for i, b in down.items()),
        )
        hops = [
            self.peers[i].latency_seconds * (1 if self.peers[i].relay is None else 2) for i in up
        ]
        latency = 3 * (sorted(hops)[-1] + sorted(hops)[-2]) if len(hops) > 1 else 0.0
        codec = 0.0
        if self.config.codec_values_per_second:
            codec = 2 * self.params / self.config.codec_values_per_second
        if len(exchange.members) < len(exchange.group):  # streams to dissenters time out
            transfer = max(transfer, self.allreduce.join_timeout_seconds)
        return transfer + latency + codec, max(chunks, 1)

    # -- churn ----------------------------------------------------------------------------------

    def _kill(self, peer: _Peer, *, graceful: bool = False) -> None:
        peer.alive = False
        peer.online_seconds += self.env.now - peer.online_since
        # What it trained since its last averaged round never reaches the model: its
        # checkpoints hold the state it had then.
        peer.dropped += peer.unaveraged
        peer.unaveraged = 0
        self.live -= 1
        self.training.discard(peer.index)
        if graceful:
            self._unlist(peer)
        else:
            self.env.process(self._lapse(peer))
        self._halt(peer)
        for board in self.boards.values():
            self._settled(board, peer.peer_id)

    def _halt(self, peer: _Peer) -> None:
        """Stop ``peer``'s process; its all-reduce goes on without it."""
        if peer.process is not None and peer.process.is_alive:
            peer.process.interrupt()
        exchange, peer.exchange = peer.exchange, None
        if exchange is not None and exchange.process is not None and exchange.process.is_alive:
            exchange.dead.append(peer.index)
            exchange.process.interrupt()

    def _churn(self) -> Events:
        for event in self.config.events:
            while self.reached < event.at_epoch:
                yield self.epoch_changed
            target = self.peers[event.node]
            if event.during:
                self.armed = event
                while self.armed is not None:
                    yield self.epoch_changed
                continue
            self._fire(event, target)

    def _fire(self, event: ChurnEvent, target: _Peer) -> None:
        if event.action == "start":
            self._start(target)
        elif event.action in ("kill", "stop"):
            self._kill(target, graceful=event.action == "stop")
        elif event.action in ("pause", "partition"):
            target.paused = True
            self.env.process(self._lapse(target))
            self._halt(target)
        else:  # resume or heal: stale, it catches up by state sync
            target.paused = False
            self._announce(target, target.epoch)
            target.process = self.env.process(self._life(target, restarted=True))
        self.fired.append({"event": event.describe(), "time": self.env.now})
        self._advanced()

    def _fire_armed(self, peer: _Peer, phase: str) -> None:
        event = self.armed
        if event is not None and event.node == peer.index and event.during == phase:
            self.armed = None
            self.env.process(self._fire_soon(event, peer))

    def _fire_soon(self, event: ChurnEvent, peer: _Peer) -> Events:
        yield self.env.timeout(0)
        self._fire(event, peer)

    # -- the summary ----------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """The same schema as the real processes' summary (``simulations/summary.py``); the
        loss fields are None: the model does not train."""
        finals = [p for p in self.peers if p.sessions]
        ok = all(p.epoch >= self.config.rounds for p in finals if p.alive)
        seq_len = self.config.spec.model.seq_len
        peers: list[dict[str, Any]] = []
        for p in finals:
            busy = p.compute_seconds + p.communication_seconds
            trained_for = max(p.trained_online, 1e-9)  # as the node: since it (re)started
            peers.append(
                {
                    "peer_id": p.peer_id,
                    "epoch": p.epoch,
                    "samples": p.samples,
                    "samples_dropped": p.dropped,
                    "tokens_per_second": p.samples * seq_len / trained_for,
                    "bytes_sent": p.bytes_sent,
                    "bytes_received": p.bytes_received,
                    "compute_seconds": p.compute_seconds,
                    "communication_seconds": p.communication_seconds,
                    "utilization": p.compute_seconds / busy if busy else 0.0,
                    "outcomes": dict(p.outcomes),
                    "checksum": None,
                }
            )
        total = sum(p["samples"] for p in peers) or 1
        for row in peers:
            row["contribution"] = row["samples"] / total
        spec = self.config.spec
        summary: dict[str, Any] = {
            "engine": "des",
            "ok": ok and not self._capped() and not self.stalled,
            "stalled": self.stalled,
            "run": spec.run.id,
            "spec_hash": spec.short_hash,
            "algorithm": spec.algorithm.name,
            "codec": spec.averaging.codec,
            "nodes": len(finals),
            "rounds": self.config.rounds,
            "wall_seconds": self.env.now,
            "initial_val_loss": None,
            "final_val_loss": None,
            "replicas_identical": None,
            "parameters": self.params,
            **epoch_curves(p.history for p in finals),
            "peers": peers,
            "totals": totals(peers),
        }
        if self.config.events or any(p.profile.session_seconds for p in self.peers):
            summary["churn"] = {
                "events": self.fired,
                "rejoin_seconds": {
                    f"node-{i}": seconds for i, seconds in sorted(self.rejoin_seconds.items())
                },
                "finished": [f"node-{p.index}" for p in finals if p.finished],
            }
        return summary

    def _capped(self) -> bool:
        return not self.done.triggered


def totals(peers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Swarm-wide figures: mean utilization, rounds lost and partial, bytes per peer."""
    outcomes: Counter[str] = Counter()
    for p in peers:
        outcomes.update(p["outcomes"])
    return {
        "utilization": statistics.fmean(p["utilization"] for p in peers) if peers else 0.0,
        "rounds_lost": outcomes["no group"] + outcomes["aborted"],
        "rounds_partial": outcomes["partial"],
        "rounds_averaged": outcomes["averaged"],
        "resyncs": outcomes["resynced"],
        # The share of the samples trained that reached the model (not thrown away by a resync).
        "samples_kept": 1
        - sum(p["samples_dropped"] for p in peers) / max(sum(p["samples"] for p in peers), 1),
        "bytes_sent_per_peer": statistics.fmean(p["bytes_sent"] for p in peers) if peers else 0,
    }


def simulate(config: ModelConfig) -> dict[str, Any]:
    """Run the model once; its summary."""
    return SwarmModel(config).run()


def _checksum(state: Hashable) -> bytes:
    return hashlib.blake2b(repr(state).encode(), digest_size=8).digest()


def _gone_at(peer: _Peer, started: float) -> float:
    """When a matchmaking that began at ``started`` stops waiting for ``peer``: once it has asked
    it (after ``PROBE_AFTER_SECONDS``) and a dead one's connection was refused (a round trip) or
    a paused one's deadline passed; never while it runs."""
    if peer.alive and not peer.paused:
        return math.inf
    answer = LIVENESS_TIMEOUT_SECONDS if peer.alive else 2 * peer.latency_seconds
    return started + PROBE_AFTER_SECONDS + answer
