"""The averager component: serves the Averaging RPC and runs this node's all-reduce rounds.

One ``Averager`` per node. It serves the Averaging RPC on the node's transport, dials owners
through the transport's channels, and keeps the registry of rounds in progress, which is how a
stream from a peer finds the :class:`PartReducer` of the round it belongs to. A stream may
arrive a little before this node has started the same round (members start at slightly
different times); it waits up to ``join_timeout_seconds`` for the round to appear before it is
refused with UNKNOWN_ROUND. Streams are signed, but keys cost nothing: a stranger's flood of
streams for rounds that never come once held every waiting slot, and an honest member arriving
before its owner started the round was refused and its part lost. So the members matchmaking
counts for a round (:meth:`Averager.expect`) each have slots of their own
(:data:`MAX_EARLY_STREAMS_PER_MEMBER`), and any other key waits in a small shared pool
(:data:`MAX_EARLY_STREAMS`) or is refused OVERLOADED. Check messages wait the same way in slots of
their own (:data:`MAX_EARLY_CHECKS_PER_MEMBER`, :data:`MAX_EARLY_CHECKS`): a member checks after
this node served its part, so only a node that owns no part sees early ones from honest members,
and a stranger's flood of them must not take the slots honest streams need.

What a run's trust rules add to a round is its :class:`~swarmgrad.node.averaging.policy.RoundPolicy`
(``policy.py``), called at the round's fixed points: trusted runs take results as they come;
open runs (``config.observe``; ``open/``) sign, account for and check everything, and keep a
:class:`TrustLedger` of the peers' scores and bans. A peer the ledger bans is refused (BANNED)
in any run, and its streams are not waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass

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
from swarmgrad.node.averaging.policy import Finished, RoundPolicy, TrustedPolicy
from swarmgrad.node.averaging.reducer import PartReducer, SenderSession
from swarmgrad.node.averaging.sides import OwnerSide
from swarmgrad.node.identity import Identity
from swarmgrad.node.tasks import TaskSet
from swarmgrad.node.transport.memory import MemoryNetwork, MemoryTransport
from swarmgrad.node.transport.transport import Transport, TransportConfig
from swarmgrad.node.trust.ledger import TrustLedger
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.averaging import AveragingServicer, StreamHeader, add_to_server
from swarmgrad.protocol.errors import ProtocolViolation, RoundAborted, quote
from swarmgrad.protocol.server import Rejections, ServerLimits
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

log = logging.getLogger(__name__)

__all__ = ["Averager", "LossProbe", "standalone", "transport_limits"]

#: How long a finished round's reducer keeps answering streams still reading their results.
_LINGER_SECONDS = 5.0
_FINISHED_MEMORY = 256
#: Streams, and check messages, that may wait at once for a round this node has not started:
#: from each member matchmaking expects in that round (one stream per owner, a few retried; the
#: checks of one round), and from any other key, all together.
MAX_EARLY_STREAMS_PER_MEMBER = 2
MAX_EARLY_CHECKS_PER_MEMBER = 8
MAX_EARLY_STREAMS = 16
MAX_EARLY_CHECKS = 16
#: Rounds whose expected members are kept: a node's rounds go forward, and a stream for a round
#: it has finished is refused at once.
_EXPECTED_ROUNDS = 2


@dataclass(slots=True)
class _ActiveRound:
    group: Group
    me: int
    reducer: PartReducer | None
    #: The policy's state of the round (its check messages, in open runs).
    state: object = None


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
    ) -> None:
        """``policy``: the run's trust rules for its rounds (default: an open run's when
        ``config.observe``, else a trusted run's)."""
        if transport.limits.max_message_bytes < 2 * config.max_chunk_bytes:
            raise ValueError(
                f"the transport's max_message_bytes ({transport.limits.max_message_bytes}) is "
                f"below two chunks of the round ({2 * config.max_chunk_bytes})"
            )
        self.identity = identity
        self.peer_id = identity.peer_id
        self.config = config
        self.transport = transport
        #: Scores and bans of peers, from what this node saw of them as an owner (open runs).
        self.ledger = ledger if ledger is not None else TrustLedger()
        self._rounds: dict[tuple[int, bytes], _ActiveRound] = {}
        self._finished: dict[tuple[int, bytes], None] = {}
        self._rounds_changed = asyncio.Condition()
        self._background = TaskSet()
        #: Streams and check messages waiting for their rounds to start: by kind in the shared
        #: pool, by (kind, round, sender) in the expected members' slots.
        self._early: Counter[str | tuple[str, int, str]] = Counter()
        #: The members matchmaking expects in the latest rounds (:meth:`expect`).
        self._expected: dict[int, frozenset[str]] = {}
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
        for active in self._rounds.values():
            if active.reducer is not None:
                await active.reducer.close()
        self._rounds.clear()

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
    ) -> RoundResult:
        """Average ``vector`` (1-D fp32) with ``group`` (``allreduce.py`` says how); ``hooks``
        and ``owner_hooks`` inject faults (tests, simulations: ``hooks.py``).

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
        if key in self._rounds or key in self._finished:
            raise ValueError(f"round {group.round} with this group was already run")
        bounds = group.partition(vector.numel())
        member, owner, state = policy.begin(group, me, bounds)
        reducer = self._reducer(group, me, bounds[me], owner, owner_hooks)
        async with self._rounds_changed:
            self._rounds[key] = _ActiveRound(group=group, me=me, reducer=reducer, state=state)
            self._rounds_changed.notify_all()
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
        self.rounds["complete" if result.complete else "partial"] += 1
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
        )
        for member, peer in enumerate(group.members):
            if self.ledger.banned(peer.peer_id):  # it will be refused: do not wait for it
                reducer.drop(member, "banned here")
        return reducer

    def _retire(self, key: tuple[int, bytes]) -> None:
        """Forget a round after it lingers long enough for slow readers of its results (and,
        in open runs, the other members' audits of this owner's part)."""
        self._finished[key] = None
        while len(self._finished) > _FINISHED_MEMORY:
            self._finished.pop(next(iter(self._finished)))

        async def linger() -> None:
            try:
                await asyncio.sleep(self.policy.linger_seconds)
            finally:
                active = self._rounds.pop(key, None)
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
        active = await self._wait_for_round(key, header.sender)
        member = _member(active, header.sender)
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
        active = await self._wait_for_round(
            (key.round, key.group_id), statement.sender, checks=True
        )
        member = _member(active, statement.sender)
        return await self.policy.check(active.state, member, statement, signed)

    def expect(self, round_: int, peer_ids: Collection[str]) -> None:
        """``peer_ids`` may stream to this node in ``round_`` before it starts the round: the
        members its matchmaking counts (``matchmaking.py``). Each gets early slots of its own;
        forgotten once newer rounds are expected."""
        self._expected[round_] = frozenset(peer_ids)
        for old in sorted(self._expected)[:-_EXPECTED_ROUNDS]:
            del self._expected[old]

    async def _wait_for_round(
        self, key: tuple[int, bytes], sender: str, *, checks: bool = False
    ) -> _ActiveRound:
        """The round ``key``, waiting for it to start if need be (``checks``: for a check
        message, in the check messages' slots): in ``sender``'s own slots if it is an expected
        member of the round, or else in the shared pool."""
        if key in self._finished and key not in self._rounds:
            raise ProtocolViolation(ResultCode.UNKNOWN_ROUND, f"round {key[0]} has ended here")
        if key not in self._rounds:
            kind = "checks" if checks else "streams"
            own = MAX_EARLY_CHECKS_PER_MEMBER if checks else MAX_EARLY_STREAMS_PER_MEMBER
            shared = MAX_EARLY_CHECKS if checks else MAX_EARLY_STREAMS
            slot: str | tuple[str, int, str] = kind
            if sender in self._expected.get(key[0], ()) and self._early[kind, key[0], sender] < own:
                slot = (kind, key[0], sender)
            elif self._early[kind] >= shared:
                raise ProtocolViolation(
                    ResultCode.OVERLOADED, f"too many {kind} are waiting for rounds to start"
                )
            self._early[slot] += 1
            try:
                with contextlib.suppress(TimeoutError):
                    async with (
                        asyncio.timeout(self.config.join_timeout_seconds),
                        self._rounds_changed,
                    ):
                        await self._rounds_changed.wait_for(lambda: key in self._rounds)
            finally:
                self._early[slot] -= 1
                if not self._early[slot]:
                    del self._early[slot]
        active = self._rounds.get(key)
        if active is None:
            raise ProtocolViolation(
                ResultCode.UNKNOWN_ROUND,
                f"no round {key[0]} with group {key[1].hex()[:12]} here "
                f"(waited {self.config.join_timeout_seconds:g} s)",
            )
        return active


def _member(active: _ActiveRound, peer_id: str) -> int:
    """``peer_id``'s index in the round's group; NOT_A_MEMBER if it has none."""
    try:
        return active.group.index(peer_id)
    except KeyError:
        raise ProtocolViolation(
            ResultCode.NOT_A_MEMBER, f"{peer_id} is not in group of round {active.group.round}"
        ) from None


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
) -> AsyncIterator[Averager]:
    """An averager on a transport of its own (serving only Averaging, on a free port), its
    uploads capped at ``upload_bytes_per_second`` if given; with ``network``, an in-memory
    transport on it instead of sockets (tests)."""
    settings = TransportConfig(
        host=host,
        limits=transport_limits(config),
        upload_bytes_per_second=upload_bytes_per_second,
    )
    transport = Transport(settings) if network is None else MemoryTransport(network, settings)
    averager = Averager(identity, config, transport)
    async with averager, transport:  # the server stops (with its grace) before the rounds
        yield averager
