"""The averager component: serves the Averaging RPC and runs this node's all-reduce rounds.

One ``Averager`` per node. It serves the Averaging RPC on the node's transport, dials owners
through the transport's channels, and keeps the registry of rounds in progress, which is how a
stream from a peer finds the :class:`PartReducer` of the round it belongs to. A stream may
arrive a little before this node has started the same round (members start at slightly
different times); it waits for it in slots of its own (``registry.py``).

What a run's trust rules add to a round is its :class:`~swarmgrad.node.averaging.policy.RoundPolicy`
(``policy.py``), called at the round's fixed points: trusted runs take results as they come;
open runs (``config.observe``; ``open/``) sign, account for and check everything, and keep a
:class:`TrustLedger` of the peers' scores and bans. A peer the ledger bans is refused (BANNED)
in any run, and its streams are not waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import Counter
from collections.abc import AsyncIterator, Collection

import torch

from swarmgrad.node.averaging.allreduce import (
    AllReduceConfig,
    RoundPlan,
    RoundResult,
    run_round,
)
from swarmgrad.node.averaging.group import Group, chunk_sizes
from swarmgrad.node.averaging.hooks import OwnerHooks, RoundHooks
from swarmgrad.node.averaging.open.policy import LossProbe, OpenPolicy
from swarmgrad.node.averaging.plan import Alive
from swarmgrad.node.averaging.policy import Finished, RoundPolicy, TrustedPolicy
from swarmgrad.node.averaging.reducer import PartReducer, SenderSession
from swarmgrad.node.averaging.registry import ActiveRound, Registry
from swarmgrad.node.averaging.sides import OwnerSide
from swarmgrad.node.identity import Identity
from swarmgrad.node.tasks import TaskSet
from swarmgrad.node.transport.memory import MemoryNetwork, MemoryTransport
from swarmgrad.node.transport.transport import Transport, TransportConfig
from swarmgrad.node.trust.ledger import TrustLedger
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.averaging import StreamHeader
from swarmgrad.protocol.averaging_service import AveragingServicer, add_to_server
from swarmgrad.protocol.errors import ProtocolViolation, RoundAborted, quote
from swarmgrad.protocol.server import Rejections, ServerLimits
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

log = logging.getLogger(__name__)

__all__ = ["Averager", "LossProbe", "standalone", "transport_limits"]

#: How long a finished round's reducer keeps answering streams still reading their results.
_LINGER_SECONDS = 5.0


class Averager:
    """Run all-reduce rounds with peers over ``transport``; ``async with`` it while it runs.

    It registers the Averaging service on ``transport`` (which must not have started yet) and
    dials owners through its channels; ``verifier`` and ``rejections`` are the node's, shared by
    its services.
    """

    def __init__(
        self,
        identity: Identity,
        config: AllReduceConfig,
        transport: Transport,
        *,
        verifier: Verifier | None = None,
        rejections: Rejections | None = None,
        ledger: TrustLedger | None = None,
        policy: RoundPolicy | None = None,
        alive: Alive | None = None,
        registry: Registry | None = None,
    ) -> None:
        """``policy``: the run's trust rules for its rounds (default: an open run's when
        ``config.observe``, else a trusted run's); ``alive``: asks whether a peer of a round
        gone quiet still answers, and is still in the round (``RoundPlan.alive``);
        ``registry``: the rounds this node is in and has left (its own by default; the node
        shares it with the Peer service, which answers whether it has left a round)."""
        if transport.limits.max_message_bytes < 2 * config.max_chunk_bytes:
            raise ValueError(
                f"the transport's max_message_bytes ({transport.limits.max_message_bytes}) is "
                f"below two chunks of the round ({2 * config.max_chunk_bytes})"
            )
        self.identity = identity
        self.peer_id = identity.peer_id
        self._alive = alive
        self.config = config
        self.transport = transport
        #: Scores and bans of peers, from what this node saw of them as an owner (open runs).
        self.ledger = ledger if ledger is not None else TrustLedger()
        self._rounds = registry or Registry(config.join_timeout_seconds)
        self._background = TaskSet()
        self.servicer = AveragingServicer(
            self,
            verifier=verifier or Verifier(self.peer_id),
            limits=transport.limits,
            rejections=rejections,
            pace=transport.pace if transport.paced else None,
        )
        transport.register(lambda server: add_to_server(self.servicer, server))
        #: Rounds by outcome: "complete", "partial" (some values missing or partial), "aborted".
        self.rounds: Counter[str] = Counter()
        #: Payload bytes "sent" and "received" by this node, as client and as owner.
        self.traffic: Counter[str] = self.servicer.traffic
        #: Owner checks of open rounds: parts "checked", "failed" (dropped) and "unchecked".
        self.checks: Counter[str] = Counter()
        #: Open runs: measures what members' values do to the loss (set by a trainer that has
        #: the model and the data; ``node/training/spot_check.py``). None: no spot checks.
        self.loss_probe: LossProbe | None = None
        self.policy: RoundPolicy = policy or (
            OpenPolicy(
                signer=identity,
                config=config,
                channel=transport.channel,
                ledger=self.ledger,
                checks=self.checks,
                background=self._background,
                loss_probe=lambda: self.loss_probe,
                linger_seconds=_LINGER_SECONDS,
            )
            if config.observe
            else TrustedPolicy(_LINGER_SECONDS)
        )

    @property
    def endpoint(self) -> str:
        """Where peers reach this averager: its transport's endpoint."""
        return self.transport.endpoint

    @property
    def port(self) -> int:
        return self.transport.port

    async def __aenter__(self) -> Averager:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Close the rounds still lingering (the transport stops serving on its own)."""
        await self._background.close()
        for active in self._rounds.drain():
            if active.reducer is not None:
                await active.reducer.close()

    # -- rounds ---------------------------------------------------------------------------------

    async def all_reduce(
        self,
        vector: torch.Tensor,
        group: Group,
        *,
        hooks: RoundHooks | None = None,
        owner_hooks: OwnerHooks | None = None,
        out: torch.Tensor | None = None,
        keep_sent: bool = False,
        owner_residual: torch.Tensor | None = None,
    ) -> RoundResult:
        """Average ``vector`` (1-D fp32) with ``group`` (``allreduce.py`` says how); ``hooks``
        and ``owner_hooks`` inject faults (tests, simulations: ``hooks.py``).
        ``owner_residual`` (a CPU fp32 tensor shaped like ``vector``): this node's error
        feedback as the owner of its part (``reducer.py``). It is only read: the round works on
        a copy of its part's range and returns that moved on in ``result.owner_residual``.

        The result is a new tensor, or ``out`` when given (a buffer the caller reuses from
        round to round; its contents are undefined if the round is aborted). ``vector`` itself
        is never modified. A GPU ``vector`` is encoded and its results decoded on the GPU (only
        payloads cross to the host), except in open runs, whose checks work on the CPU: there
        the vector is copied across and the result is a CPU tensor.
        """
        if vector.dim() != 1 or vector.dtype != torch.float32:
            raise ValueError("all_reduce takes a 1-D float32 tensor")
        policy = self.policy
        if vector.device.type != "cpu" and policy.on_host:
            vector, out = vector.cpu(), None
        if out is not None and (
            out.shape != vector.shape
            or out.dtype != torch.float32
            or out.device != vector.device
            or not out.is_contiguous()
            or out.data_ptr() == vector.data_ptr()
        ):
            raise ValueError(
                "out must be a distinct contiguous float32 tensor shaped like vector, on its device"
            )
        me = group.index(self.peer_id)
        key = (group.round, group.group_id)
        if self._rounds.known(key):
            raise ValueError(f"round {group.round} with this group was already run")
        bounds = group.partition(vector.numel())
        member, owner, state = policy.begin(group, me, bounds, vector)
        if owner_residual is not None and owner_residual.shape != vector.shape:
            raise ValueError("owner_residual must be shaped like vector")
        staged = None
        if owner_residual is not None:
            start, end = bounds[me]
            staged = (start, owner_residual[start:end].clone())
        reducer = self._reducer(
            group, me, bounds[me], owner, owner_hooks, None if staged is None else staged[1]
        )
        await self._rounds.add(key, ActiveRound(group=group, me=me, reducer=reducer, state=state))
        try:
            plan = RoundPlan(
                me=me,
                group=group,
                signer=self.identity,
                config=self.config,
                reducer=reducer,
                channel=self.transport.channel,
                traffic=self.traffic,
                side=member,
                owner_abstains=policy.owner_abstains,
                hooks=hooks,
                pace=self.transport.pace if self.transport.paced else None,
                keep_sent=keep_sent,
                alive=self._alive,
            )
            result = await run_round(plan, vector.contiguous(), out=out)
            own_account = await reducer.account() if reducer is not None else None
            result = await policy.settle(
                Finished(
                    result=result,
                    vector=vector,
                    group=group,
                    me=me,
                    member=member,
                    owner=owner,
                    own_account=own_account,
                    state=state,
                )
            )
        except RoundAborted:
            self.rounds["aborted"] += 1
            raise
        finally:
            if reducer is not None and owner is not None:
                await reducer.finished(timeout_seconds=self.config.sender_timeout_seconds)
                await policy.finish(group, owner)
            self._retire(key)
        if staged is not None:
            result = dataclasses.replace(result, owner_residual=staged)
        self.rounds["complete" if result.complete else "partial"] += 1
        self._rounds.averaged(group.round)
        if result.failures:
            log.warning("round %d: %s", group.round, result.failures)
        return result

    def _reducer(
        self,
        group: Group,
        me: int,
        bounds: tuple[int, int],
        owner: OwnerSide | None,
        hooks: OwnerHooks | None,
        residual: torch.Tensor | None,
    ) -> PartReducer | None:
        """This node's reducer of its own part (None: it owns none)."""
        start, end = bounds
        if end == start:
            return None
        reducer = PartReducer(
            group=group,
            part=me,
            chunk_numels=chunk_sizes(end - start, self.config.chunk_values),
            codec=self.config.make_codec(),
            rules=self.config.owner_rules(abstains=self.policy.owner_abstains),
            side=owner,
            hooks=hooks,
            residual=residual,
        )
        for member, peer in enumerate(group.members):
            if self.ledger.banned(peer.peer_id):  # it will be refused: do not wait for it
                reducer.drop(member, "banned here")
        return reducer

    def _retire(self, key: tuple[int, bytes]) -> None:
        """Forget a round after it lingers long enough for slow readers of its results (and,
        in open runs, the other members' audits of this owner's part)."""
        self._rounds.finish(key)

        async def linger() -> None:
            try:
                await asyncio.sleep(self.policy.linger_seconds)
            finally:
                active = self._rounds.drop(key)
                if active is not None and active.reducer is not None:
                    await active.reducer.close()

        self._background.spawn(linger(), name=f"retire-round-{key[0]}")

    # -- AggregateHandler: streams from peers ---------------------------------------------------

    async def open_session(self, header: StreamHeader) -> SenderSession:
        if header.run_id != self.config.run_id or header.spec_hash != self.config.spec_hash:
            raise ProtocolViolation(
                ResultCode.WRONG_RUN,
                f"this node is in run {self.config.run_id!r} spec "
                f"{self.config.spec_hash.hex()[:12]}, the stream is for run "
                f"{quote(header.run_id)} spec {header.spec_hash.hex()[:12]}",
            )
        if self.ledger.banned(header.sender):
            ban = self.ledger.bans[header.sender]
            raise ProtocolViolation(
                ResultCode.BANNED,
                f"{header.sender} was banned here in round {ban.round} ({ban.reason})",
            )
        key = (header.round, header.group_id)
        active = await self._rounds.wait(key, header.sender)
        member = active.member(header.sender)
        if header.part != active.me or active.reducer is None:
            raise ProtocolViolation(
                ResultCode.NOT_A_MEMBER, f"part {header.part} is not owned by {self.peer_id}"
            )
        weight = active.group.members[member].weight
        if header.weight != weight:
            raise ProtocolViolation(
                ResultCode.BAD_PAYLOAD, f"weight {header.weight} differs from the group's {weight}"
            )
        return SenderSession(
            active.reducer,
            member,
            max_chunk_bytes=self.config.max_chunk_bytes,
            sender_timeout_seconds=self.config.sender_timeout_seconds,
            commitment=header.commitment,
            auth=header.auth,
        )

    async def check(
        self, statement: averaging_pb2.CheckStatement, signed: averaging_pb2.Signed
    ) -> averaging_pb2.Chunk | None:
        """A member's check message (AggregateHandler): into its round's box; an audit's
        request: the chunk asked for."""
        key = statement.key
        if key.run_id != self.config.run_id or key.spec_hash != self.config.spec_hash:
            raise ProtocolViolation(ResultCode.WRONG_RUN, "a check message of another run")
        if self.ledger.banned(statement.sender):
            raise ProtocolViolation(ResultCode.BANNED, f"{statement.sender} is banned here")
        active = await self._rounds.wait((key.round, key.group_id), statement.sender, checks=True)
        member = active.member(statement.sender)
        return await self.policy.check(active.state, member, statement, signed)

    def expect(self, round_: int, peer_ids: Collection[str]) -> None:
        """``peer_ids`` may stream to this node in ``round_`` before it starts the round (the
        members its matchmaking counts): each waits in slots of its own (``registry.py``)."""
        self._rounds.expect(round_, peer_ids)


def transport_limits(config: AllReduceConfig, *, min_message_bytes: int = 0) -> ServerLimits:
    """Transport limits that carry ``config``'s chunks (and messages of ``min_message_bytes``)."""
    default = ServerLimits().max_message_bytes
    return ServerLimits(
        max_message_bytes=max(default, 2 * config.max_chunk_bytes, min_message_bytes)
    )


@contextlib.asynccontextmanager
async def standalone(
    identity: Identity,
    config: AllReduceConfig,
    *,
    host: str = "127.0.0.1",
    upload_bytes_per_second: float | None = None,
    network: MemoryNetwork | None = None,
    alive: Alive | None = None,
    registry: Registry | None = None,
) -> AsyncIterator[Averager]:
    """An averager on a transport of its own (serving only Averaging, on a free port), its
    uploads capped at ``upload_bytes_per_second`` if given; with ``network``, an in-memory
    transport on it instead of sockets (tests); ``alive``, ``registry``: as for
    :class:`Averager`."""
    settings = TransportConfig(
        host=host,
        limits=transport_limits(config),
        upload_bytes_per_second=upload_bytes_per_second,
    )
    transport = Transport(settings) if network is None else MemoryTransport(network, settings)
    averager = Averager(identity, config, transport, alive=alive, registry=registry)
    async with averager, transport:  # the server stops (with its grace) before the rounds
        yield averager
