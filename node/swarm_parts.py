"""The parts a :class:`~swarmgrad.node.swarm.Swarm` is made of, each built by its own room's
constructor, in one place: first what works without the network (:func:`build_parts`), then,
once the node's DHT runs, what reads it (:func:`join_parts`). ``Swarm`` holds them, starts its
background tasks and closes them; it assigns nothing into them after they are built."""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from swarmgrad.compression import Codec, get_codec
from swarmgrad.node.averaging.averager import Averager
from swarmgrad.node.averaging.matchmaking import Hooks as MatchmakingHooks
from swarmgrad.node.averaging.matchmaking import Matchmaker
from swarmgrad.node.averaging.membership import Membership
from swarmgrad.node.averaging.open.evidence import verify_bytes
from swarmgrad.node.averaging.registry import Registry
from swarmgrad.node.averaging.rounds import RoundParts, Rounds
from swarmgrad.node.discovery.base import Discovery
from swarmgrad.node.discovery.directory import PeerDirectory
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.discovery.start import start_discovery
from swarmgrad.node.identity import Identity
from swarmgrad.node.metrics import NodeMetrics
from swarmgrad.node.reachability.dialback import Reachability
from swarmgrad.node.reachability.relay_admission import RelayAdmission
from swarmgrad.node.reachability.routes import PunchRoutes
from swarmgrad.node.reachability.service import PeerService
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.scraped import Tallies
from swarmgrad.node.state.sync import StateParts, StateSync
from swarmgrad.node.swarm_config import (
    MATCHMAKING_SETTLE_SECONDS,
    SwarmConfig,
    allreduce_config,
    round_budget_seconds,
)
from swarmgrad.node.tasks import TaskSet
from swarmgrad.node.transport.transport import Transport
from swarmgrad.node.trust.allowlist import AllowlistWatcher
from swarmgrad.node.trust.board import BanBoard
from swarmgrad.node.trust.ledger import TrustLedger
from swarmgrad.protocol import stage, state
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.server import Rejections, ServerLimits

#: This node's record as it is now, at ``(now, ttl_seconds)``.
OwnRecord = Callable[[float, float], PeerRecord]


def stage_message_bytes(spec: RunSpec) -> int:
    """The largest request a pipeline stage server takes: a microbatch as large as the whole
    batch, its inputs and their gradients in fp32, plus headers (0 without a pipeline)."""
    if spec.pipeline.stages < 2:
        return 0
    return stage.max_message_bytes(spec.data.batch_size, spec.model.seq_len, spec.model.d_model)


@dataclass(frozen=True, slots=True, kw_only=True)
class Parts:
    """What a node is built from before it joins: nothing here needs the DHT."""

    codec: Codec
    #: What happened to this node, by event, and its failures by kind.
    tallies: Tallies
    metrics: NodeMetrics
    #: A private run's allowlist (None: anyone may take part).
    allowlist: AllowlistWatcher | None
    #: Checks every signed request this node receives (one replay memory for all services).
    verifier: Verifier
    #: Requests this node's services refused, by service and result code.
    rejections: Rejections
    routes: PunchRoutes
    transport: Transport
    state: StateSync
    peer_service: PeerService
    averager: Averager
    #: Whose readiness counts in matchmaking: peers it averaged with lately, the allowlist's,
    #: newcomers that answer a probe (``averaging/membership.py``).
    membership: Membership


def build_parts(spec: RunSpec, identity: Identity, config: SwarmConfig) -> Parts:
    """A node's parts for ``spec``, wired to each other, none of them started."""
    peer_id = identity.peer_id
    allowlist = AllowlistWatcher(spec.trust.run_key, peer_id) if spec.trust.private else None
    allowed = allowlist.allowed if allowlist is not None else None
    verifier = Verifier(peer_id, admit=allowed)
    rejections = Rejections()
    tallies = Tallies()
    metrics = NodeMetrics(
        peer_id=peer_id,
        run_id=spec.run.id,
        spec_hash=spec.short_hash,
        algorithm=spec.algorithm.name,
        codec=spec.averaging.codec,
    )
    rounds = allreduce_config(spec)
    services: list[PeerService] = []  # the routes ask the peer service, built after them
    routes = PunchRoutes(
        identity,
        spec,
        host=config.host,
        public_host=lambda: services[0].public_host(),
        enabled=config.reachability.punch,
    )
    limits = ServerLimits(
        max_message_bytes=max(
            2 * rounds.max_chunk_bytes, state.MAX_MESSAGE_BYTES, stage_message_bytes(spec)
        )
    )
    transport = Transport(config.transport(limits), route=routes.resolve, rejections=rejections)
    sync = StateSync(
        StateParts(
            identity=identity,
            spec=spec,
            transport=transport,
            verifier=verifier,
            rejections=rejections,
            tallies=tallies,
            observe_seconds=metrics.state_sync_duration.observe,
        ),
        config.state_sync(),
    )
    # The rounds this node is in and has left: the averager keeps them, the Peer service tells
    # a peer that asks whether this node has left one (``averaging/quiet.py``).
    registry = Registry(rounds.join_timeout_seconds)
    peer_service = PeerService(
        identity,
        spec,
        transport,
        verifier=verifier,
        rejections=rejections,
        punch=config.reachability.punch,
        round_left=registry.left,
    )
    services.append(peer_service)
    averager = Averager(
        identity,
        rounds,
        transport,
        verifier=verifier,
        rejections=rejections,
        ledger=TrustLedger(store=config.bans_path if spec.trust.open else None),
        alive=peer_service.presence,
        registry=registry,
    )
    return Parts(
        codec=get_codec(spec.averaging.codec, **spec.averaging.codec_options),
        tallies=tallies,
        metrics=metrics,
        allowlist=allowlist,
        verifier=verifier,
        rejections=rejections,
        routes=routes,
        transport=transport,
        state=sync,
        peer_service=peer_service,
        averager=averager,
        membership=Membership(peer_service.alive, allowed=allowed),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Joined:
    """What a node has once its DHT runs (its transport serving)."""

    discovery: Discovery
    directory: PeerDirectory
    reachability: Reachability
    rounds: Rounds
    #: Open runs: bans published with their evidence, read and checked (None otherwise).
    board: BanBoard | None


async def join_parts(
    spec: RunSpec,
    identity: Identity,
    config: SwarmConfig,
    parts: Parts,
    *,
    own_record: OwnRecord,
    tasks: TaskSet,
) -> Joined:
    """Start the DHT and what reads it, check the run's spec there, serve, and join. On any
    failure the DHT is closed again (the caller closes ``parts``)."""
    discovery = await start_discovery(
        config.discovery_config(), identity, run_id=spec.run.id, spec_hash=spec.hash
    )
    try:
        directory = PeerDirectory(
            discovery,
            spec,
            config.directory(),
            own_record=own_record,
            tallies=parts.tallies,
            seen=parts.metrics.peers.set,
        )
        await directory.check_spec()
        await parts.transport.__aenter__()
        allowlist = parts.allowlist
        reachability = Reachability(
            identity,
            spec,
            parts.transport,
            peers=directory.refresh,
            changed=directory.changed,
            # Its relay serves the run's peers (a live record), and only the allowed ones.
            admit=RelayAdmission(
                peers=lambda: directory.peers,
                reread=directory.refresh,
                allowed=allowlist.allowed if allowlist is not None else None,
            ),
            config=config.reachability,
        )
        averager = parts.averager
        excludes = functools.partial(excluded, averager.ledger, allowlist)
        matchmaker = Matchmaker(
            discovery,
            identity,
            group_size=spec.averaging.group_size,
            matchmaking_timeout_seconds=spec.averaging.matchmaking_timeout_seconds,
            settle_seconds=MATCHMAKING_SETTLE_SECONDS,
            slot_seconds=spec.algorithm.round_seconds,
            hooks=MatchmakingHooks(
                peers=directory.refresh,
                excluded=excludes,
                avoiding=averager.ledger.newest_bans,
                membership=parts.membership,
                expect=averager.expect,
            ),
        )
        budget = round_budget_seconds(spec, config, dht_call_seconds=discovery.call_timeout_seconds)

        def spawn(coro: Coroutine[Any, Any, None], name: str) -> None:
            tasks.spawn(coro, name)

        rounds = Rounds(
            RoundParts(
                matchmaker=matchmaker,
                averager=averager,
                directory=directory,
                reachability=reachability,
                routes=parts.routes,
                tallies=parts.tallies,
                spawn=spawn,
                membership=parts.membership,
            ),
            config.rounds(budget_seconds=budget),
        )
        board = None
        if allowlist is not None:
            await allowlist.refresh(discovery.find_allowlists)
            tasks.spawn(allowlist.run(discovery.find_allowlists), "allowlist")
        if spec.trust.open:
            board = BanBoard(
                averager.ledger,
                me=identity.peer_id,
                verify=functools.partial(verify_bytes, run_id=spec.run.id, spec_hash=spec.hash),
                channel=discovery,
            )
            tasks.spawn(board.run(), "ban-records")
        await directory.join()
        tasks.spawn(directory.keep_fresh(), "announce")
        tasks.spawn(reachability.run(), "reachability")
        parts.peer_service.attach(reachability, parts.transport.port)
        return Joined(
            discovery=discovery,
            directory=directory,
            reachability=reachability,
            rounds=rounds,
            board=board,
        )
    except BaseException:
        await discovery.close()
        raise


def excluded(ledger: TrustLedger, allowlist: AllowlistWatcher | None, peer_id: str) -> bool:
    """Whether this node neither averages with ``peer_id`` nor learns from it: banned by its
    ledger (open runs), or not on the allowlist (private runs)."""
    if ledger.banned(peer_id):
        return True
    return allowlist is not None and not allowlist.allowed(peer_id)
