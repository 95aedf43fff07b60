"""One member's side of a butterfly all-reduce round, and what a round guarantees.

The flat fp32 vector is cut into one part per member, sized by bandwidth (``Group.partition``).
For every other member's part, this member opens one stream to that owner, sends its values of
the part chunk by chunk (encoded with the round's codec, a couple of chunks ahead of the wire),
and reads back each averaged chunk on the same stream as soon as the owner has it. Its own part
it reduces locally with a :class:`PartReducer` that the other members stream into. Encoding,
sending, receiving and decoding overlap; the only whole-vector copy is the result.

Failure semantics
-----------------
* Deadlines: the round ends by ``round_timeout_seconds`` whatever happens. An owner drops a
  member whose next chunk does not arrive within ``sender_timeout_seconds``; a member gives up
  on an owner whose next averaged chunk does not arrive within ``reducer_timeout_seconds``
  (longer, since an owner legitimately waits up to a sender timeout for the slowest member).
* A member that dies, stalls or sends an invalid chunk is dropped by every owner: chunks it
  already delivered keep its values, later chunks are averaged over the others, and every chunk
  carries its contributor list.
* An owner that dies or stalls takes its part with it: the chunks of that part that had not
  arrived are *missing*. In the result they hold the caller's own (unaveraged) values and are
  listed in ``RoundResult.missing`` so the caller can treat them as not averaged (the trainer
  applies no update there and keeps its delta for the next round). Nothing is silently left
  unaveraged.
* All members that receive a chunk receive the same bytes from its owner, so their averaged
  values are bit-identical wherever they are not missing.
* The round raises :class:`RoundAborted` if no chunk was averaged with anyone but this member
  (every other member failed, or the deadline passed first). The caller's tensors are never
  modified, whether the round succeeds or not: the result is a new tensor.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import torch

from swarmgrad.compression import Codec, Meta, decode, get_codec
from swarmgrad.node.averaging.group import Group, chunk_sizes
from swarmgrad.node.averaging.reducer import PartReducer
from swarmgrad.node.kinds import Failure
from swarmgrad.protocol.auth import Signer
from swarmgrad.protocol.averaging import (
    StreamHeader,
    aggregate_method,
    check_chunk,
    decode_chunk,
    framed_chunk,
    header_to_proto,
)
from swarmgrad.protocol.errors import (
    PeerUnavailable,
    ProtocolViolation,
    RoundAborted,
    SwarmgradError,
    from_rpc_error,
)
from swarmgrad.protocol.framing import Framed
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

_MIN_CHUNK_VALUES = 1024
_MAX_CHUNK_VALUES = 1 << 24


@dataclass(frozen=True, slots=True, kw_only=True)
class AllReduceConfig:
    """What every member of a run must agree on for its all-reduce rounds."""

    run_id: str
    spec_hash: bytes
    codec: str = "int8"
    codec_options: Mapping[str, float] = field(default_factory=dict)
    #: Values per streamed chunk (1 Mi fp32 = 4 MiB before compression).
    chunk_values: int = 1 << 20
    round_timeout_seconds: float = 60.0
    sender_timeout_seconds: float = 10.0
    reducer_timeout_seconds: float = 20.0
    #: How long a stream that arrives before the local round has started may wait for it.
    join_timeout_seconds: float = 5.0
    max_chunks_ahead: int = 4

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ValueError("run_id must not be empty")
        get_codec(self.codec, **self.codec_options)  # raises ValueError for a bad codec
        if not _MIN_CHUNK_VALUES <= self.chunk_values <= _MAX_CHUNK_VALUES:
            raise ValueError(
                f"chunk_values must be in [{_MIN_CHUNK_VALUES}, {_MAX_CHUNK_VALUES}], "
                f"got {self.chunk_values}"
            )
        timeouts = (
            self.sender_timeout_seconds,
            self.reducer_timeout_seconds,
            self.round_timeout_seconds,
            self.join_timeout_seconds,
        )
        if not all(math.isfinite(t) and t > 0 for t in timeouts):
            raise ValueError("timeouts must be positive and finite")
        if not self.sender_timeout_seconds < self.reducer_timeout_seconds:
            raise ValueError(
                "reducer_timeout_seconds must exceed sender_timeout_seconds: an owner may wait "
                "a whole sender timeout for the slowest member before it can answer"
            )
        if not self.reducer_timeout_seconds <= self.round_timeout_seconds:
            raise ValueError("round_timeout_seconds must be at least reducer_timeout_seconds")
        if self.max_chunks_ahead < 1:
            raise ValueError("max_chunks_ahead must be at least 1")

    def make_codec(self) -> Codec:
        return get_codec(self.codec, **self.codec_options)

    @property
    def max_chunk_bytes(self) -> int:
        """Largest payload a chunk may have: uncompressed fp32 plus slack for codec metadata."""
        return 4 * self.chunk_values + 64 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundResult:
    """What a round produced. See the module docstring for the exact guarantees."""

    averaged: torch.Tensor
    #: Members whose values are in every averaged chunk.
    contributors: tuple[str, ...]
    #: Members whose values are in some averaged chunks but not all (they failed mid-round).
    partial: tuple[str, ...]
    #: [start, end) ranges that were not averaged: they hold the caller's own values.
    missing: tuple[tuple[int, int], ...]
    #: Why each failed peer failed, as seen from this member.
    failures: Mapping[str, str]
    #: Each failed peer's kind of failure (timeout, protocol violation or dropped member).
    failure_kinds: Mapping[str, Failure] = field(default_factory=dict)
    #: With ``keep_sent``: this member's contribution as its owners decode it (its own part
    #: exact, every other chunk as encoded once and sent, chunks never sent exact).
    #: ``vector - sent`` is what the codec lost: the error feedback a caller carries on.
    sent: torch.Tensor | None = None

    @property
    def complete(self) -> bool:
        return not self.missing and not self.partial


class RoundHooks(Protocol):
    """Extension point for fault injection (tests, simulations): sees every outgoing chunk."""

    async def before_send(self, owner: int, index: int, payload: bytes) -> bytes:
        """Called with each encoded chunk before it goes to ``owner``; returns what to send."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundPlan:
    """Who this member is in one round, and what it runs the round with."""

    me: int  # this member's index in the group
    group: Group
    #: This member's key: signs the header of every stream.
    signer: Signer
    config: AllReduceConfig
    #: Reduces this member's own part (None: it owns none).
    reducer: PartReducer | None
    #: The channel to an owner's endpoint (the node's transport).
    channel: Callable[[str], grpc.aio.Channel]
    #: Payload bytes this member sends ("sent") and receives ("received") as a client; the
    #: servicer counts its own side.
    traffic: Counter[str]
    hooks: RoundHooks | None = None
    #: Waits until so many bytes may go up the node's link (its upload cap), if any.
    pace: Callable[[int], Awaitable[None]] | None = None
    #: Report what the owners decode of this member's values (``RoundResult.sent``).
    keep_sent: bool = False


@dataclass(slots=True, kw_only=True)
class _Round:
    """What one member's tasks of one round share, and what they learn."""

    plan: RoundPlan
    deadline: float
    #: What owners decode of this member's values (None: not kept).
    sent: torch.Tensor | None = None
    #: Per (part, chunk): the contributors of what this member received (absent: missing).
    contributors: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    failure_kinds: dict[str, Failure] = field(default_factory=dict)

    @property
    def me(self) -> int:
        return self.plan.me

    @property
    def group(self) -> Group:
        return self.plan.group

    @property
    def config(self) -> AllReduceConfig:
        return self.plan.config

    def fail(self, peer: str, kind: Failure, reason: str) -> None:
        self.failures[peer] = reason
        self.failure_kinds[peer] = kind


async def run_round(
    plan: RoundPlan, vector: torch.Tensor, *, out: torch.Tensor | None = None
) -> RoundResult:
    """Run this member's side of one round of ``vector`` (into ``out``, if given)."""
    loop = asyncio.get_running_loop()
    me, group = plan.me, plan.group
    state = _Round(
        plan=plan,
        deadline=loop.time() + plan.config.round_timeout_seconds,
        # Chunks never encoded (their owner failed first) count as sent exactly.
        sent=vector.clone() if plan.keep_sent else None,
    )
    bounds = group.partition(vector.numel())
    # Every averaged chunk is decoded straight into `out`; missing ones get the caller's values
    # at the end. (A caller's reused buffer also spares a whole-vector page-faulting alloc.)
    out = torch.empty_like(vector) if out is None else out
    tasks: dict[int, asyncio.Task[None]] = {}
    for part, (start, end) in enumerate(bounds):
        if start == end:
            continue
        if part == me:
            coro = _reduce_own_part(state, vector[start:end], out[start:end])
        else:
            coro = _exchange_with_owner(state, part, vector[start:end], out[start:end])
        tasks[part] = asyncio.create_task(coro, name=f"round-{group.round}-part-{part}")
    try:
        if tasks:
            _, pending = await asyncio.wait(tasks.values(), timeout=state.deadline - loop.time())
            for part, task in tasks.items():
                if task in pending:
                    task.cancel()
                    peer = group.members[part].peer_id
                    if peer not in state.failures:
                        state.fail(peer, Failure.TIMEOUT, "round deadline passed")
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        for task in tasks.values():
            task.cancel()
        if plan.reducer is not None:
            plan.reducer.expire()
    result = _summarize(state, bounds, out)
    for start, end in result.missing:
        out[start:end] = vector[start:end]
    return result


async def _reduce_own_part(state: _Round, values: torch.Tensor, out: torch.Tensor) -> None:
    reducer = state.plan.reducer
    assert reducer is not None  # a member with a part has a reducer for it
    offsets = _offsets(reducer.chunk_numels)
    for index, (start, end) in enumerate(offsets):
        await reducer.accept(state.me, index, values[start:end])
    for index, (start, end) in enumerate(offsets):
        result = await reducer.result(index)
        decoded = reducer.decoded[index]
        if result is None or decoded is None:
            continue
        out[start:end] = decoded
        state.contributors[(state.me, index)] = result.contributors


async def _exchange_with_owner(
    state: _Round, part: int, values: torch.Tensor, out: torch.Tensor
) -> None:
    plan = state.plan
    group, config, hooks, traffic = plan.group, plan.config, plan.hooks, plan.traffic
    owner = group.members[part]
    numels = chunk_sizes(values.numel(), config.chunk_values)
    offsets = _offsets(numels)
    codec = config.make_codec()
    queue: asyncio.Queue[Framed | None] = asyncio.Queue(maxsize=2)
    sent = None
    if state.sent is not None:
        first = group.partition(state.sent.numel())[part][0]
        sent = state.sent[first : first + values.numel()]

    async def produce() -> None:
        try:
            for index, (start, end) in enumerate(offsets):
                # A view of `values` for the identity codec: the caller's vector is not
                # modified during the round.
                payload, meta = await asyncio.to_thread(
                    _encode, codec, values[start:end], None if sent is None else sent[start:end]
                )
                if hooks is not None:
                    payload = await hooks.before_send(part, index, bytes(payload))
                if plan.pace is not None:  # the node's upload cap
                    await plan.pace(len(payload))
                traffic["sent"] += len(payload)
                await queue.put(framed_chunk(averaging_pb2.AggregateRequest, index, payload, meta))
        except BaseException:
            # End the request stream if there is room; never block here (nobody may be reading).
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(None)
            raise
        await queue.put(None)

    header = header_to_proto(
        StreamHeader(
            run_id=config.run_id,
            spec_hash=config.spec_hash,
            round=group.round,
            group_id=group.group_id,
            sender=group.members[state.me].peer_id,
            receiver=owner.peer_id,
            part=part,
            weight=group.members[state.me].weight,
        ),
        plan.signer,
    )

    async def requests() -> AsyncIterator[Framed | averaging_pb2.AggregateRequest]:
        yield header
        while (request := await queue.get()) is not None:
            yield request

    loop = asyncio.get_running_loop()
    producer = asyncio.create_task(produce())
    call = aggregate_method(plan.channel(owner.endpoint))(
        requests(), timeout=max(0.001, state.deadline - loop.time())
    )
    expected = 0
    try:
        while expected < len(numels):
            async with asyncio.timeout(config.reducer_timeout_seconds):
                response = await call.read()
            if response is grpc.aio.EOF:
                raise PeerUnavailable(f"{owner.peer_id} closed the stream after {expected} chunks")
            traffic["received"] += len(response.chunk.payload)
            start, end = offsets[expected]
            # An owner's average is checked as strictly as owners check members' chunks. If
            # this raises, the chunk is missing and gets the caller's values at the end.
            meta = check_chunk(
                response.chunk,
                index=expected,
                numels=numels,
                codec=(codec.name, codec.version),
                max_bytes=config.max_chunk_bytes,
            )
            _check_contributors(response, group)
            await decode_chunk(response.chunk.payload, meta, out[start:end])
            state.contributors[(part, expected)] = tuple(response.contributors)
            expected += 1
    except grpc.aio.AioRpcError as error:
        failure = from_rpc_error(error, owner.peer_id)
        if isinstance(failure, ProtocolViolation):
            kind = Failure.PROTOCOL_VIOLATION
        elif error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            kind = Failure.TIMEOUT
        else:
            kind = Failure.DROPPED_MEMBER
        state.fail(owner.peer_id, kind, str(failure))
        if isinstance(failure, PeerUnavailable) and plan.reducer is not None:
            # It is gone: stop waiting for its chunks of this member's own part too.
            plan.reducer.drop_if_silent(part, str(failure))
    except TimeoutError:
        state.fail(
            owner.peer_id,
            Failure.TIMEOUT,
            f"no averaged chunk {expected} within {config.reducer_timeout_seconds:g} s",
        )
    except SwarmgradError as error:
        kind = (
            Failure.PROTOCOL_VIOLATION
            if isinstance(error, ProtocolViolation)
            else Failure.DROPPED_MEMBER
        )
        state.fail(owner.peer_id, kind, str(error))
    finally:
        call.cancel()
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)


def _check_contributors(response: averaging_pb2.AggregateResponse, group: Group) -> None:
    contributors = list(response.contributors)
    if (
        not contributors
        or len(set(contributors)) != len(contributors)
        or not all(0 <= c < len(group.members) for c in contributors)
    ):
        raise ProtocolViolation(ResultCode.BAD_PAYLOAD, f"bad contributor list {contributors}")


def _offsets(numels: list[int]) -> list[tuple[int, int]]:
    offsets, start = [], 0
    for numel in numels:
        offsets.append((start, start + numel))
        start += numel
    return offsets


def _encode(
    codec: Codec, values: torch.Tensor, sent: torch.Tensor | None
) -> tuple[bytes | memoryview, Meta]:
    """Encode one chunk, once; with ``sent``, also what its owner will decode of it (the same
    bytes through the same decoder: exact, whatever the codec)."""
    payload, meta = codec.encode_view(values)
    if sent is not None:
        decode(payload, meta, max_numel=sent.numel(), out=sent)
    return payload, meta


def _summarize(state: _Round, bounds: list[tuple[int, int]], out: torch.Tensor) -> RoundResult:
    me, group, config = state.me, state.group, state.config
    ids = [m.peer_id for m in group.members]
    missing: list[tuple[int, int]] = []
    seen_in: dict[int, int] = dict.fromkeys(range(len(ids)), 0)
    averaged_chunks = 0
    with_others = False
    for part, (start, end) in enumerate(bounds):
        for index, (cs, ce) in enumerate(_offsets(chunk_sizes(end - start, config.chunk_values))):
            contributors = state.contributors.get((part, index))
            if contributors is None:
                if missing and missing[-1][1] == start + cs:
                    missing[-1] = (missing[-1][0], start + ce)
                else:
                    missing.append((start + cs, start + ce))
                continue
            averaged_chunks += 1
            with_others |= any(c != me for c in contributors)
            for c in contributors:
                seen_in[c] += 1
    if not with_others:
        reasons = "; ".join(f"{p}: {r}" for p, r in state.failures.items()) or "no peers"
        raise RoundAborted(
            f"round {group.round}: nothing was averaged with another peer ({reasons})"
        )
    return RoundResult(
        sent=state.sent,
        averaged=out,
        contributors=tuple(ids[c] for c, n in seen_in.items() if n == averaged_chunks),
        partial=tuple(ids[c] for c, n in seen_in.items() if 0 < n < averaged_chunks),
        missing=tuple(missing),
        failures=dict(state.failures),
        failure_kinds=dict(state.failure_kinds),
    )
