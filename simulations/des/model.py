"""The discrete-event swarm model: peers that train, match, average, resync and churn by the node's
rules, on links drawn from profiles, in simulated time (SimPy). Its rooms: ``config.py`` (the
input), ``board.py`` (a peer's and a round's state), ``state.py`` (the census of peer
records), ``rounds.py`` (matchmaking and the all-reduce), ``churning.py`` (sessions and the churn
schedule), ``report.py`` (the summary); here, the run and a peer's life.

What each peer does, and whose rule it is:

- **Train**: H inner steps (``algorithm.inner_steps``) of ``step_seconds x compute_factor``
  (its slowdown over its CPU share: ``PeerProfile.compute_factor``), or with a time window
  (``algorithm.round_seconds``) as many as end before its slot boundary
  (``slots.window_end``, ``window.steps_in_window``); at every quarter slot before it
  (``slots.checks``), a peer behind the swarm resyncs (the node's window checks), unless its
  rounds are overlapped.
- **Overlap** (``algorithm.overlap``): at a boundary the round started at the last one lands
  (the peer waits for it if it has not), then the next starts and the peer trains on at once;
  what it trains meanwhile goes in the next round, and its last round lands before it stops.
- **Resync**: before a round, a peer behind the newest epoch that a live peer record announces
  (``pick_donors``: a dead peer's record counts until it lapses) downloads the state (theta and
  the outer momentum, fp32) from up to ``StateSyncConfig.max_donors`` donors at once, each
  donor's upload and its own download shared, as ``node/state`` does; a (re)started peer does it
  first. If no holder of that state is alive and running, the download fails (a connection
  refused, or a paused donor's download timeout) and the peer goes on at its own epoch and reads
  the records again at its next round, as the node does; only a download counts as a resync.
  What it trained since its last round is kept if the node's carry rule keeps it
  (``carries_progress``: ``algorithm.carry_epochs``), and it goes on to the round at once; else
  it is dropped.
- **Match** (``node/averaging/matchmaking.py``): announce readiness (visible to others after a
  DHT write); from the census (peer records at epoch r or r - 1, a dead peer's until its record
  lapses) take the node's bucket count and this peer's bucket; wait until every expected peer of
  the bucket is visible (a dead one is asked after ``PROBE_AFTER_SECONDS`` and no longer waited
  for one round trip later, a paused one after the liveness deadline), or the matchmaking
  timeout; notice at the next poll, wait the settle
  time (the node's rule, ``cut.settle_time``, for a store as long as its record's), read once
  more and cut the bucket's visible candidates into groups in the node's own
  order (``groups.py``). In slots (``slots.py``) a record counts only in its slot, up to the
  grace (one signed later joins no group), and the last read is at the slot's cut (the grace)
  plus half a poll and the settle time. Readiness records are withdrawn and lapse as the
  node's do. Peers
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
  dies mid-round leaves its part out (partial): a crashed one once its connections reset (a
  round trip), a paused one after the sender timeout.
- **Churn**: the run's schedule (``churn.py``: kill, stop, start, pause, resume at an epoch,
  a kill "during" a round or a state download), and random sessions from the profiles
  (``session_seconds``: mean of exponential sessions, then ``offline_seconds`` away). A crash
  loses what the peer trained since its last averaged round (``samples_dropped``); the compute
  or round it was in counts in its time all the same.

**Kept samples** are those in the run's final model (``report.samples_in_model``): every round's
state remembers the states its members held and the samples they sent, and the final state (most
live peers' at the newest epoch) is followed back through them. A group's round whose state
the swarm later replaced by another group's is not in it, any more than a download's or a crash's
drop.

Only DiLoCo is modelled (``algorithm.name = "sync"`` is refused). A peer's ``tokens_per_second``
is over its own time online (its sessions together) up to its last inner step, not the run's.

Not modelled: the loss (the model predicts time, bytes and rounds, not convergence), open runs'
checks, contention between different groups on one relay, a partition's local training (a
partitioned peer is modelled as paused), and owners dropping a live member whose chunks come
slower than the sender timeout (a slow link shows as the round deadline, not as that drop).
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Generator
from itertools import islice
from typing import Any

import simpy

from swarmgrad.node.averaging.slots import checks, window_end
from swarmgrad.node.state.sync import carries_progress
from swarmgrad.node.training.window import steps_in_window
from swarmgrad.simulations.des import report
from swarmgrad.simulations.des.board import ModelPeer
from swarmgrad.simulations.des.churning import Churning
from swarmgrad.simulations.des.config import (
    UNCAPPED_BYTES_PER_SECOND,
    Events,
    ModelConfig,
)
from swarmgrad.simulations.des.report import totals

__all__ = [
    "UNCAPPED_BYTES_PER_SECOND",
    "ModelConfig",
    "SwarmModel",
    "simulate",
    "totals",
]

log = logging.getLogger(__name__)

#: Seconds of the model's own running between two progress lines.
PROGRESS_SECONDS = 5.0


class SwarmModel(Churning):
    # -- the run --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        for peer in self.peers[: self.config.nodes]:
            self._start(peer)
        self.env.process(self._churn())
        self.env.process(self._watch())
        self.env.process(self._stall_guard())
        self.env.process(self._progress())
        # The model makes millions of short-lived events, which reference counting frees; the
        # cyclic collector's passes over them were a third of its CPU (1,000 peers x 60 rounds:
        # 49.7 s with it, 30.3 s without, the same peak memory and the same summary).
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.env.run(until=simpy.AnyOf(self.env, [self.done, self._cap()]))
        finally:
            if collecting:
                gc.enable()
        return self.summary()

    def _progress(self) -> Events:
        """A line every ``PROGRESS_SECONDS`` of the model's own time: how far it has come (a
        large swarm takes minutes). It only listens: the model's events are not changed."""
        started = last = time.monotonic()
        while not self.done.triggered:
            yield self.epoch_changed
            now = time.monotonic()
            if now - last >= PROGRESS_SECONDS:
                last = now
                newest = max(p.epoch for p in self.peers)
                log.info(
                    "modelled: epoch %d of %d, %.0f simulated s, in %.0f s",
                    newest, self.config.rounds, self.env.now, now - started,
                )  # fmt: skip

    def _cap(self) -> simpy.Event:
        return self.env.timeout(self.config.max_simulated_seconds)

    def _stall_guard(self) -> Events:
        """Ends a run in which no peer has reached a new epoch for a long while (a swarm that
        cannot form groups any more): the summary says it stalled."""
        slowest = max(p.compute_factor for p in self.config.profiles)
        patience = 10 * (
            max(self.inner_steps, 1 + self.round_seconds / self.config.step_seconds)
            * self.config.step_seconds
            * slowest
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

    # -- one peer's life ------------------------------------------------------------------------

    def _life(self, peer: ModelPeer, *, restarted: bool) -> Events:
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
                step = self.config.step_seconds * peer.profile.compute_factor
                if self.round_seconds:
                    # A window to the slot boundary, with the node's checks on the way: a peer
                    # that missed the last round downloads its outcome then, not at the boundary.
                    end = window_end(env.now, self.round_seconds, step)
                    # Overlapped: it resyncs at the boundary, once the round in flight landed.
                    marks = [] if self.overlap else checks(env.now, end, self.round_seconds)
                    for check in marks:
                        steps = max(0, math.floor((check - env.now) / step + 1e-9))
                        computing, since = True, env.now
                        yield env.timeout(steps * step)
                        self._trained(peer, steps, step)
                        computing, since = False, env.now
                        if self._behind(peer) and (yield from self._resync(peer)):
                            self._record(peer, "resynced", since, 0)
                            break
                    steps = steps_in_window(end - env.now, step)
                else:
                    steps = self.inner_steps
                computing, since = True, env.now
                yield env.timeout(steps * step)
                self._trained(peer, steps, step)
                computing, since = False, env.now
                round_started = env.now
                if self.overlap:
                    if peer.flight is not None:  # the round started at the last boundary lands
                        landed = yield peer.flight
                        peer.flight = None
                        self._landed(peer, landed, round_started)
                        since = round_started = env.now
                    yield env.timeout(self.config.dht_seconds)  # the donors' records, read
                    if self._behind(peer) and (yield from self._resync(peer, carry=True)):
                        self._record(peer, "resynced", round_started, 0)
                    else:
                        peer.communication_seconds += env.now - round_started
                    since = env.now
                    if peer.epoch < self.config.rounds:
                        peer.sending = peer.unaveraged
                        peer.flight = env.process(self._fly(peer))
                    if peer.epoch + 1 >= self.config.rounds and peer.flight is not None:
                        # Its last round: the node trains no more and lands it (``finish``).
                        landed = yield peer.flight
                        peer.flight = None
                        self._landed(peer, landed, since)
                    continue
                yield env.timeout(self.config.dht_seconds)  # the donors' records, read
                if self._behind(peer):
                    resynced = yield from self._resync(peer)
                    if resynced:
                        self._record(peer, "resynced", round_started, 0)
                    if resynced and (not peer.unaveraged or peer.epoch >= self.config.rounds):
                        continue  # dropped (nothing to send until it has trained), or done
                # Not behind, or no donor answered (the node tries again next round).
                peer.sending = peer.unaveraged
                self._landed(peer, (yield from self._round(peer)), round_started)
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

    def _landed(self, peer: ModelPeer, landed: tuple[str, int, Any], waited_from: float) -> None:
        """A round's outcome, as it lands: its state and the next epoch if it averaged (what
        the peer trained since it started, if it was overlapped, goes in the next one);
        recorded with the time the peer waited for it since ``waited_from``."""
        outcome, size, state = landed
        if outcome in ("averaged", "partial"):
            peer.unaveraged -= peer.sending
            peer.state = state
            peer.epoch += 1
            self._announce(peer, peer.epoch)
            self.reached = max(self.reached, peer.epoch)
            self.advances += 1
        peer.sending = 0
        self._record(peer, outcome, waited_from, size)

    def _fly(self, peer: ModelPeer) -> Events:
        """An overlapped round: the peer trains on meanwhile. A crash or pause ends it (its
        all-reduce goes on without the peer)."""
        try:
            return (yield from self._round(peer))
        except simpy.Interrupt:
            return "halted", 0, None

    def _trained(self, peer: ModelPeer, steps: int, step: float) -> None:
        peer.compute_seconds += steps * step
        peer.samples += steps * self.batch
        peer.unaveraged += steps * self.batch
        peer.trained_online = peer.online_seconds + self.env.now - peer.online_since

    def _resync(self, peer: ModelPeer, *, carry: bool = False) -> Generator[simpy.Event, Any, bool]:
        """Download the swarm's state from the live holders of it; whether it did. With none
        (the records of the donors outlive them until they lapse) the node's download fails:
        after a connection refused, or a paused donor's download timeout. What the peer trained
        since its last round is kept if the node's carry rule keeps it (it then goes on to the
        round at once, as the node does), else dropped."""
        self._fire_armed(peer, "state_download")
        newest = self._newest()
        target = (newest, self._best(newest))
        holders = self.holders.get(target, ())
        others = (self.peers[i] for i in holders if i != peer.index)
        donors = list(islice((d for d in others if d.alive and not d.paused), self.max_donors))
        if not donors:
            listed = [self.peers[i] for i in holders if i != peer.index]
            if any(d.alive for d in listed):  # paused: nobody answers
                yield self.env.timeout(self.config.dht_seconds + self.download_timeout)
            elif listed:  # dead: the connection is refused
                latency = max(peer.latency_seconds + d.latency_seconds for d in listed)
                yield self.env.timeout(self.config.dht_seconds + 2 * latency)
            return False
        rate = min(peer.down, sum(d.up for d in donors))
        latency = max(peer.latency_seconds + d.latency_seconds for d in donors)
        yield self.env.timeout(self.config.dht_seconds + 2 * latency + self.state_bytes / rate)
        if not carry and not carries_progress(peer.epoch, target[0], self.carry_epochs):
            peer.dropped += peer.unaveraged
            peer.unaveraged = 0
        peer.epoch, peer.state = target[0], target[1]
        self._announce(peer, peer.epoch)
        return True

    def summary(self) -> dict[str, Any]:
        """The run's summary (``report.py``)."""
        return report.summary(self)


def simulate(config: ModelConfig) -> dict[str, Any]:
    """Run the model once; its summary."""
    return SwarmModel(config).run()
