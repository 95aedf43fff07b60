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

With :class:`OwnerRules` for an open run, the owner keeps every member's values of a chunk
instead of a running sum (``max_chunks_ahead`` x members x chunk), aggregates them robustly
(``node/trust/aggregate.py``: screening, CenteredClip or the coordinate median, uniform weights),
publishes the result with its own codec (fp16: a lossy return path would hide an owner's small
lies from later checks), and keeps an :class:`Observation` of each member for the node's
:class:`TrustLedger`. It also keeps every member's chunks as they arrived and, once every result
is out, signs a :class:`PartAccount` of its part (per chunk: the result's hash, the contributors,
their clip coefficients and payload hashes; the members' commitments), which it sends after the
last result: members check it (``checks.py``). In an open run the owner's own values are not in
its part: nobody could check what it claims of them.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import torch

from swarmgrad.compression import Codec, Meta, decode
from swarmgrad.node.averaging.group import Group
from swarmgrad.node.averaging.hooks import OwnerHooks
from swarmgrad.node.trust.aggregate import Aggregator, aggregate
from swarmgrad.node.trust.ledger import Flag, Observation, observe_chunk
from swarmgrad.protocol.auth import Signer
from swarmgrad.protocol.averaging import ACCOUNT_STATEMENT, ChunkResult, chunk_signed_by, seal
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
    #: Keep every member's values of a chunk and an Observation of each (open runs).
    observe: bool = False

    @property
    def buffered(self) -> bool:
        return self.observe or self.aggregator is not Aggregator.MEAN

    @property
    def owner_abstains(self) -> bool:
        """The owner's own values stay out of its part (open runs: checks cannot see them)."""
        return self.observe


class PartReducer:
    """Reduces the part ``part`` of ``group`` at its owner."""

    def __init__(
        self,
        *,
        group: Group,
        part: int,
        chunk_numels: Sequence[int],
        codec: Codec,
        open_timeout_seconds: float,
        max_chunks_ahead: int = 4,
        rules: OwnerRules | None = None,
        offset: int = 0,
        signer: Signer | None = None,
        key: averaging_pb2.RoundKey | None = None,
        hooks: OwnerHooks | None = None,
        probes: Sequence[int] = (),
    ) -> None:
        """``offset``: where the part starts in the round's vector (names chunks for replay
        checks); ``signer`` and ``key``: to sign the part's account (open runs); ``hooks``: fault
        injection from outside (tests, simulations); ``probes``: members whose values of the
        part are kept whole, for a spot check after the round."""
        self.group = group
        self.part = part
        self.chunk_numels = list(chunk_numels)
        self.codec = codec
        self.rules = rules or OwnerRules()
        self.result_codec = self.rules.result_codec or codec
        self.offset = offset
        self._max_ahead = max_chunks_ahead
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
        #: What the owner saw of each member (with ``rules.observe``), by member index.
        self.observations: dict[int, Observation] = {}
        self._weights = [0.0] * n
        self._contributors: list[list[int]] = [[] for _ in range(n)]
        self._delivered = {
            m: 0 for m in range(len(group.members)) if not (m == part and self.rules.owner_abstains)
        }
        self.dropped: dict[int, str] = {}
        self._opened: set[int] = {part}  # the owner feeds its own values without a stream
        self._loop = asyncio.get_running_loop()
        self._results: list[asyncio.Future[ChunkResult | None]] = [
            self._loop.create_future() for _ in range(n)
        ]
        self.decoded: list[torch.Tensor | None] = [None] * n
        self._finalized = 0
        #: Open runs: each member's chunks as received, and what the account says of them.
        self.chunks: list[dict[int, averaging_pb2.Chunk]] = [{} for _ in range(n)]
        self._digests: list[dict[int, bytes]] = [{} for _ in range(n)]
        self._accounts = [averaging_pb2.ChunkAccount() for _ in range(n)]
        self.commitments: dict[int, tuple[bytes, Auth]] = {}
        self._signer, self.key = signer, key
        self._hooks = hooks
        #: The values of the members in ``probes``, by chunk (None: not received).
        self.probed: dict[int, list[torch.Tensor | None]] = {m: [None] * n for m in probes}
        self._account: asyncio.Future[averaging_pb2.Signed | None] = self._loop.create_future()
        self._progress = asyncio.Event()
        self._finalizer = asyncio.create_task(self._finalize_in_order(), name=f"reduce-part-{part}")
        self._watchdog = self._loop.call_later(open_timeout_seconds, self._drop_silent)

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

    def commit(self, member: int, commitment: bytes, auth: Auth | None) -> None:
        """Note the commitment ``member``'s stream header carried, with the header's signature
        (open runs)."""
        if commitment and auth is not None:
            self.commitments[member] = (commitment, auth)

    async def accept(
        self,
        member: int,
        index: int,
        values: torch.Tensor,
        chunk: averaging_pb2.Chunk | None = None,
    ) -> None:
        """Add ``member``'s decoded chunk ``index`` (fp32, validated by the caller; ``chunk``:
        what arrived, kept in open runs)."""
        while index >= self._finalized + self._max_ahead and member not in self.dropped:
            self._progress.clear()
            await self._progress.wait()
        if member in self.dropped:
            raise ProtocolViolation(
                ResultCode.ABORTED, f"{self._name(member)} was dropped: {self.dropped[member]}"
            )
        if index != self._delivered[member]:  # pragma: no cover - the servicer orders chunks
            raise ProtocolViolation(ResultCode.BAD_SHAPE, f"chunk {index} out of order")
        if self.rules.observe and chunk is not None:
            kept = averaging_pb2.Chunk()
            kept.CopyFrom(chunk)
            self.chunks[index][member] = kept
            self._digests[index][member] = hashlib.sha256(chunk.payload).digest()
        if self.rules.buffered:
            self._inputs[index][member] = values.clone()
        elif (total := self._sums[index]) is None:
            self._sums[index] = values.mul(self._alpha[member])
        else:
            total.add_(values, alpha=self._alpha[member])
        self._weights[index] += self._alpha[member]
        self._contributors[index].append(member)
        self._delivered[member] = index + 1
        self._notify()

    def drop(self, member: int, reason: str, *, flag: Flag | None = None) -> None:
        """Stop waiting for ``member``: later chunks are averaged without it (``flag``: what
        its values showed, for the trust ledger)."""
        if flag is not None and self.rules.observe:
            self.observations.setdefault(member, Observation()).flags.add(flag)
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

    def expire(self, reason: str = "round deadline passed") -> None:
        """Drop every member that has not delivered everything (at the round deadline)."""
        for member in self._delivered:
            self.drop(member, reason)

    # -- results -------------------------------------------------------------------------------

    async def result(self, index: int) -> ChunkResult | None:
        """The averaged chunk, or None if nobody's values reached it."""
        return await asyncio.shield(self._results[index])

    async def account(self) -> averaging_pb2.Signed | None:
        """The signed account of the part, once every chunk is finalized (open runs)."""
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
                if self.rules.buffered and contributors:
                    total, contributors = await asyncio.to_thread(self._aggregate, index)
                    weight = 1.0
                result: ChunkResult | None = None
                if total is not None and weight > 0 and contributors:
                    if self._hooks is not None:
                        total = self._hooks.result(index, total)
                    payload, meta, mine = await asyncio.to_thread(self._publish, total, weight)
                    result = ChunkResult(
                        index=index,
                        payload=payload,
                        meta=meta,
                        contributors=tuple(contributors),
                    )
                    self.decoded[index] = mine
                    self._accounts[index].result_sha256 = hashlib.sha256(payload).digest()
                self._results[index].set_result(result)
                self._finalized += 1
                self._notify()
            self._account.set_result(self._sign_account())
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
        """Robustly combine the chunk's buffered inputs; note what each member looked like."""
        inputs = self._inputs[index]
        self._inputs[index] = {}
        for member, kept in self.probed.items():
            kept[index] = inputs.get(member)  # clones, never written after (see accept)
        members = sorted(inputs)
        stack = torch.stack([inputs[m] for m in members])
        inputs.clear()
        weights = [self._alpha[m] for m in members]
        outcome = aggregate(stack, self.rules.aggregator, weights=weights)
        if self.rules.observe:
            account = self._accounts[index]
            for k in outcome.used:
                account.contributors.append(members[k])
                account.clip.append(outcome.clip[k])
                account.payload_sha256.append(self._digests[index].get(members[k], b""))
            position = (self.offset + sum(self.chunk_numels[:index]), self.chunk_numels[index])
            observe_chunk(self.observations, members, stack, outcome, position)
        return outcome.value, [members[k] for k in outcome.used]

    def _sign_account(self) -> averaging_pb2.Signed | None:
        if not self.rules.observe or self._signer is None or self.key is None:
            return None
        members = sorted(self.commitments)
        account = averaging_pb2.PartAccount(
            key=self.key,
            owner=self.group.members[self.part].peer_id,
            part=self.part,
            chunks=self._accounts,
            members=members,
            commitments=[self.commitments[m][0] for m in members],
            header_auths=[self.commitments[m][1] for m in members],
        )
        return seal(self._signer, ACCOUNT_STATEMENT, account)

    def _publish(
        self, total: torch.Tensor, weight: float
    ) -> tuple[bytes | memoryview, Meta, torch.Tensor]:
        average = total.div_(weight) if weight != 1.0 else total
        # The payload may be a view of `average`, which nobody modifies after this point.
        codec = self.result_codec
        payload, meta = codec.encode_view(average)
        if codec.lossless:
            return payload, meta, average  # what members decode, bit for bit
        return payload, meta, decode(payload, meta)

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
        reducer.commit(member, commitment, auth)
        self._reducer = reducer
        self._member = member
        self._public_key = b"" if auth is None else bytes(auth.public_key)
        self._sender = reducer.group.members[member].peer_id
        self.codec = (reducer.codec.name, reducer.codec.version)
        self.chunk_numels = reducer.chunk_numels
        self.max_chunk_bytes = max_chunk_bytes
        self.sender_timeout_seconds = sender_timeout_seconds

    async def accept(self, index: int, values: torch.Tensor, chunk: averaging_pb2.Chunk) -> None:
        reducer = self._reducer
        if reducer.rules.observe and not (
            reducer.key is not None
            and chunk_signed_by(self._public_key, reducer.key, self._sender, reducer.part, chunk)
        ):
            raise ProtocolViolation(
                ResultCode.UNAUTHENTICATED, f"chunk {index} is not signed by {self._sender}"
            )
        await reducer.accept(self._member, index, values, chunk)

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
