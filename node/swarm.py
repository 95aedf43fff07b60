"""A node's place in the swarm: the parts it is made of, and their lifetimes.

``Swarm`` is what trainers (the CLI's and a researcher's own loop, through
``node/training/api.py``) talk to. Its parts are built in ``node/swarm_parts.py``, each by its
own room's constructor, and started in this order when the node joins:

1. the DHT (``discovery/``; first, before any gRPC object: hivemind forks), and the run's
   :class:`PeerDirectory` on it, which refuses a run trained with another spec;
2. the :class:`Transport` (``transport/``): one gRPC server for the Averaging, State and Peer
   services, channels to peers;
3. :class:`Reachability` and punching routes (``reachability/``);
4. :class:`Rounds` (``averaging/``): matchmaking and the all-reduce under one round budget;
5. :class:`StateSync` (``state/``): what this node serves, and downloads when behind;
6. the tasks that keep this node's record fresh and its reachability known (and, in private
   and open runs, its allowlist and ban records).

Trainers run in a worker thread and reach the loop through :meth:`Swarm.call`; everything here
runs on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import torch

from swarmgrad.node.averaging.averager import LossProbe
from swarmgrad.node.averaging.rounds import Averaged
from swarmgrad.node.discovery.directory import PeerDirectory
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.identity import Identity
from swarmgrad.node.reachability.dialback import Reachability
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.swarm_config import SwarmConfig
from swarmgrad.node.swarm_metrics import watch
from swarmgrad.node.swarm_parts import Joined, Parts, build_parts, excluded, join_parts
from swarmgrad.node.tasks import LoopBridge, TaskSet
from swarmgrad.node.trust.board import BanBoard
from swarmgrad.node.trust.ledger import TrustLedger
from swarmgrad.protocol import state

log = logging.getLogger(__name__)
T = TypeVar("T")


class Swarm:
    """``async with Swarm(spec, identity, config) as swarm``: this node joined to its run.

    Its parts are built by :func:`~swarmgrad.node.swarm_parts.build_parts` (or passed in as
    ``parts``) and, once it joins, :func:`~swarmgrad.node.swarm_parts.join_parts`; ``describe``
    adds to this node's record as it is at each announcement (a stage replica's stage fields).
    """

    def __init__(
        self,
        spec: RunSpec,
        identity: Identity,
        config: SwarmConfig,
        *,
        describe: Callable[[], dict[str, Any]] = dict,
        parts: Parts | None = None,
    ) -> None:
        self.spec, self.identity, self.config = spec, identity, config
        self.peer_id = identity.peer_id
        self.describe = describe
        self.parts = parts = parts if parts is not None else build_parts(spec, identity, config)
        self.codec, self.codec_is_lossless = parts.codec, spec.averaging.codec == "none"
        #: Whether this node, as a part's owner, keeps an error-feedback residual of its results
        #: (the traits of the codec its rounds send results in say).
        self.owner_feedback = parts.averager.config.make_result_codec().traits.owner_feedback
        self.tallies, self.metrics = parts.tallies, parts.metrics
        self.allowlist, self.verifier, self.rejections = (
            parts.allowlist,
            parts.verifier,
            parts.rejections,
        )
        self.routes, self.transport, self.state = parts.routes, parts.transport, parts.state
        self.peer_service, self.membership = parts.peer_service, parts.membership
        self._averager = parts.averager
        self._joined: Joined | None = None
        self._bridge = LoopBridge()
        self._tasks = TaskSet()
        self.throughput = 0.0  # samples/s, announced
        watch(self)

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> Swarm:
        if self._bridge.released:  # its transport, averager and tasks are closed for good
            raise RuntimeError("this Swarm was closed: make a new one to join again")
        self._bridge.attach(asyncio.get_running_loop())
        try:
            self._joined = await join_parts(
                self.spec,
                self.identity,
                self.config,
                self.parts,
                own_record=self._own_record,
                tasks=self._tasks,
            )
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._close()

    async def _close(self) -> None:
        """Graceful leave: withdraw the record, stop serving (with a grace period), stop the DHT."""
        self.release_waiters()
        await self._tasks.close()
        joined, self._joined = self._joined, None
        if joined is not None:
            await joined.directory.leave()
        await self.routes.close()
        await self.peer_service.close()  # and reachability: unmap ports, leave relays
        await self.transport.close()  # stop serving (with its grace), then the rounds
        await self._averager.stop()
        await self.membership.close()  # its questions still open
        if joined is not None:
            await joined.discovery.close()

    @property
    def directory(self) -> PeerDirectory | None:
        """The run's peers in the DHT (None until this node joined)."""
        return self._joined.directory if self._joined is not None else None

    @property
    def reachability(self) -> Reachability | None:
        """How peers reach this node (None until it joined)."""
        return self._joined.reachability if self._joined is not None else None

    @property
    def board(self) -> BanBoard | None:
        """Open runs: bans published with their evidence, read and checked (None otherwise,
        and until this node joined)."""
        return self._joined.board if self._joined is not None else None

    @property
    def ban_counts(self) -> Counter[str]:
        """Ban records read, by outcome, and published (:class:`BanBoard`)."""
        board = self.board
        return board.counts if board is not None else Counter()

    # -- what the trainer, the CLI and the metrics read ----------------------------------------

    @property
    def endpoint(self) -> str:
        """Where peers dial this node: its own address, a mapped port, or its relay's."""
        if self.reachability is not None:
            return self.reachability.endpoint
        return self.transport.endpoint

    @property
    def ledger(self) -> TrustLedger:
        """What this node thinks of the peers it aggregated, and whom it banned (open runs)."""
        return self._averager.ledger

    def use_loss_probe(self, probe: LossProbe) -> None:
        """Spot-check members' values by the loss they take off (open runs; the trainer, who
        has the model and data, gives the probe: ``node/training/spot_check.py``)."""
        self._averager.loss_probe = probe

    @property
    def owner_checks(self) -> Counter[str]:
        """Owners' results this node checked after open rounds: "checked", "failed"."""
        return self._averager.checks

    @property
    def peers(self) -> list[PeerRecord]:
        """The run's trainers as last read from the DHT (this node included)."""
        return self.directory.peers if self.directory is not None else []

    @property
    def counts(self) -> Counter[str]:
        """Rounds by outcome, state downloads, and errors, by kind."""
        return self.tallies.counts

    @property
    def failures(self) -> Counter[str]:
        """Failures by kind (:data:`swarmgrad.node.scraped.FAILURE_KINDS`)."""
        return self.tallies.failures

    @property
    def snapshot(self) -> state.Snapshot | None:
        return self.state.snapshot

    @property
    def traffic(self) -> Counter[str]:
        """Averaging payload bytes ``sent`` and ``received`` by this node."""
        return self._averager.traffic

    def visible_maddrs(self) -> list[str]:
        return self._joined.discovery.visible_maddrs() if self._joined is not None else []

    def reachability_summary(self) -> dict[str, Any]:
        """How peers reach this node, and what it relays for others."""
        return self.peer_service.summary(self.routes)

    # -- this node's record -------------------------------------------------------------------

    def _own_record(self, now: float, ttl_seconds: float) -> PeerRecord:
        snapshot = self.state.snapshot
        reach = self.reachability_summary()
        return PeerRecord.create(
            self.peer_id,
            run_id=self.spec.run.id,
            spec_hash=self.spec.hash,
            endpoint=self.endpoint,
            now=now,
            ttl_seconds=ttl_seconds,
            epoch=snapshot.epoch if snapshot is not None else 0,
            checksum=snapshot.checksum if snapshot is not None else "",
            throughput=self.throughput,
            bandwidth=self.config.bandwidth,
            reachability=reach["reachability"],
            relay=reach["relay"],
            via=reach["via"],
            punched=self.routes.num_punched(),
            **self.describe(),
        )

    def publish(self, snapshot: state.Snapshot, *, throughput: float) -> None:
        """Serve ``snapshot`` to peers and announce its epoch and checksum; thread-safe."""
        self.state.publish(snapshot)
        self.throughput = throughput
        self.reannounce()

    def announce_throughput(self, samples_per_second: float) -> None:
        """Announce a new throughput (samples/s) in this node's record soon; thread-safe."""
        self.throughput = samples_per_second
        self.reannounce()

    def reannounce(self) -> None:
        """Announce this node's record again soon (it changed); thread-safe."""
        if self.directory is not None:
            self._bridge.soon(self.directory.changed)

    async def records_of(self, spec: RunSpec) -> list[PeerRecord]:
        """The peer records of another run on this node's DHT (a pipeline's other stages)."""
        assert self._joined is not None
        return await self._joined.discovery.for_run(spec.run.id, spec.hash).find()

    async def refresh_peers(self) -> list[PeerRecord]:
        assert self.directory is not None
        return await self.directory.refresh()

    # -- state and rounds -------------------------------------------------------------------------

    async def find_donors(self, epoch: int, checksum: str) -> list[PeerRecord]:
        """Peers to download state from if this node is behind or diverged."""
        assert self.directory is not None
        peers = [p for p in await self.directory.refresh() if not self.excludes(p.peer_id)]
        return self.state.find_donors(peers, epoch, checksum)

    def excludes(self, peer_id: str) -> bool:
        """Peers this node does not average with or learn from: banned by its ledger (open
        runs), or not on the allowlist (private runs)."""
        return excluded(self._averager.ledger, self.allowlist, peer_id)

    async def download_state(
        self, donors: list[PeerRecord], num_values: int
    ) -> state.Snapshot | None:
        """The state ``donors`` announce (all the same checksum), from all of them at once."""
        return await self.state.download(donors, num_values, routes=self.routes)

    async def average(
        self,
        vector: torch.Tensor,
        *,
        epoch: int,
        weight: float,
        keep_sent: bool = False,
        owner_residual: torch.Tensor | None = None,
    ) -> Averaged:
        """One round (``averaging/rounds.py``): a group for ``epoch``, then the all-reduce
        (``owner_residual``: this node's feedback as an owner, over ``vector``'s values; only
        read: the result holds its part moved on, ``RoundResult.owner_residual``)."""
        assert self._joined is not None
        return await self._joined.rounds.run(
            vector, epoch=epoch, weight=weight, keep_sent=keep_sent, owner_residual=owner_residual
        )

    # -- the trainer's thread -------------------------------------------------------------------

    def release_waiters(self) -> None:
        """Let go of trainer threads waiting in :meth:`call` (they get ``CancelledError``)."""
        self._bridge.release()

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the node's loop from a trainer thread and wait for its result.

        Raises ``concurrent.futures.CancelledError`` once the node is stopping.
        """
        return self._bridge.call(coroutine)

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coroutine`` on the node's loop from a trainer thread; wait later (its future
        is cancelled once the node is stopping)."""
        return self._bridge.submit(coroutine)
