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
  Sooner, with the plan's ``alive``: an owner whose next averaged chunk is late is asked
  whether it is there, and one that does not answer (a frozen process: its connections neither
  answer nor reset) is gone (``quiet.py``).
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
* The run's policy (``policy.py``) plays this member's side at fixed points: what its stream
  headers commit to, what it signs of each chunk, whether it takes an owner's results once they
  are all in (an open run's member takes them only with a signed account that names the very
  bytes it received: ``open/``), and what it keeps of a part it did not take.
* The round raises :class:`RoundAborted` if no chunk was averaged with anyone but this member
  (every other member failed, or the deadline passed first). The caller's tensors are never
  modified, whether the round succeeds or not: the result is a new tensor.
"""

from __future__ import annotations

__all__ = [
    "AllReduceConfig",
    "Coverage",
    "RoundHooks",
    "RoundPlan",
    "RoundResult",
    "cover",
    "run_round",
]

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import torch

from swarmgrad.compression import Codec, Meta, decode
from swarmgrad.node.averaging.coverage import Coverage, cover
from swarmgrad.node.averaging.group import Group, chunk_offsets, chunk_sizes
from swarmgrad.node.averaging.hooks import RoundHooks
from swarmgrad.node.averaging.plan import (
    AllReduceConfig,
    RoundPlan,
    RoundResult,
)
from swarmgrad.node.averaging.quiet import Unanswered, next_from_owner, watch_senders
from swarmgrad.node.kinds import Failure
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
    #: Owners whose averaged chunk left out this member's values, which it had sent them.
    excluded_by: set[str] = field(default_factory=set)

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
        sent=vector.clone() if plan.keep_sent or plan.side.keeps_sent else None,
    )
    bounds = group.partition(vector.numel())
    # Every averaged chunk is decoded straight into `out`; missing ones get the caller's values
    # at the end. (A caller's reused buffer also spares a whole-vector page-faulting alloc.)
    out = torch.empty_like(vector) if out is None else out
    tasks: dict[int, asyncio.Task[None]] = {}
    watcher = None
    if plan.alive is not None and plan.reducer is not None:  # members holding up our part
        watcher = asyncio.create_task(watch_senders(plan.reducer, plan.alive))
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
        if watcher is not None:
            watcher.cancel()
        if plan.reducer is not None:
            plan.reducer.expire()
    result = _summarize(state, bounds, out)
    for start, end in result.missing:
        out[start:end] = vector[start:end]
    return result


async def _reduce_own_part(state: _Round, values: torch.Tensor, out: torch.Tensor) -> None:
    reducer = state.plan.reducer
    assert reducer is not None  # a member with a part has a reducer for it
    offsets = chunk_offsets(reducer.chunk_numels)
    if not reducer.rules.owner_abstains:
        for index, (start, end) in enumerate(offsets):  # owners reduce on the CPU
            await reducer.accept(state.me, index, values[start:end].cpu())
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
    group, config, traffic, side = plan.group, plan.config, plan.traffic, plan.side
    owner = group.members[part]
    numels = chunk_sizes(values.numel(), config.chunk_values)
    offsets = chunk_offsets(numels)
    codec, result_codec = config.make_codec(), config.make_result_codec()
    queue: asyncio.Queue[Framed | None] = asyncio.Queue(maxsize=2)
    header = _header(state, part)

    async def requests() -> AsyncIterator[Framed | averaging_pb2.AggregateRequest]:
        yield header
        # Chunks follow once the owner accepted the header (its initial metadata). A refusal
        # then ends the call before a chunk is written, and its status reaches this member:
        # gRPC replaces the status of a call that ends during a write by "INTERNAL Internal
        # error from Core" (a quarter of UNKNOWN_ROUND refusals here, before).
        await call.initial_metadata()
        if call.done():
            return
        while (request := await queue.get()) is not None:
            yield request

    loop = asyncio.get_running_loop()
    producer = asyncio.create_task(_produce(state, part, values, codec, queue))
    call = aggregate_method(plan.channel(owner.endpoint))(
        requests(), timeout=max(0.001, state.deadline - loop.time())
    )
    expected = 0
    received: dict[int, tuple[int, ...]] = {}  # until the policy's side takes them
    digests: dict[int, bytes] = {}
    taken = ended_by_owner = False
    try:
        while expected < len(numels):
            response = await next_from_owner(
                call,
                owner,
                timeout_seconds=config.reducer_timeout_seconds,
                alive=plan.alive,
                round_key=(group.round, group.group_id),
            )
            if response is grpc.aio.EOF:
                ended_by_owner = True  # an honest owner ends a stream early only with a status
                raise PeerUnavailable(f"{owner.peer_id} closed the stream after {expected} chunks")
            traffic["received"] += len(response.chunk.payload)
            start, end = offsets[expected]
            # An owner's average is checked as strictly as owners check members' chunks. If
            # this raises, the chunk is missing and gets the caller's values at the end.
            meta = check_chunk(
                response.chunk,
                index=expected,
                numels=numels,
                codec=(result_codec.name, result_codec.version),
                max_bytes=config.max_chunk_bytes,
            )
            _check_contributors(response, group)
            if state.me not in response.contributors:  # it took our chunk, then left it out
                state.excluded_by.add(owner.peer_id)
            await decode_chunk(response.chunk.payload, meta, out[start:end])
            received[expected] = tuple(response.contributors)
            digests[expected] = side.digest(response.chunk.payload)
            expected += 1
        accepted = await side.take(part, numels, received, digests, call.read)
        if accepted is not None:
            taken = True
            state.contributors.update({(part, i): c for i, c in accepted.items()})
    except grpc.aio.AioRpcError as error:
        _owner_failed(state, part, from_rpc_error(error, owner.peer_id), error.code())
    except TimeoutError:
        why = f"no averaged chunk {expected} within {config.reducer_timeout_seconds:g} s"
        state.fail(owner.peer_id, Failure.TIMEOUT, why)
    except Unanswered as error:  # gone: stop waiting for its chunks of this member's part too
        if plan.reducer is not None:
            plan.reducer.drop(part, str(error))
        _owner_failed(state, part, error, None)
    except SwarmgradError as error:
        _owner_failed(state, part, error, None)
    finally:
        if not taken and (received or ended_by_owner):
            kept = side.keep(part, received, digests, out, ended_by_owner=ended_by_owner)
            state.contributors.update({(part, i): c for i, c in kept.items()})
        call.cancel()
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)


async def _produce(
    state: _Round,
    part: int,
    values: torch.Tensor,
    codec: Codec,
    queue: asyncio.Queue[Framed | None],
) -> None:
    """Encode this member's values of ``part`` chunk by chunk (once each, in a worker thread),
    pace them, and queue the framed requests; None ends the stream."""
    plan = state.plan
    sent = None
    if state.sent is not None:
        first = plan.group.partition(state.sent.numel())[part][0]
        sent = state.sent[first : first + values.numel()]
    numels = chunk_sizes(values.numel(), plan.config.chunk_values)
    try:
        for index, (start, end) in enumerate(chunk_offsets(numels)):
            # A view of `values` for the identity codec: the caller's vector is not modified
            # during the round.
            payload, meta = await asyncio.to_thread(
                _encode, codec, values[start:end], None if sent is None else sent[start:end]
            )
            if plan.hooks is not None:
                payload = await plan.hooks.before_send(part, index, bytes(payload))
            if plan.pace is not None:  # the node's upload cap
                await plan.pace(len(payload))
            plan.traffic["sent"] += len(payload)
            signature = plan.side.sign(part, index, payload)
            await queue.put(
                framed_chunk(
                    averaging_pb2.AggregateRequest, index, payload, meta, signature=signature
                )
            )
    except BaseException:
        # End the request stream if there is room; never block here (nobody may be reading).
        with contextlib.suppress(asyncio.QueueFull):
            queue.put_nowait(None)
        raise
    await queue.put(None)


def _header(state: _Round, part: int) -> averaging_pb2.AggregateRequest:
    """This member's signed header for its stream to the owner of ``part``."""
    group, config = state.group, state.config
    me = group.members[state.me]
    return header_to_proto(
        StreamHeader(
            run_id=config.run_id,
            spec_hash=config.spec_hash,
            round=group.round,
            group_id=group.group_id,
            sender=me.peer_id,
            receiver=group.members[part].peer_id,
            part=part,
            weight=me.weight,
            commitment=state.plan.side.commitment,
        ),
        state.plan.signer,
    )


def _owner_failed(
    state: _Round, part: int, failure: SwarmgradError, status: grpc.StatusCode | None
) -> None:
    """Record why the owner of ``part`` failed this member, by kind."""
    owner = state.group.members[part].peer_id
    if isinstance(failure, ProtocolViolation):
        kind = Failure.PROTOCOL_VIOLATION
    elif status == grpc.StatusCode.DEADLINE_EXCEEDED:
        kind = Failure.TIMEOUT
    else:
        kind = Failure.DROPPED_MEMBER
    state.fail(owner, kind, str(failure))
    reducer = state.plan.reducer
    if status is not None and isinstance(failure, PeerUnavailable) and reducer is not None:
        # It is gone: stop waiting for its chunks of this member's own part too.
        reducer.drop_if_silent(part, str(failure))


def _check_contributors(response: averaging_pb2.AggregateResponse, group: Group) -> None:
    contributors = list(response.contributors)
    if (
        not contributors
        or len(set(contributors)) != len(contributors)
        or not all(0 <= c < len(group.members) for c in contributors)
    ):
        raise ProtocolViolation(ResultCode.BAD_PAYLOAD, f"bad contributor list {contributors}")


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
    me, group = state.me, state.group
    coverage = cover(
        group, state.config, bounds, state.contributors, me, abstains=state.plan.owner_abstains
    )
    if not coverage.with_others:
        reasons = "; ".join(f"{p}: {r}" for p, r in state.failures.items()) or "no peers"
        raise RoundAborted(
            f"round {group.round}: nothing was averaged with another peer ({reasons})"
        )
    return RoundResult(
        sent=state.sent,
        averaged=out,
        contributors=coverage.contributors,
        partial=coverage.partial,
        missing=coverage.missing,
        failures=dict(state.failures),
        failure_kinds=dict(state.failure_kinds),
        excluded_by=tuple(sorted(state.excluded_by)),
        chunk_contributors=dict(state.contributors),
    )
