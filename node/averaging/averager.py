"""The averager component: serves the Averaging RPC and runs this node's all-reduce rounds.

One ``Averager`` per node. It owns the gRPC server (shared with the node's other services later),
the channels to peers, and the registry of rounds in progress, which is how a stream from a peer
finds the :class:`PartReducer` of the round it belongs to. A stream may arrive a little before
this node has started the same round (members start at slightly different times); it waits up to
``join_timeout_seconds`` for the round to appear before it is refused with UNKNOWN_ROUND (at
most :data:`MAX_EARLY_STREAMS` wait at once: streams are signed, but keys cost nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

import grpc
import torch

from swarmgrad.node.averaging.allreduce import AllReduceConfig, RoundHooks, RoundResult, run_round
from swarmgrad.node.averaging.group import Group, chunk_sizes
from swarmgrad.node.averaging.reducer import PartReducer, SenderSession
from swarmgrad.node.identity import Identity
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.averaging import AveragingServicer, StreamHeader, add_to_server
from swarmgrad.protocol.errors import ProtocolViolation, RoundAborted, quote
from swarmgrad.protocol.server import Rejections, ServerLimits, open_channel, start_server
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

log = logging.getLogger(__name__)

#: How long a finished round's reducer keeps answering streams still reading their results.
_LINGER_SECONDS = 5.0
_FINISHED_MEMORY = 256
#: Streams that may wait at once for a round this node has not started (yet).
MAX_EARLY_STREAMS = 64


@dataclass(slots=True)
class _ActiveRound:
    group: Group
    me: int
    reducer: PartReducer | None


class Averager:
    """Run all-reduce rounds with peers; use as ``async with Averager(...) as averager``."""

    def __init__(
        self,
        identity: Identity,
        config: AllReduceConfig,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        public_host: str = "",
        limits: ServerLimits | None = None,
        services: Sequence[Callable[[grpc.aio.Server], None]] = (),
        min_message_bytes: int = 0,
        verifier: Verifier | None = None,
        rejections: Rejections | None = None,
    ) -> None:
        """``services`` register the node's other servicers on the same gRPC server, whose
        messages may be up to ``min_message_bytes``; ``public_host`` is the address peers dial,
        when it is not ``host`` (a container's name). ``verifier`` and ``rejections`` are the
        node's, shared by its services."""
        self.identity = identity
        self.peer_id = identity.peer_id
        self._services = tuple(services)
        self.config = config
        self._host, self._port, self._public_host = host, port, public_host or host
        self.limits = limits or ServerLimits(
            max_message_bytes=max(2 * config.max_chunk_bytes, min_message_bytes)
        )
        self._rounds: dict[tuple[int, bytes], _ActiveRound] = {}
        self._finished: dict[tuple[int, bytes], None] = {}
        self._rounds_changed = asyncio.Condition()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._server: grpc.aio.Server | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._early_streams = 0
        self.servicer = AveragingServicer(
            self,
            verifier=verifier or Verifier(self.peer_id),
            limits=self.limits,
            rejections=rejections,
        )
        #: Rounds by outcome: "complete", "partial" (some values missing or partial), "aborted".
        self.rounds: Counter[str] = Counter()
        #: Payload bytes "sent" and "received" by this node, as client and as owner.
        self.traffic: Counter[str] = self.servicer.traffic
        self.endpoint = ""
        self.port = 0
        #: Maps a peer's endpoint to the one to dial (a hole-punching route), if set.
        self.route: Callable[[str], str] | None = None

    async def __aenter__(self) -> Averager:
        self._server, port = await start_server(
            self._register,
            host=self._host,
            port=self._port,
            limits=self.limits,
        )
        self.port = port
        self.endpoint = f"{self._public_host}:{port}"
        return self

    def _register(self, server: grpc.aio.Server) -> None:
        add_to_server(self.servicer, server)
        for register in self._services:
            register(server)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stop serving (letting streams finish for the grace period) and close channels."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(self.limits.grace_seconds)
            self._server = None
        for active in self._rounds.values():
            if active.reducer is not None:
                await active.reducer.close()
        self._rounds.clear()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    # -- rounds ---------------------------------------------------------------------------------

    async def all_reduce(
        self,
        vector: torch.Tensor,
        group: Group,
        *,
        hooks: RoundHooks | None = None,
        out: torch.Tensor | None = None,
    ) -> RoundResult:
        """Average ``vector`` (1-D fp32 on the CPU) with ``group`` (``allreduce.py`` says how).

        The result is a new tensor, or ``out`` when given (a buffer the caller reuses from
        round to round; its contents are undefined if the round is aborted). ``vector`` itself
        is never modified.
        """
        if vector.dim() != 1 or vector.dtype != torch.float32 or vector.device.type != "cpu":
            raise ValueError("all_reduce takes a 1-D float32 CPU tensor")
        if out is not None and (
            out.shape != vector.shape
            or out.dtype != torch.float32
            or not out.is_contiguous()
            or out.data_ptr() == vector.data_ptr()
        ):
            raise ValueError("out must be a distinct contiguous float32 tensor shaped like vector")
        me = group.index(self.peer_id)
        key = (group.round, group.group_id)
        if key in self._rounds or key in self._finished:
            raise ValueError(f"round {group.round} with this group was already run")
        start, end = group.partition(vector.numel())[me]
        reducer = None
        if end > start:
            reducer = PartReducer(
                group=group,
                part=me,
                chunk_numels=chunk_sizes(end - start, self.config.chunk_values),
                codec=self.config.make_codec(),
                open_timeout_seconds=self.config.sender_timeout_seconds,
                max_chunks_ahead=self.config.max_chunks_ahead,
            )
        async with self._rounds_changed:
            self._rounds[key] = _ActiveRound(group=group, me=me, reducer=reducer)
            self._rounds_changed.notify_all()
        try:
            result = await run_round(
                me=me,
                group=group,
                vector=vector.contiguous(),
                signer=self.identity,
                config=self.config,
                reducer=reducer,
                channel=self.channel,
                traffic=self.traffic,
                hooks=hooks,
                out=out,
            )
        except RoundAborted:
            self.rounds["aborted"] += 1
            raise
        finally:
            self._retire(key)
        self.rounds["complete" if result.complete else "partial"] += 1
        if result.failures:
            log.warning("round %d: %s", group.round, result.failures)
        return result

    def _retire(self, key: tuple[int, bytes]) -> None:
        """Forget a round after it lingers long enough for slow readers of its results."""
        self._finished[key] = None
        while len(self._finished) > _FINISHED_MEMORY:
            self._finished.pop(next(iter(self._finished)))

        async def linger() -> None:
            try:
                await asyncio.sleep(_LINGER_SECONDS)
            finally:
                active = self._rounds.pop(key, None)
                if active is not None and active.reducer is not None:
                    await active.reducer.close()

        task = asyncio.create_task(linger(), name=f"retire-round-{key[0]}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- AggregateHandler: streams from peers ---------------------------------------------------

    async def open_session(self, header: StreamHeader) -> SenderSession:
        if header.run_id != self.config.run_id or header.spec_hash != self.config.spec_hash:
            raise ProtocolViolation(
                ResultCode.WRONG_RUN,
                f"this node is in run {self.config.run_id!r} spec "
                f"{self.config.spec_hash.hex()[:12]}, the stream is for run "
                f"{quote(header.run_id)} spec {header.spec_hash.hex()[:12]}",
            )
        key = (header.round, header.group_id)
        active = await self._wait_for_round(key)
        try:
            member = active.group.index(header.sender)
        except KeyError:
            raise ProtocolViolation(
                ResultCode.NOT_A_MEMBER, f"{header.sender} is not in group of round {header.round}"
            ) from None
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
        )

    async def _wait_for_round(self, key: tuple[int, bytes]) -> _ActiveRound:
        if key in self._finished and key not in self._rounds:
            raise ProtocolViolation(ResultCode.UNKNOWN_ROUND, f"round {key[0]} has ended here")
        if key not in self._rounds:
            if self._early_streams >= MAX_EARLY_STREAMS:
                raise ProtocolViolation(
                    ResultCode.OVERLOADED, "too many streams are waiting for rounds to start"
                )
            self._early_streams += 1
            try:
                with contextlib.suppress(TimeoutError):
                    async with (
                        asyncio.timeout(self.config.join_timeout_seconds),
                        self._rounds_changed,
                    ):
                        await self._rounds_changed.wait_for(lambda: key in self._rounds)
            finally:
                self._early_streams -= 1
        active = self._rounds.get(key)
        if active is None:
            raise ProtocolViolation(
                ResultCode.UNKNOWN_ROUND,
                f"no round {key[0]} with group {key[1].hex()[:12]} here "
                f"(waited {self.config.join_timeout_seconds:g} s)",
            )
        return active

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        """The node's (cached) channel to ``endpoint``, with the node's transport limits."""
        if self.route is not None:
            endpoint = self.route(endpoint)
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self._channels[endpoint] = open_channel(endpoint, self.limits)
        return channel
