"""A node's place in the swarm: the parts it is built from, and their lifetimes.

``Swarm`` is what trainers (the CLI's and a researcher's own loop, through
``node/training/api.py``) talk to. It builds the node's parts, each with what it depends on, and
owns them, in start order:

1. the DHT (``discovery/``; first, before any gRPC object: hivemind forks), and the run's
   :class:`PeerDirectory` on it, which refuses a run trained with another spec;
2. the :class:`Transport` (``transport/``): one gRPC server for the Averaging, State and Peer
   services, channels to peers;
3. :class:`Reachability` and punching routes (``reachability/``);
4. :class:`Rounds` (``averaging/``): matchmaking and the all-reduce under one round budget;
5. :class:`StateSync` (``state/``): what this node serves, and downloads when behind;
6. the tasks that keep this node's record fresh and its reachability known.

Trainers run in a worker thread and reach the loop through :meth:`Swarm.call`; everything here
runs on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import torch

from swarmgrad.compression import get_codec
from swarmgrad.node.averaging.averager import Averager, LossProbe
from swarmgrad.node.averaging.matchmaking import Hooks as MatchmakingHooks
from swarmgrad.node.averaging.matchmaking import Matchmaker
from swarmgrad.node.averaging.membership import Membership
from swarmgrad.node.averaging.open.evidence import verify_bytes
from swarmgrad.node.averaging.rounds import Averaged, RoundParts, Rounds
from swarmgrad.node.discovery.base import Discovery
from swarmgrad.node.discovery.directory import PeerDirectory
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.discovery.start import start_discovery
from swarmgrad.node.identity import Identity
from swarmgrad.node.kinds import Failure
from swarmgrad.node.metrics import NodeMetrics
from swarmgrad.node.reachability.dialback import Reachability
from swarmgrad.node.reachability.relay import RelayAdmission
from swarmgrad.node.reachability.routes import PunchRoutes
from swarmgrad.node.reachability.service import PeerService
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.scraped import Links, Tallies
from swarmgrad.node.state.sync import StateParts, StateSync
from swarmgrad.node.swarm_config import (
    MATCHMAKING_SETTLE_SECONDS,
    SwarmConfig,
    allreduce_config,
    round_budget_seconds,
)
from swarmgrad.node.tasks import LoopBridge, TaskSet
from swarmgrad.node.transport.transport import Transport
from swarmgrad.node.trust.allowlist import AllowlistWatcher
from swarmgrad.node.trust.board import BanBoard
from swarmgrad.node.trust.ledger import TrustLedger
from swarmgrad.protocol import stage, state
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.server import Rejections, ServerLimits

log = logging.getLogger(__name__)
T = TypeVar("T")


def stage_message_bytes(spec: RunSpec) -> int:
    """The largest request a pipeline stage server takes: a microbatch as large as the whole
    batch, its inputs and their gradients in fp32, plus headers (0 without a pipeline)."""
    if spec.pipeline.stages < 2:
        return 0
    return stage.max_message_bytes(spec.data.batch_size, spec.model.seq_len, spec.model.d_model)


class Swarm:
    """``async with Swarm(spec, identity, config) as swarm``: this node joined to its run."""

    def __init__(self, spec: RunSpec, identity: Identity, config: SwarmConfig) -> None:
        self.spec, self.identity, self.config = spec, identity, config
        self.peer_id = identity.peer_id
        self.codec = get_codec(spec.averaging.codec)
        self.codec_is_lossless = spec.averaging.codec == "none"
        #: What happened to this node, by event, and its failures by kind.
        self.tallies = Tallies()
        self.metrics = NodeMetrics(
            peer_id=self.peer_id,
            run_id=spec.run.id,
            spec_hash=spec.short_hash,
            algorithm=spec.algorithm.name,
            codec=spec.averaging.codec,
        )
        #: A private run's allowlist (None: anyone may take part).
        self.allowlist = (
            AllowlistWatcher(spec.trust.run_key, self.peer_id) if spec.trust.private else None
        )
        #: Checks every signed request this node receives (one replay memory for all services).
        self.verifier = Verifier(
            self.peer_id, admit=self.allowlist.allowed if self.allowlist is not None else None
        )
        #: Requests this node's services refused, by service and result code.
        self.rejections = Rejections()
        # What does not need the DHT is built now; the rest once it runs (__aenter__).
        rounds = allreduce_config(spec)
        self.routes = PunchRoutes(
            identity,
            spec,
            host=config.host,
            public_host=lambda: self.peer_service.public_host(),
            enabled=config.reachability.punch,
        )
        limits = ServerLimits(
            max_message_bytes=max(
                2 * rounds.max_chunk_bytes, state.MAX_MESSAGE_BYTES, stage_message_bytes(spec)
            )
        )
        self.transport = Transport(
            config.transport(limits), route=self.routes.resolve, rejections=self.rejections
        )
        self.state = StateSync(
            StateParts(
                identity=identity,
                spec=spec,
                transport=self.transport,
                verifier=self.verifier,
                rejections=self.rejections,
                tallies=self.tallies,
                observe_seconds=self.metrics.state_sync_duration.observe,
            ),
            config.state_sync(),
        )
        self.peer_service = PeerService(
            identity,
            spec,
            self.transport,
            verifier=self.verifier,
            rejections=self.rejections,
            punch=config.reachability.punch,
        )
        self._averager = Averager(
            identity,
            rounds,
            self.transport,
            verifier=self.verifier,
            rejections=self.rejections,
            ledger=TrustLedger(store=config.bans_path if spec.trust.open else None),
        )
        #: Whose readiness counts in matchmaking: peers it averaged with lately, the
        #: allowlist's, newcomers that answer a probe (``averaging/membership.py``).
        self.membership = Membership(
            self.peer_service.alive,
            allowed=self.allowlist.allowed if self.allowlist is not None else None,
        )
        self._discovery: Discovery | None = None
        self.directory: PeerDirectory | None = None
        self.reachability: Reachability | None = None
        self._rounds: Rounds | None = None
        self._bridge = LoopBridge()
        self._tasks = TaskSet()
        self.throughput = 0.0  # samples/s, announced
        #: More of this node's record, as it is now (a stage replica's stage fields).
        self.describe: Callable[[], dict[str, Any]] = dict
        self.metrics.read_tallies(traffic=self._traffic_totals, failures=self._failure_totals)
        self.metrics.read_links(self._links)
        self.metrics.read_relay(self._relay_counts)
        self.metrics.read_rejections(self.rejections.snapshot)
        #: Open runs: bans published with their evidence, read and checked (None otherwise).
        self.board: BanBoard | None = None
        if spec.trust.open:
            ledger = self._averager.ledger
            checks = self._averager.checks
            self.board = board = BanBoard(
                ledger,
                me=self.peer_id,
                verify=functools.partial(verify_bytes, run_id=spec.run.id, spec_hash=spec.hash),
            )
            self.metrics.read_trust(
                lambda: (ledger.table(), (*ledger.counts(), dict(checks), dict(board.counts)))
            )
        sample = torch.randn(  # its own generator: the process's random stream is the user's
            min(spec.averaging.chunk_values, 1 << 16), generator=torch.Generator().manual_seed(0)
        )
        self.metrics.compression_ratio.set(sample.nbytes / len(self.codec.encode(sample)[0]))

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> Swarm:
        if self._bridge.released:  # its transport, averager and tasks are closed for good
            raise RuntimeError("this Swarm was closed: make a new one to join again")
        self._bridge.attach(asyncio.get_running_loop())
        spec, config = self.spec, self.config
        self._discovery = await start_discovery(
            config.discovery_config(), self.identity, run_id=spec.run.id, spec_hash=spec.hash
        )
        try:
            self.directory = PeerDirectory(
                self._discovery,
                spec,
                config.directory(),
                own_record=self._own_record,
                tallies=self.tallies,
                seen=self.metrics.peers.set,
            )
            await self.directory.check_spec()
            await self.transport.__aenter__()
            self.reachability = Reachability(
                self.identity,
                spec,
                self.transport,
                peers=self.directory.refresh,
                changed=self.directory.changed,
                # Its relay serves the run's peers (a live record), and only the allowed ones.
                admit=RelayAdmission(
                    peers=lambda: self.peers,
                    reread=self.directory.refresh,
                    allowed=self.allowlist.allowed if self.allowlist is not None else None,
                ),
                config=config.reachability,
            )
            matchmaker = Matchmaker(
                self._discovery,
                self.identity,
                group_size=spec.averaging.group_size,
                matchmaking_timeout_seconds=spec.averaging.matchmaking_timeout_seconds,
                settle_seconds=MATCHMAKING_SETTLE_SECONDS,
                hooks=MatchmakingHooks(
                    peers=self.directory.refresh,
                    excluded=self.excludes,
                    avoiding=self._averager.ledger.newest_bans,
                    membership=self.membership,
                    expect=self._averager.expect,
                ),
            )
            budget = round_budget_seconds(
                spec, config, dht_call_seconds=self._discovery.call_timeout_seconds
            )
            self._rounds = Rounds(
                RoundParts(
                    matchmaker=matchmaker,
                    averager=self._averager,
                    directory=self.directory,
                    reachability=self.reachability,
                    routes=self.routes,
                    tallies=self.tallies,
                    spawn=self._spawn,
                    membership=self.membership,
                ),
                config.rounds(budget_seconds=budget),
            )
            if self.allowlist is not None:
                self.allowlist.read = self._discovery.find_allowlists
                await self.allowlist.refresh()
                self._spawn(self.allowlist.run(), "allowlist")
            if self.board is not None:
                discovery = self._discovery
                self.board.read = discovery.find_bans
                self.board.publish = lambda body, until: discovery.publish_bans(
                    body, expires_at=until
                )
                self._spawn(self.board.run(), "ban-records")
            await self.directory.join()
            self._spawn(self.directory.keep_fresh(), "announce")
            self._spawn(self.reachability.run(), "reachability")
            self.peer_service.attach(self.reachability, self.transport.port)
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
        if self.directory is not None:
            await self.directory.leave()
        await self.routes.close()
        await self.peer_service.close()  # and reachability: unmap ports, leave relays
        await self.transport.close()  # stop serving (with its grace), then the rounds
        await self._averager.stop()
        await self.membership.close()  # its questions still open
        if self._discovery is not None:
            await self._discovery.close()
            self._discovery = None

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.spawn(coro, name)

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
        return self._discovery.visible_maddrs() if self._discovery is not None else []

    def reachability_summary(self) -> dict[str, Any]:
        """How peers reach this node, and what it relays for others."""
        return self.peer_service.summary(self.routes)

    def _links(self) -> Links:
        return self.peer_service.links(self.routes, self.peers, self.peer_id)

    def _relay_counts(self) -> Counter[str]:
        relay = self.reachability.relay_server if self.reachability is not None else None
        return relay.counts if relay is not None else Counter()

    def _traffic_totals(self) -> dict[tuple[str, str], int]:
        averaging = self.traffic
        return {
            ("sent", "averaging"): averaging["sent"],
            ("received", "averaging"): averaging["received"],
            ("sent", "state"): self.state.servicer.sent_bytes,
            ("received", "state"): self.state.received_bytes,
        }

    def _failure_totals(self) -> Counter[str]:
        # Streams our servicer rejected are violations by the peers that sent them.
        return self.failures + Counter({Failure.PROTOCOL_VIOLATION: self.rejections.total()})

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
        assert self._discovery is not None
        return await self._discovery.for_run(spec.run.id, spec.hash).find()

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
        if self._averager.ledger.banned(peer_id):
            return True
        return self.allowlist is not None and not self.allowlist.allowed(peer_id)

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
    ) -> Averaged:
        """One round (``averaging/rounds.py``): a group for ``epoch``, then the all-reduce."""
        assert self._rounds is not None
        return await self._rounds.run(vector, epoch=epoch, weight=weight, keep_sent=keep_sent)

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
