"""A node's place in the swarm: discovery, matchmaking, averaging and state, behind one object.

``Swarm`` is what trainers (the CLI's and a researcher's own loop, through ``node/training/api.py``)
talk to. It owns, in start order: the DHT (first, before any gRPC object: hivemind forks), the
check that this node's run spec is the swarm's, the gRPC server with the Averaging and State
services, and a task that keeps this node's signed peer record fresh (endpoint, epoch, checksum
of its replicated state). Trainers run in a worker thread and reach the loop through
:meth:`Swarm.call`; everything here runs on the loop.

One outer round, as a trainer sees it (:meth:`Swarm.average`): form a group for the epoch through
the DHT, let the trainer prepare its vector for that group (error feedback needs the group's
chunking), all-reduce. Each way a round can fail is an :class:`Outcome` the trainer handles, counts
and survives; none raises.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import importlib.metadata
import logging
import random
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from swarmgrad.compression import codec_names, get_codec
from swarmgrad.node.averaging.allreduce import AllReduceConfig, RoundResult
from swarmgrad.node.averaging.averager import Averager
from swarmgrad.node.averaging.group import Group
from swarmgrad.node.averaging.matchmaking import Matchmaker
from swarmgrad.node.discovery.base import (
    BACKENDS,
    Discovery,
    DiscoveryError,
    dht_time,
    start_discovery,
)
from swarmgrad.node.discovery.envelope import MAX_TTL_SECONDS
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.identity import Identity
from swarmgrad.node.metrics import Links, NodeMetrics
from swarmgrad.node.reachability.dialback import Reachability, ReachabilityConfig
from swarmgrad.node.reachability.punch import PunchResponder, PunchRoute
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.transport.transport import Transport, TransportConfig
from swarmgrad.protocol import peer, state
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.errors import RoundAborted, SwarmgradError
from swarmgrad.protocol.server import Rejections, ServerLimits

log = logging.getLogger(__name__)
T = TypeVar("T")
SERVED_STATES = 3
#: A readiness record stays this long after its group is formed (past matchmaking's settle
#: time), for group mates still reading the candidates, then it is withdrawn.
WITHDRAW_MARGIN_SECONDS = 2.5
#: Room under the DHT's lifetime cap for a leave, which outlives the record it withdraws.
MAX_RECORD_TTL_SECONDS = MAX_TTL_SECONDS - 30.0


class SpecMismatch(RuntimeError):
    """This node's run spec differs from the one the run's peers use; the message says how."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SwarmConfig:
    """How this node joins (operational: nothing here is part of the run spec's hash)."""

    host: str = "127.0.0.1"
    port: int = 0
    public_host: str = ""  # the address peers dial, if not host
    bootstrap: tuple[str, ...] = ()
    #: The DHT backend (:data:`swarmgrad.node.discovery.base.BACKENDS`); a run's nodes share one.
    discovery: str = "hivemind"
    #: libp2p only: a private run's DHT key; its DHT then never merges with any other.
    dht_secret: str = ""
    #: Relative upload capacity: the share of each round's vector this node owns.
    bandwidth: float = 1.0
    #: Cap on this node's averaging uploads (a token bucket), for simulated slow links.
    upload_bytes_per_second: float | None = None
    record_ttl_seconds: float = 60.0
    announce_interval_seconds: float = 15.0
    dht_start_timeout_seconds: float = 60.0
    state_download_timeout_seconds: float = 60.0
    #: Donors a state download draws on at once.
    max_state_donors: int = 4
    #: How this node learns and fixes its reachability (dial-back, UPnP, relays).
    reachability: ReachabilityConfig = field(default_factory=ReachabilityConfig)
    #: How long a first round waits for that verdict when there are peers to ask.
    reachability_wait_seconds: float = 15.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.discovery not in BACKENDS:
            raise ValueError(f"discovery must be one of {', '.join(BACKENDS)}: {self.discovery!r}")
        if self.dht_secret and self.discovery != "libp2p":
            raise ValueError("a DHT secret needs the libp2p discovery backend")
        if not self.bandwidth > 0:
            raise ValueError("bandwidth must be positive")
        if self.upload_bytes_per_second is not None and not self.upload_bytes_per_second > 0:
            raise ValueError("upload_bytes_per_second must be positive")
        if not 0 < self.announce_interval_seconds < self.record_ttl_seconds:
            raise ValueError("announce_interval_seconds must be positive and below the TTL")
        if self.record_ttl_seconds > MAX_RECORD_TTL_SECONDS:
            raise ValueError(
                f"record_ttl_seconds must be at most {MAX_RECORD_TTL_SECONDS:g} (the DHT refuses "
                "longer-lived values)"
            )


class Outcome(enum.Enum):
    AVERAGED = "averaged"
    NO_GROUP = "no group"  # nobody else was ready in time: train on
    ABORTED = "aborted"  # the group formed but the all-reduce produced nothing


@dataclass(frozen=True, slots=True)
class Averaged:
    outcome: Outcome
    result: RoundResult | None = None
    group: Group | None = None
    sent: torch.Tensor | None = None  # what this node contributed (after any preparation)
    error: str = ""
    seconds: float = 0.0  # the all-reduce's own duration


def allreduce_config(spec: RunSpec) -> AllReduceConfig:
    averaging = spec.averaging
    return AllReduceConfig(
        run_id=spec.run.id,
        spec_hash=spec.hash,
        codec=averaging.codec,
        chunk_values=averaging.chunk_values,
        round_timeout_seconds=averaging.round_timeout_seconds,
        sender_timeout_seconds=averaging.sender_timeout_seconds,
        reducer_timeout_seconds=averaging.reducer_timeout_seconds,
    )


def pick_donors(peers: list[PeerRecord], me: str, epoch: int, checksum: str) -> list[PeerRecord]:
    """The peers to resync from (all hold the same state), or none if this replica is in step.

    The swarm's state is the newest epoch any peer announces, and at that epoch the checksum
    most peers share (ties go to the smallest checksum, so every replica picks the same one;
    this replica's own vote counts). A replica behind that epoch, or at it with another
    checksum, downloads the state from the peers that have it.
    """
    others = [p for p in peers if p.peer_id != me and p.checksum]
    if not others:
        return []
    newest = max(epoch, *(p.epoch for p in others))
    votes = Counter(p.checksum for p in others if p.epoch == newest)
    if epoch == newest:
        votes[checksum] += 1
    best = min(votes, key=lambda c: (-votes[c], c))
    if epoch == newest and best == checksum:
        return []
    return [p for p in others if p.epoch == newest and p.checksum == best]


class Swarm:
    """``async with Swarm(spec, identity, config) as swarm``: this node joined to its run."""

    def __init__(self, spec: RunSpec, identity: Identity, config: SwarmConfig) -> None:
        self.spec, self.identity, self.config = spec, identity, config
        self.peer_id = identity.peer_id
        self._discovery: Discovery | None = None
        self.reachability: Reachability | None = None
        self._routes: dict[str, PunchRoute] = {}  # relayed endpoint -> its punching route
        self._waited = False  # for a reachability verdict, before the first round
        self._matchmaker: Matchmaker | None = None
        self._snapshot: state.Snapshot | None = None
        #: The last few states published, by root: a download that began before this node moved
        #: on still completes.
        self._served: dict[str, state.Snapshot] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._refresh = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._closing = False
        rounds = allreduce_config(spec)
        self.transport = Transport(
            TransportConfig(
                host=config.host,
                port=config.port,
                public_host=config.public_host,
                limits=ServerLimits(
                    max_message_bytes=max(2 * rounds.max_chunk_bytes, state.MAX_MESSAGE_BYTES)
                ),
                upload_bytes_per_second=config.upload_bytes_per_second,
            ),
            route=self._route,
        )
        #: Checks every signed request this node receives (one replay memory for all services).
        self.verifier = Verifier(self.peer_id)
        #: Requests this node's services refused, by service and result code.
        self.rejections = Rejections()
        self.state_servicer = state.StateServicer(
            run_id=spec.run.id,
            spec_hash=spec.hash,
            lookup=self._served.get,
            verifier=self.verifier,
            rejections=self.rejections,
            pace=self.transport.pace if self.transport.paced else None,
        )
        self.transport.register(lambda server: state.add_to_server(self.state_servicer, server))
        self._punch_responder: PunchResponder | None = None
        self.peer_servicer = peer.PeerServicer(
            peer.PeerIdentity(
                peer_id=self.peer_id,
                run_id=spec.run.id,
                spec_hash=spec.hash,
                software_version=_software_version(),
                codecs=tuple(codec_names()),
            ),
            signer=identity,
            verifier=self.verifier,
            rejections=self.rejections,
            punch=self._punch_handler(),
            origin=self._origin,
        )
        self.transport.register(lambda server: peer.add_to_server(self.peer_servicer, server))
        self._averager = Averager(
            identity, rounds, self.transport, verifier=self.verifier, rejections=self.rejections
        )
        self.codec = get_codec(spec.averaging.codec)
        self.codec_is_lossless = spec.averaging.codec == "none"
        #: Rounds by outcome, state downloads, and errors, by kind.
        self.counts: Counter[str] = Counter()
        #: Failures by kind (:data:`swarmgrad.node.metrics.FAILURE_KINDS`).
        self.failures: Counter[str] = Counter()
        self._state_received_bytes = 0
        self.metrics = NodeMetrics(
            peer_id=self.peer_id,
            run_id=spec.run.id,
            spec_hash=spec.short_hash,
            algorithm=spec.algorithm.name,
            codec=spec.averaging.codec,
        )
        self.metrics.read_tallies(traffic=self._traffic_totals, failures=self._failure_totals)
        self.metrics.read_links(self._links)
        self.metrics.read_rejections(self.rejections.snapshot)
        sample = torch.randn(  # its own generator: the process's random stream is the user's
            min(spec.averaging.chunk_values, 1 << 16), generator=torch.Generator().manual_seed(0)
        )
        self.metrics.compression_ratio.set(sample.nbytes / len(self.codec.encode(sample)[0]))
        #: The run's trainers as last read from the DHT (this node included).
        self.peers: list[PeerRecord] = []
        self.throughput = 0.0  # samples/s, announced

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> Swarm:
        self._loop = asyncio.get_running_loop()
        self._discovery = await start_discovery(
            self.config.discovery,
            self.identity,
            run_id=self.spec.run.id,
            spec_hash=self.spec.hash,
            initial_peers=self.config.bootstrap,
            host=self.config.host,
            network_secret=self.config.dht_secret,
            start_timeout_seconds=self.config.dht_start_timeout_seconds,
        )
        try:
            await self._check_spec()
            await self.transport.__aenter__()
            self.reachability = Reachability(
                self.identity,
                run_id=self.spec.run.id,
                spec_hash=self.spec.hash,
                host=self.config.host,
                port=self.transport.port,
                public_host=self.config.public_host,
                peers=self._discovery.find,
                changed=self._refresh.set,
                config=self.config.reachability,
            )
            self._matchmaker = Matchmaker(
                self._discovery,
                self.identity,
                group_size=self.spec.averaging.group_size,
                matchmaking_timeout_seconds=self.spec.averaging.matchmaking_timeout_seconds,
            )
            try:
                await self._announce()
            except DiscoveryError as error:  # the announce loop tries again: not fatal
                self.counts["announce failed"] += 1
                self.failures["discovery"] += 1
                log.warning("could not announce this node yet: %s", error)
            self._spawn(self._keep_announcing(), "announce")
            self._spawn(self.reachability.run(), "reachability")
            if self._punch_responder is not None:
                self._punch_responder.target = (self.config.host, self.transport.port)
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._close()

    async def _close(self) -> None:
        """Graceful leave: withdraw the record, stop serving (with a grace period), stop the DHT."""
        self.release_waiters()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._discovery is not None:
            try:
                await self._discovery.leave()
            except DiscoveryError as error:
                log.warning("could not announce leave: %s", error)
        for route in self._routes.values():
            await route.close()
        self._routes.clear()
        if self._punch_responder is not None:
            await self._punch_responder.close()
        if self.reachability is not None:
            await self.reachability.close()  # its task is cancelled above; unmap, leave relays
        await self.transport.close()  # stop serving (with its grace), then the rounds
        await self._averager.stop()
        if self._discovery is not None:
            await self._discovery.close()
            self._discovery = None

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def endpoint(self) -> str:
        """Where peers dial this node: its own address, a mapped port, or its relay's."""
        if self.reachability is not None:
            return self.reachability.endpoint
        return self.transport.endpoint

    def _links(self) -> Links:
        summary = self.reachability_summary()
        others = Counter(
            "punched"
            if p.endpoint in self._routes and self._routes[p.endpoint].counts["punched"]
            else p.reachability
            for p in self.peers
            if p.peer_id != self.peer_id
        )
        return Links(
            reachability=summary["reachability"],
            peers=others,
            relay_clients=summary["relay_clients"],
            relayed_bytes=summary["relayed_bytes"],
        )

    def reachability_summary(self) -> dict[str, Any]:
        """How peers reach this node, and what it relays for others."""
        reach = self.reachability
        relay = reach.relay_server if reach is not None else None
        return {
            "reachability": reach.kind if reach is not None else "unknown",
            "via": reach.via if reach is not None else "",
            "relay": reach.relay_endpoint if reach is not None else "",
            "relay_clients": relay.clients if relay is not None else 0,
            "relayed_bytes": sum(relay.traffic.values()) if relay is not None else 0,
            "links": {  # links this node dialed through punching routes, by how they went
                "punched": sum(r.counts["punched"] for r in self._routes.values()),
                "relayed": sum(r.counts["relayed"] for r in self._routes.values()),
            },
            "punched_in": self._punch_responder.counts["punched"] if self._punch_responder else 0,
        }

    @property
    def traffic(self) -> Counter[str]:
        """Averaging payload bytes ``sent`` and ``received`` by this node."""
        return self._averager.traffic

    def _traffic_totals(self) -> dict[tuple[str, str], int]:
        averaging = self.traffic
        return {
            ("sent", "averaging"): averaging["sent"],
            ("received", "averaging"): averaging["received"],
            ("sent", "state"): self.state_servicer.sent_bytes,
            ("received", "state"): self._state_received_bytes,
        }

    def _failure_totals(self) -> Counter[str]:
        # Streams our servicer rejected are violations by the peers that sent them.
        return self.failures + Counter({"protocol_violation": self.rejections.total()})

    def visible_maddrs(self) -> list[str]:
        return self._discovery.visible_maddrs() if self._discovery is not None else []

    # -- the run spec ---------------------------------------------------------------------------

    async def _check_spec(self) -> None:
        """Refuse to join a run whose peers use another spec (and announce ours)."""
        assert self._discovery is not None
        mine = self.spec.hash.hex()
        specs = await self._discovery.find_specs()
        others = {h: body for h, body in specs.items() if h != mine}
        if others and mine not in specs:
            first_hash, first = sorted(others.items())[0]
            diffs = "; ".join(self.spec.differences(first)) or "unknown fields"
            raise SpecMismatch(
                f"run {self.spec.run.id!r} is being trained with a different run spec "
                f"({first_hash[:12]}, yours is {mine[:12]}): {diffs}. Use the run's spec file "
                f"(or pick another run id) to join."
            )
        try:
            await self._discovery.announce_spec(
                self.spec.canonical(), expires_at=dht_time() + self.config.record_ttl_seconds
            )
        except DiscoveryError as error:  # the announce loop publishes it again: not fatal
            self.counts["announce failed"] += 1
            self.failures["discovery"] += 1
            log.warning("could not announce the run spec yet: %s", error)

    # -- peer records ---------------------------------------------------------------------------

    def publish(self, snapshot: state.Snapshot, *, throughput: float) -> None:
        """Serve ``snapshot`` to peers and announce its epoch and checksum; thread-safe."""
        self._snapshot = snapshot
        self._served[snapshot.checksum] = snapshot
        while len(self._served) > SERVED_STATES:
            del self._served[next(iter(self._served))]
        self.throughput = throughput
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._refresh.set)

    @property
    def snapshot(self) -> state.Snapshot | None:
        return self._snapshot

    async def _announce(self) -> None:
        assert self._discovery is not None
        snapshot = self._snapshot
        reach = self.reachability_summary()
        record = PeerRecord.create(
            self.peer_id,
            run_id=self.spec.run.id,
            spec_hash=self.spec.hash,
            endpoint=self.endpoint,
            now=dht_time(),
            ttl_seconds=self.config.record_ttl_seconds,
            epoch=snapshot.epoch if snapshot is not None else 0,
            checksum=snapshot.checksum if snapshot is not None else "",
            throughput=self.throughput,
            bandwidth=self.config.bandwidth,
            reachability=reach["reachability"],
            relay=reach["relay"],
            via=reach["via"],
            punched=sum(1 for r in self._routes.values() if r.counts["punched"]),
        )
        await self._discovery.announce(record)
        await self._discovery.announce_spec(
            self.spec.canonical(), expires_at=dht_time() + self.config.record_ttl_seconds
        )
        self.peers = await self._discovery.find()
        self.metrics.peers.set(len(self.peers))

    async def _keep_announcing(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.config.announce_interval_seconds):
                    await self._refresh.wait()
            except TimeoutError:
                pass
            self._refresh.clear()
            try:
                await self._announce()
            except DiscoveryError as error:
                self.counts["announce failed"] += 1
                self.failures["discovery"] += 1
                log.warning("could not refresh this node's record: %s", error)

    async def refresh_peers(self) -> list[PeerRecord]:
        assert self._discovery is not None
        try:
            self.peers = await self._discovery.find()
            self.metrics.peers.set(len(self.peers))
        except DiscoveryError as error:
            self.counts["discovery failed"] += 1
            self.failures["discovery"] += 1
            log.warning("could not read the run's peers: %s", error)
        return self.peers

    # -- state ----------------------------------------------------------------------------------

    async def find_donors(self, epoch: int, checksum: str) -> list[PeerRecord]:
        """Peers to download state from if this node is behind or diverged (:func:`pick_donors`),
        at most ``max_state_donors``, in random order (joiners spread over the donors)."""
        donors = pick_donors(await self.refresh_peers(), self.peer_id, epoch, checksum)
        donors = [d for d in donors if d.reachability != "unreachable"]  # nobody can dial them
        random.shuffle(donors)
        return donors[: self.config.max_state_donors]

    async def download_state(
        self, donors: list[PeerRecord], num_values: int
    ) -> state.Snapshot | None:
        """The state ``donors`` announce (all the same checksum), from all of them at once."""
        started = asyncio.get_running_loop().time()
        log.info(
            "downloading state %s (epoch %d) from %d donor(s)",
            donors[0].checksum,
            donors[0].epoch,
            len(donors),
        )
        await self._prepare_routes([d.endpoint for d in donors])
        try:
            result = await state.download(
                [(d.peer_id, self.transport.channel(d.endpoint)) for d in donors],
                signer=self.identity,
                run_id=self.spec.run.id,
                spec_hash=self.spec.hash,
                root=donors[0].checksum,
                num_values=num_values,
                timeout_seconds=self.config.state_download_timeout_seconds,
            )
        except SwarmgradError as error:
            self.counts["state download failed"] += 1
            self.failures["state_download"] += 1
            log.warning("state download failed: %s", error)
            return None
        for donor, why in result.failures.items():  # survived: others served its chunks
            self.failures["state_download"] += 1
            log.warning("state donor %s dropped: %s", donor, why)
        self.counts["state downloads"] += 1
        self._state_received_bytes += result.snapshot.values.nbytes
        self.metrics.state_sync_duration.observe(asyncio.get_running_loop().time() - started)
        return result.snapshot

    # -- rounds ---------------------------------------------------------------------------------

    async def average(
        self,
        vector: torch.Tensor,
        *,
        epoch: int,
        weight: float,
        prepare: Callable[[torch.Tensor, Group], torch.Tensor] | None = None,
    ) -> Averaged:
        """One round: a group for ``epoch`` through the DHT, then the all-reduce of ``vector``.

        ``prepare`` (run in a worker thread) turns ``vector`` into what is sent, given the group.
        """
        assert self._matchmaker is not None
        await self._await_reachability()
        try:
            group = await self._matchmaker.form_group(
                epoch,
                endpoint=self.endpoint,
                bandwidth=self.config.bandwidth * self._owner_share(),
                weight=weight,
            )
        except DiscoveryError as error:
            self.counts["discovery failed"] += 1
            self.failures["discovery"] += 1
            return Averaged(Outcome.NO_GROUP, error=str(error))
        if group is None:
            self.counts["no group"] += 1
            # This peer trains on: a latecomer for the round must not count on it.
            await self._withdraw(f"round/{epoch}")
            return Averaged(Outcome.NO_GROUP, error="nobody else was ready in time")
        log.info("epoch %d: averaging in a group of %d", epoch, len(group.members))
        topic = f"round/{epoch}"
        # The readiness record goes soon after the group is formed (its mates have read it by
        # then), not only when the round ends: a peer whose matchmaking starts while this one is
        # still in a failing attempt would build its group from this attempt's record while this
        # node's next attempt announces another (its weight grows in between), and the two would
        # compute different group ids every time. CI saw that livelock: two peers ~5 s out of
        # phase, each attempt refused as UNKNOWN_ROUND, for minutes.
        early = asyncio.create_task(
            self._withdraw_after(topic, self._matchmaker.settle_seconds + WITHDRAW_MARGIN_SECONDS),
            name=f"withdraw-round-{epoch}-early",
        )
        try:
            await self._prepare_routes([m.endpoint for m in group.members])
            sent = vector if prepare is None else await asyncio.to_thread(prepare, vector, group)
            started = asyncio.get_running_loop().time()
            result = await self._averager.all_reduce(sent, group)
        except RoundAborted as error:
            self.counts["aborted"] += 1
            self.failures["aborted_round"] += 1
            return Averaged(Outcome.ABORTED, group=group, error=str(error))
        finally:
            # Also when the round ends (early or not): a peer arriving late for this round must
            # not form a group with peers that have moved on, and the delayed withdrawal must
            # not take down the record of this node's next attempt.
            early.cancel()
            self._spawn(self._withdraw(topic), f"withdraw-round-{epoch}")
        self.counts["averaged" if result.complete else "partial"] += 1
        self.failures.update(result.failure_kinds.values())
        seconds = asyncio.get_running_loop().time() - started
        return Averaged(Outcome.AVERAGED, result=result, group=group, sent=sent, seconds=seconds)

    # -- hole punching --------------------------------------------------------------------------

    def _punch_host(self) -> str:
        reach = self.reachability
        return reach.observed_host if reach is not None and reach.behind_nat else ""

    def _punch_handler(self) -> PunchResponder | None:
        if self.config.reachability.punch:
            # Its target, this node's gRPC port, is set once the server is bound.
            self._punch_responder = PunchResponder(
                host=self.config.host, target=None, public_host=self._punch_host
            )
        return self._punch_responder

    def _origin(self, local: str) -> str | None:
        """Where a connection our relay client spliced to our server came from (Peer.Punch
        punches only towards its caller)."""
        return self.reachability.origin_of(local) if self.reachability is not None else None

    def _route(self, endpoint: str) -> str:
        route = self._routes.get(endpoint)
        return route.endpoint if route is not None else endpoint

    async def _prepare_routes(self, endpoints: list[str]) -> None:
        """Punching routes to the relayed peers among ``endpoints``, if this node is NAT'd too
        (a reachable node is dialed by them instead; a relayed one's links go through relays)."""
        if self._punch_responder is None or not self._punch_host():
            return
        relayed = {p.endpoint: p for p in self.peers if p.reachability == "relayed"}
        for endpoint in endpoints:
            record = relayed.get(endpoint)
            if record is None or endpoint in self._routes or record.peer_id == self.peer_id:
                continue

            async def call(
                host: str, port: int, endpoint: str = endpoint, callee: str = record.peer_id
            ) -> tuple[str, int]:
                return await peer.ask_punch(
                    endpoint,
                    signer=self.identity,
                    callee=callee,
                    host=host,
                    port=port,
                    run_id=self.spec.run.id,
                    spec_hash=self.spec.hash,
                )

            route = PunchRoute(
                host=self.config.host, relayed=endpoint, public_host=self._punch_host, call=call
            )
            await route.start()
            self._routes[endpoint] = route

    async def _await_reachability(self) -> None:
        """Before a first round with peers, wait (a little) for this node's reachability verdict:
        a NAT'd node announced as reachable would own a part that nobody can dial."""
        reach = self.reachability
        if reach is None or reach.settled.is_set() or len(self.peers) < 2 or self._waited:
            return
        self._waited = True  # once: a node nobody can confirm stays "unknown" for good
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.reachability_wait_seconds):
                await reach.settled.wait()

    def _owner_share(self) -> float:
        """How much of its bandwidth this node offers as an owner (none if it cannot be dialed)."""
        return self.reachability.owner_share if self.reachability is not None else 1.0

    async def _withdraw_after(self, topic: str, delay_seconds: float) -> None:
        await asyncio.sleep(delay_seconds)
        await self._withdraw(topic)

    async def _withdraw(self, topic: str) -> None:
        if self._discovery is None:  # closed meanwhile: the graceful leave withdrew everything
            return
        try:
            await self._discovery.leave(topic)
        except DiscoveryError as error:
            log.debug("could not withdraw %s: %s", topic, error)

    # -- the trainer's thread -------------------------------------------------------------------

    def release_waiters(self) -> None:
        """Let go of trainer threads waiting in :meth:`call` (they get ``CancelledError``)."""
        self._closing = True
        for future in list(self._pending):
            future.cancel()

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the node's loop from a trainer thread and wait for its result.

        Raises ``concurrent.futures.CancelledError`` once the node is stopping.
        """
        if self._loop is None or self._closing:
            coroutine.close()
            if self._loop is None:
                raise RuntimeError("the swarm is not running")
            raise concurrent.futures.CancelledError()
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        self._pending.add(future)
        try:
            return future.result()  # concurrent.futures.CancelledError once the swarm closes
        finally:
            self._pending.discard(future)


def _software_version() -> str:
    try:
        return importlib.metadata.version("swarmgrad")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
