"""The model's shared state (``ModelState``): the peers, the rounds' boards, and the census of
live peer records (which epoch and state each announces: what matchmaking counts and what
the resync rule reads)."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Hashable
from typing import Any

import simpy

from swarmgrad.node.averaging.plan import AllReduceConfig
from swarmgrad.node.discovery.directory import DirectoryConfig
from swarmgrad.node.state.sync import StateSyncConfig
from swarmgrad.node.swarm_config import allreduce_config
from swarmgrad.node.training.model import parameter_count
from swarmgrad.simulations.churn import ChurnEvent
from swarmgrad.simulations.des.board import Board, ModelPeer, majority
from swarmgrad.simulations.des.config import Events, ModelConfig
from swarmgrad.simulations.profiles import SimulationError


class ModelState:
    """What every part of the model reads and writes: the clock, the peers, the boards, the
    census. ``rounds.Rounds`` and ``model.SwarmModel`` build on it."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        spec = config.spec
        self.allreduce: AllReduceConfig = allreduce_config(spec)
        self.params = parameter_count(spec.model)
        self.state_bytes = 2 * 4 * self.params  # theta and the outer momentum, fp32
        self.group_size = spec.averaging.group_size
        self.matchmaking_timeout = spec.averaging.matchmaking_timeout_seconds
        self.record_ttl = DirectoryConfig().record_ttl_seconds
        self.max_donors = StateSyncConfig().max_donors
        self.download_timeout = StateSyncConfig().download_timeout_seconds
        self.inner_steps = spec.algorithm.inner_steps
        self.carry_epochs = spec.algorithm.carry_epochs
        self.round_seconds = spec.algorithm.round_seconds
        self.overlap = spec.algorithm.overlap
        self.batch = spec.data.batch_size
        self.env = simpy.Environment()
        self.rng = random.Random(f"swarmgrad-des:{config.seed}")
        self.peers = [
            ModelPeer(index=i, peer_id=f"peer-{i:06d}", profile=p)
            for i, p in enumerate(config.profiles)
        ]
        self.by_id = {p.peer_id: p for p in self.peers}
        direct = [p.index for p in self.peers if p.profile.nat == "direct"]
        for peer in self.peers:
            if peer.profile.nat == "relayed":
                if not direct:
                    raise SimulationError("a relayed peer needs a direct peer to relay it")
                peer.relay = self.rng.choice(direct)
        self.boards: dict[int, Board] = {}
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
        #: Bumped whenever a peer's life (alive, paused) or its DHT record (epoch, lapse)
        #: changes: what cached reads of who is still awaited (``Rounds._awaited``) are keyed by.
        self.peer_changes = 0
        #: The live peer records, by the epoch they announce (the matchmaking census).
        self.census: dict[int, set[int]] = {}
        #: The states the live records announce, by epoch, and who holds each.
        self.votes: dict[int, Counter[Hashable]] = {}
        self.holders: dict[tuple[int, Hashable], set[int]] = {}
        #: Every state a round made: the states its members held before it and the samples
        #: it added (what ``report.samples_in_model`` follows back from the final state).
        self.lineage: dict[Hashable, tuple[tuple[Hashable, ...], float]] = {"init": ((), 0.0)}

    # -- progress and each round's record ----------------------------------------------------

    def _advanced(self) -> None:
        changed, self.epoch_changed = self.epoch_changed, self.env.event()
        changed.succeed()

    def _record(self, peer: ModelPeer, outcome: str, started: float, group_size: int) -> None:
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

    # -- peer records (the census) --------------------------------------------------------------

    def _best(self, epoch: int) -> Hashable | None:
        """The state most live records at ``epoch`` announce (ties: the smallest checksum)."""
        votes = self.votes.get(epoch)
        return majority(votes) if votes else None

    def _newest(self) -> int:
        """The swarm's epoch as ``pick_donors`` reads it: the newest a live peer record announces
        (a dead peer's until it lapses), not the newest ever reached."""
        return max(self.census, default=0)

    def _behind(self, peer: ModelPeer) -> bool:
        """The node's resync rule (``pick_donors``): the swarm is at a newer epoch, or most peers
        at this one hold another state (a group that averaged apart from the majority's)."""
        if self._newest() > peer.epoch:
            return True
        best = self._best(peer.epoch)
        return best is not None and best != peer.state

    def _announce(self, peer: ModelPeer, epoch: int) -> None:
        self._unlist(peer)
        peer.record_epoch, peer.record_state = epoch, peer.state
        peer.record_lapses_at = math.inf
        peer.record_token += 1
        self.peer_changes += 1
        self.census.setdefault(epoch, set()).add(peer.index)
        self.votes.setdefault(epoch, Counter())[peer.state] += 1
        self.holders.setdefault((epoch, peer.state), set()).add(peer.index)

    def _unlist(self, peer: ModelPeer) -> None:
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
        self.peer_changes += 1

    def _lapse(self, peer: ModelPeer) -> Events:
        """A peer that stopped announcing: its record is gone once its time to live passes."""
        token = peer.record_token
        peer.record_lapses_at = self.env.now + self.record_ttl
        self.peer_changes += 1
        yield self.env.timeout(self.record_ttl)
        if peer.record_token == token:
            self._unlist(peer)

    def _fire_armed(self, peer: ModelPeer, phase: str) -> None:
        """A kill armed for ``peer``'s ``phase`` goes off (the churn's: ``model.py``)."""
        raise NotImplementedError
