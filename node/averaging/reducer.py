"""The owner's side of one part in a round: accumulate the members' chunks, publish averages.

Chunks are reduced in order. Chunk ``i`` is complete once every member still in the round has
delivered its chunk ``i``; the owner then divides the fp32 sum by the total weight of the members
that contributed, encodes the result once, and hands the same bytes to every member's stream
(and decodes them for itself, so the owner holds exactly what the others decode).

A member that hangs up, times out or sends an invalid chunk is dropped: chunks it already
delivered keep its values, later ones are averaged without it, and each chunk's result lists its
contributors, so nobody mistakes a partial average for a full one. A member may run at most
``max_chunks_ahead`` chunks ahead of the oldest unfinished chunk, which bounds the owner's memory
to that many accumulators.

:class:`OwnerRules` say how the owner combines the values: an aggregation rule other than the
mean (``node/trust/aggregate.py``: screening, CenteredClip, medians, uniform weights) keeps every
member's values of a chunk instead of a running sum (``max_chunks_ahead`` x members x chunk);
results may travel in a codec of their own. With a ``residual`` (a codec whose traits ask for
owner feedback: top-k results keep a fraction of the merged members' values), the owner adds its
residual's values to each chunk's average before encoding it and keeps there what the encoding
dropped, for its next result of those values: delayed, not lost, and every member still decodes
the same bytes. The run's policy plays the owner's side
(:class:`~swarmgrad.node.averaging.sides.OwnerSide`): it checks and keeps each member's chunk,
notes what each aggregated chunk showed, and signs what the owner sends every member after its
last result (an open run's account of the part: ``open/``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import torch

from swarmgrad.compression import Codec, Meta, decode
from swarmgrad.node.averaging.group import Group, chunk_offsets
from swarmgrad.node.averaging.hooks import OwnerHooks
from swarmgrad.node.averaging.sides import OwnerSide, TrustedOwner
from swarmgrad.node.trust.aggregate import Aggregator, aggregate
from swarmgrad.node.trust.ledger import Flag
from swarmgrad.protocol.averaging import ChunkResult
from swarmgrad.protocol.errors import ProtocolViolation, SwarmgradError
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.protocol.v1.auth_pb2 import Auth
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerRules:
    """How an owner combines its members' values (the defaults: a trusted run's weighted mean)."""

    aggregator: Aggregator = Aggregator.MEAN
    #: Every member counts the same, whatever weight (samples) it declares.
    uniform_weights: bool = False
    #: The codec results travel in (None: the round's own).
    result_codec: Codec | None = None
    #: The owner's own values stay out of its part (the policy's rule: open runs' checks could
    #: not see them).
    owner_abstains: bool = False
    #: A member that opens no stream within this long is dropped.
    open_timeout_seconds: float = 10.0
    #: How many chunks a member may run ahead of the oldest unfinished one.
    max_chunks_ahead: int = 4

    @property
    def buffered(self) -> bool:
        """Whether every member's values of a chunk are kept (any rule but the mean)."""
        return self.aggregator is not Aggregator.MEAN


class PartReducer:
    """Reduces the part ``part`` of ``group`` at its owner."""

    def __init__(
        self,
        *,
        group: Group,
        part: int,
        chunk_numels: Sequence[int],
        codec: Codec,
        rules: OwnerRules | None = None,
        side: OwnerSide | None = None,
        hooks: OwnerHooks | None = None,
        residual: torch.Tensor | None = None,
    ) -> None:
        """``side``: the run's policy's side of this part (``sides.py``; trusted by default);
        ``hooks``: fault injection from outside (tests, simulations); ``residual``: the owner's
        error feedback over the part's values (fp32, on the CPU), read and moved on in place."""
        self.group = group
        self.part = part
        self.chunk_numels = list(chunk_numels)
        self.codec = codec
        self.rules = rules or OwnerRules()
        self.side = side or TrustedOwner()
        self.result_codec = self.rules.result_codec or codec
        if residual is not None and residual.numel() != sum(self.chunk_numels):
            raise ValueError("the owner's residual must cover the part")
        self._residual = None if self.result_codec.lossless else residual
        self._offsets = chunk_offsets(self.chunk_numels)
        self._max_ahead = self.rules.max_chunks_ahead
        self._buffered = self.rules.buffered or self.side.buffered
        total = sum(m.weight for m in group.members)
        # Weights relative to the group's total keep fp32 sums in a sane range.
        self._alpha = (
            [1.0 / len(group.members)] * len(group.members)
            if self.rules.uniform_weights
            else [m.weight / total for m in group.members]
        )
        n = len(self.chunk_numels)
        self._sums: list[torch.Tensor | None] = [None] * n
        self._inputs: list[dict[int, torch.Tensor]] = [{} for _ in range(n)]
        self._weights = [0.0] * n
        self._contributors: list[list[int]] = [[] for _ in range(n)]
        self._delivered = {
            m: 0 for m in range(len(group.members)) if not (m == part and self.rules.owner_abstains)
        }
        self.dropped: dict[int, str] = {}
        self._opened: set[int] = {part}  # the owner feeds its own values without a stream
        self._loop = asyncio.get_running_loop()
        #: When each member was last heard from (the part's start, its stream, its last chunk).
        self.heard = {m: self._loop.time() for m in self._delivered}
        self._results: list[asyncio.Future[ChunkResult | None]] = [
            self._loop.create_future() for _ in range(n)
        ]
        self.decoded: list[torch.Tensor | None] = [None] * n
        self._finalized = 0
        self._hooks = hooks
        self._account: asyncio.Future[averaging_pb2.Signed | None] = self._loop.create_future()
        self._progress = asyncio.Event()
        self._finalizer = asyncio.create_task(self._finalize_in_order(), name=f"reduce-part-{part}")
        self._watchdog = self._loop.call_later(self.rules.open_timeout_seconds, self._drop_silent)

    # -- members' input -----------------------------------------------------------------------

    def open(self, member: int) -> None:
        """Register ``member``'s stream; a second stream from it is a duplicate."""
        if member in self._opened:
            raise ProtocolViolation(
                ResultCode.DUPLICATE_PART, f"{self._name(member)} already streams part {self.part}"
            )
        if member in self.dropped:
            raise ProtocolViolation(
                ResultCode.ABORTED, f"{self._name(member)} was dropped: {self.dropped[member]}"
            )
        self._opened.add(member)
        self.heard[member] = self._loop.time()

    async def accept(
        self,
        member: int,
        index: int,
        values: torch.Tensor,
        chunk: averaging_pb2.Chunk | None = None,
    ) -> None:
        """Add ``member``'s decoded chunk ``index`` (fp32, validated by the caller; ``chunk``:
        what arrived, for the policy's side to keep)."""
        while index >= self._finalized + self._max_ahead and member not in self.dropped:
            self._progress.clear()
            await self._progress.wait()
        if member in self.dropped:
            raise ProtocolViolation(
                ResultCode.ABORTED, f"{self._name(member)} was dropped: {self.dropped[member]}"
            )
        if index != self._delivered[member]:  # pragma: no cover - the servicer orders chunks
            raise ProtocolViolation(ResultCode.BAD_SHAPE, f"chunk {index} out of order")
        if chunk is not None:
            self.side.keep(member, index, chunk)
        if self._buffered:
            self._inputs[index][member] = values.clone()
        elif (total := self._sums[index]) is None:
            self._sums[index] = values.mul(self._alpha[member])
        else:
            total.add_(values, alpha=self._alpha[member])
        self._weights[index] += self._alpha[member]
        self._contributors[index].append(member)
        self._delivered[member] = index + 1
        self.heard[member] = self._loop.time()
        self._notify()

    def drop(self, member: int, reason: str, *, flag: Flag | None = None) -> None:
        """Stop waiting for ``member``: later chunks are averaged without it (``flag``: what
        its values showed, for the trust ledger)."""
        if flag is not None:
            self.side.flag(member, flag)
        if member in self.dropped or self._delivered[member] == len(self.chunk_numels):
            return
        self.dropped[member] = reason
        self._notify()

    def drop_if_silent(self, member: int, reason: str) -> None:
        """Drop ``member`` unless it has a stream open here (its stream then decides its fate).

        For evidence from elsewhere that it is gone (a failed call to it): a status seen on our
        own call to a peer is not proof enough to discard chunks it is sending us.
        """
        if member not in self._opened:
            self.drop(member, reason)

    def _drop_silent(self) -> None:
        for member in self._delivered:
            if member not in self._opened:
                self.drop(member, "opened no stream in time")

    def holding_up(self) -> list[int]:
        """The members the next chunk waits for: neither dropped nor done, and behind it."""
        return [
            m
            for m, d in self._delivered.items()
            if m != self.part and m not in self.dropped and d <= self._finalized
            and d < len(self.chunk_numels)
        ]  # fmt: skip

    def expire(self, reason: str = "round deadline passed") -> None:
        """Drop every member that has not delivered everything (at the round deadline)."""
        for member in self._delivered:
            self.drop(member, reason)

    # -- results -------------------------------------------------------------------------------

    async def result(self, index: int) -> ChunkResult | None:
        """The averaged chunk, or None if nobody's values reached it."""
        return await asyncio.shield(self._results[index])

    async def account(self) -> averaging_pb2.Signed | None:
        """What the policy's side signs of the part, once every chunk is finalized."""
        return await asyncio.shield(self._account)

    async def results(self) -> AsyncIterator[ChunkResult]:
        for index in range(len(self.chunk_numels)):
            result = await self.result(index)
            if result is None:
                raise ProtocolViolation(ResultCode.ABORTED, f"chunk {index} has no contributors")
            yield result

    @property
    def done(self) -> bool:
        return self._finalized == len(self.chunk_numels)

    async def finished(self, *, timeout_seconds: float) -> None:
        """Wait (up to ``timeout_seconds``) until every chunk is finalized or abandoned."""
        await asyncio.wait({self._finalizer}, timeout=timeout_seconds)

    async def close(self) -> None:
        self._watchdog.cancel()
        self.expire("reducer closed")
        if not self._finalizer.done():
            try:
                await self._finalizer
            except asyncio.CancelledError:
                if not self._finalizer.cancelled():
                    raise

    # -- internals -----------------------------------------------------------------------------

    def _notify(self) -> None:
        self._progress.set()

    def _ready_upto(self) -> int:
        live = [d for m, d in self._delivered.items() if m not in self.dropped]
        return min(live) if live else len(self.chunk_numels)

    async def _finalize_in_order(self) -> None:
        n = len(self.chunk_numels)
        try:
            while self._finalized < n:
                while self._finalized >= self._ready_upto():
                    self._progress.clear()
                    await self._progress.wait()
                index = self._finalized
                total, weight = self._sums[index], self._weights[index]
                self._sums[index] = None
                contributors = sorted(self._contributors[index])
                if self._buffered and contributors:
                    total, contributors = await asyncio.to_thread(self._aggregate, index)
                    weight = 1.0
                result: ChunkResult | None = None
                if total is not None and weight > 0 and contributors:
                    if self._hooks is not None:
                        total = self._hooks.result(index, total)
                    payload, meta, mine = await asyncio.to_thread(
                        self._publish, index, total, weight
                    )
                    result = ChunkResult(
                        index=index,
                        payload=payload,
                        meta=meta,
                        contributors=tuple(contributors),
                    )
                    self.decoded[index] = mine
                self.side.published(index, None if result is None else result.payload)
                self._results[index].set_result(result)
                self._finalized += 1
                self._notify()
            self._account.set_result(self.side.account())
        except BaseException as error:
            if not self._account.done():
                self._account.set_result(None)
            for future in self._results:
                if not future.done():
                    future.set_exception(
                        error if isinstance(error, SwarmgradError) else asyncio.CancelledError()
                    )
            raise

    def _aggregate(self, index: int) -> tuple[torch.Tensor, list[int]]:
        """Combine the chunk's buffered inputs by the owner's rule; the policy's side notes what
        each member looked like."""
        inputs = self._inputs[index]
        self._inputs[index] = {}
        members = sorted(inputs)
        stack = torch.stack([inputs[m] for m in members])
        inputs.clear()
        weights = [self._alpha[m] for m in members]
        bound = self.side.bound(index)
        outcome = aggregate(stack, self.rules.aggregator, weights=weights, bound=bound)
        self.side.aggregated(index, members, stack, outcome)
        return outcome.value, [members[k] for k in outcome.used]

    def _publish(
        self, index: int, total: torch.Tensor, weight: float
    ) -> tuple[bytes | memoryview, Meta, torch.Tensor]:
        average = total.div_(weight) if weight != 1.0 else total
        residual = None
        if self._residual is not None:
            start, end = self._offsets[index]
            residual = self._residual[start:end]
            average = average.add_(residual)
        # The payload may be a view of `average`, which nobody modifies after this point.
        codec = self.result_codec
        payload, meta = codec.encode_view(average)
        if codec.lossless:
            return payload, meta, average  # what members decode, bit for bit
        mine = decode(payload, meta)
        if residual is not None:
            torch.sub(average, mine.reshape(-1), out=residual)
        return payload, meta, mine

    def _name(self, member: int) -> str:
        return self.group.members[member].peer_id


class SenderSession:
    """One member's stream into a :class:`PartReducer` (the servicer's view of it)."""

    def __init__(
        self,
        reducer: PartReducer,
        member: int,
        *,
        max_chunk_bytes: int,
        sender_timeout_seconds: float,
        commitment: bytes = b"",
        auth: Auth | None = None,
    ) -> None:
        reducer.open(member)
        reducer.side.opened(member, commitment, auth)
        self._reducer = reducer
        self._member = member
        self._public_key = b"" if auth is None else bytes(auth.public_key)
        self.codec = (reducer.codec.name, reducer.codec.version)
        self.chunk_numels = reducer.chunk_numels
        self.max_chunk_bytes = max_chunk_bytes
        self.sender_timeout_seconds = sender_timeout_seconds

    async def accept(self, index: int, values: torch.Tensor, chunk: averaging_pb2.Chunk) -> None:
        self._reducer.side.verify(self._member, self._public_key, chunk)
        await self._reducer.accept(self._member, index, values, chunk)

    def results(self) -> AsyncIterator[ChunkResult]:
        return self._reducer.results()

    async def account(self) -> averaging_pb2.Signed | None:
        return await self._reducer.account()

    def close(self, error: SwarmgradError | None) -> None:
        if error is not None:
            non_finite = (
                isinstance(error, ProtocolViolation) and error.code == ResultCode.NON_FINITE
            )
            self._reducer.drop(
                self._member, str(error), flag=Flag.NON_FINITE if non_finite else None
            )
