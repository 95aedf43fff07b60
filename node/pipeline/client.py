"""A pipeline trainer's calls to the stages: one step's microbatches forward and back through
one replica of each stage, with retries, resends and failover (what ``trainer.py`` describes),
every call under a deadline; the replicas chosen by the :class:`Router` (``routing.py``)."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import grpc
import torch

from swarmgrad.node.pipeline.counters import MicrobatchRequest, StageCounters
from swarmgrad.node.pipeline.routing import (
    DRAINING_PAUSE_SECONDS,
    MAX_REPORTED_SECONDS,
    Router,
    StageReplica,
)
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.transport.transport import Transport
from swarmgrad.protocol import stage as stage_protocol
from swarmgrad.protocol.auth import Signer
from swarmgrad.protocol.errors import (
    PeerUnavailable,
    ProtocolViolation,
    from_rpc_error,
)
from swarmgrad.protocol.v1 import stage_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

log = logging.getLogger(__name__)

#: How often the trainer re-reads the stages' records from the DHT.
REFRESH_SECONDS = 2.0


class StageUnavailable(PeerUnavailable):
    """A stage had no live replica within the deadline; the step did not happen."""

    def __init__(self, stage: int, waited: float) -> None:
        super().__init__(f"no live replica of stage {stage} for {waited:.0f} s")
        self.stage = stage


class FaultyReplica(PeerUnavailable):
    """A replica's output was refused by the next stage (NaN, a wrong shape or codec): it is
    banned, and the step did not happen."""

    def __init__(self, stage: int, peer: str, refused: ProtocolViolation) -> None:
        super().__init__(
            f"stage {stage} replica {peer} sent what the next stage refused: {refused}"
        )
        self.stage = stage


#: What a replica refuses a tensor for: the tensor's fault, so its producer's.
_BAD_TENSOR = frozenset(
    {ResultCode.NON_FINITE, ResultCode.BAD_PAYLOAD, ResultCode.BAD_SHAPE, ResultCode.BAD_CODEC}
)


class _Retry(Exception):
    """This replica cannot do it; try another."""


class _Resend(Exception):
    """This replica needs the inputs again."""


class PipelineClient:
    """Runs trainer steps through the stages' replicas."""

    def __init__(
        self,
        spec: RunSpec,
        signer: Signer,
        transport: Transport,
        *,
        refresh: Callable[[int], Awaitable[list[tuple[str, str]]]],
    ) -> None:
        self.spec, self.signer, self.transport = spec, signer, transport
        #: Added to every microbatch's step: a trainer restarted under the same identity counts
        #: its steps from its start again, and replicas de-duplicate by (trainer, step, index):
        #: its new microbatches must not look like retries of its old ones.
        self.session = secrets.randbits(30) << 32
        self.stages = spec.pipeline.stages
        self.router = Router(
            self.stages,
            max_seconds=min(spec.pipeline.call_timeout_seconds, MAX_REPORTED_SECONDS),
        )
        self.counters = [StageCounters() for _ in range(self.stages)]
        self._refresh = refresh
        self._wait = spec.pipeline.wait_seconds
        self._timeout = spec.pipeline.call_timeout_seconds
        averaging = spec.averaging
        #: A round's deadline: matchmaking, the all-reduce, and time to finish queued work.
        self._round_seconds = (
            averaging.matchmaking_timeout_seconds + averaging.round_timeout_seconds + 30.0
        )
        self._last_refresh = [-math.inf] * self.stages
        self.samples = 0

    async def refresh(self, stage: int) -> None:
        records = await self._refresh(stage)
        before = {r.peer_id: r.endpoint for r in self.router.replicas[stage].values()}
        self.router.update(stage, records)
        after = {r.peer_id: r.endpoint for r in self.router.replicas[stage].values()}
        if after != before:
            log.info("stage %d replicas: %s (records: %s)", stage, after, records)
        self._last_refresh[stage] = time.monotonic()

    async def step(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One trainer step on a batch: its mean loss. Raises :class:`StageUnavailable` when a
        stage stays without a replica (the stages may hold part of its gradient then)."""
        now = time.monotonic()
        await asyncio.gather(
            *(
                self.refresh(k)
                for k in range(self.stages)
                if now - self._last_refresh[k] > REFRESH_SECONDS
            )
        )
        parts = self.spec.pipeline.microbatches
        batch = len(inputs)
        losses = await asyncio.gather(
            *(
                self._microbatch(self.session + step, index, x, y, len(x) / batch)
                for index, (x, y) in enumerate(
                    zip(inputs.chunk(parts), targets.chunk(parts), strict=True)
                )
            )
        )
        self.samples += batch
        return statistics.fmean(losses)

    async def sync(self, step: int, round_: int) -> dict[int, list[str]]:
        """The round barrier, between steps: every live replica of every stage runs its stage
        group's round ``round_`` (replicas there already answer at once); the outcomes by stage.
        A replica that fails it is left as it is (its group averages without it)."""
        await asyncio.gather(*(self.refresh(k) for k in range(self.stages)))
        calls = [
            (stage, replica) for stage in range(self.stages) for replica in self.router.live(stage)
        ]
        outcomes = await asyncio.gather(
            *(self._sync(stage, replica, step, round_) for stage, replica in calls)
        )
        by_stage: dict[int, list[str]] = {k: [] for k in range(self.stages)}
        for (stage, _), outcome in zip(calls, outcomes, strict=True):
            by_stage[stage].append(outcome)
        return by_stage

    async def _sync(self, stage: int, replica: StageReplica, step: int, round_: int) -> str:
        request = stage_pb2.SyncRequest(round=round_)
        header = request.header
        header.run_id, header.spec_hash, header.stage = self.spec.run.id, self.spec.hash, stage
        header.id.CopyFrom(stage_pb2.MicrobatchId(trainer=self.signer.peer_id, step=step))
        stage_protocol.sign(self.signer, stage_protocol.SYNC_METHOD, replica.peer_id, request)
        call = self.transport.channel(replica.endpoint).unary_unary(
            stage_protocol.SYNC_METHOD,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=stage_pb2.SyncReply.FromString,
        )
        try:
            reply = await call(request, timeout=self._round_seconds)
        except grpc.aio.AioRpcError as error:
            failure = from_rpc_error(error, replica.peer_id)
            log.warning(
                "stage %d replica %s: round %d failed: %s", stage, replica.peer_id, round_, failure
            )
            return "failed"
        return str(reply.outcome)

    async def _microbatch(
        self, step: int, index: int, tokens: torch.Tensor, labels: torch.Tensor, scale: float
    ) -> float:
        samples = len(tokens)
        first = stage_pb2.StageInputs(tokens=stage_protocol.token_bytes(tokens), batch=samples)
        sent: list[tuple[stage_pb2.StageInputs, str, int]] = []  # per stage: inputs, peer, version
        inputs = first
        producer: tuple[int, str] | None = None  # who computed the tensor being passed on
        for stage in range(self.stages - 1):
            request = stage_pb2.ForwardRequest(inputs=inputs)
            reply, peer = await self._checked(
                producer, self._call(stage, step, index, samples, "Forward", request)
            )
            assert isinstance(reply, stage_pb2.ForwardReply)
            sent.append((inputs, peer, reply.version))
            inputs = stage_pb2.StageInputs(activations=reply.outputs)
            producer = (stage, peer)
        last = stage_pb2.ForwardLossRequest(
            inputs=inputs, labels=stage_protocol.token_bytes(labels), loss_scale=scale
        )
        reply, peer = await self._checked(
            producer, self._call(self.stages - 1, step, index, samples, "ForwardLoss", last)
        )
        assert isinstance(reply, stage_pb2.ForwardLossReply)
        loss, grad = reply.loss, reply.grad_inputs
        producer = (self.stages - 1, peer)
        for stage in reversed(range(self.stages - 1)):
            kept, forward_peer, version = sent[stage]
            back = stage_pb2.BackwardRequest(version=version, grad_outputs=grad)
            reply, peer = await self._checked(
                producer,
                self._call(
                    stage, step, index, samples, "Backward", back, prefer=forward_peer, inputs=kept
                ),
            )
            assert isinstance(reply, stage_pb2.BackwardReply)
            grad = reply.grad_inputs
            producer = (stage, peer)
        return loss

    async def _checked(
        self, producer: tuple[int, str] | None, call: Awaitable[tuple[Any, str]]
    ) -> tuple[Any, str]:
        """``call``, which passes on a tensor ``producer`` (a replica of another stage)
        computed: when it is refused for its values or form, that replica is at fault, not this
        trainer's request. It is banned, and the step fails to be tried again (elsewhere)."""
        try:
            return await call
        except ProtocolViolation as refused:
            if producer is None or refused.code not in _BAD_TENSOR:
                raise
            stage, peer = producer
            replica = self.router.replicas[stage].get(peer)
            if replica is not None:
                self.router.ban(replica)
            raise FaultyReplica(stage, peer, refused) from None

    async def _call(
        self,
        stage: int,
        step: int,
        index: int,
        samples: int,
        method: str,
        request: MicrobatchRequest,
        *,
        prefer: str = "",
        inputs: stage_pb2.StageInputs | None = None,
    ) -> tuple[Any, str]:
        """``request`` answered by a replica of ``stage``, failing over to others; the reply and
        who answered. A Backward (``inputs``: what the forward was given) goes to ``prefer``
        (the forward's replica) without the inputs first; anywhere else with them."""
        counters = self.counters[stage]
        waited_since: float | None = None
        excluded: set[str] = set()
        attempt = 0
        resend = False
        failed_at: float | None = None  # the first failure of this call
        while True:
            replica = self._pick(stage, samples, prefer, excluded, resend)
            if replica is None:
                now = time.monotonic()
                waited_since = now if waited_since is None else waited_since
                if now - waited_since > self._wait:
                    raise StageUnavailable(stage, now - waited_since)
                live = self.router.live(stage)
                if excluded and all(r.peer_id in excluded for r in live):
                    # Every live replica failed this call once (a missed deadline, a moment of
                    # overload): try them again rather than wait the whole wait out for none.
                    excluded.clear()
                await asyncio.sleep(0.2)
                counters.wait_seconds += time.monotonic() - now
                await self.refresh(stage)
                continue
            if waited_since is not None:
                log.info("stage %d has a replica again (%s)", stage, replica.peer_id)
                waited_since = None
            with_inputs = inputs is not None and (resend or replica.peer_id != prefer)
            message = _prepare(self.spec, stage, request, inputs, with_inputs)
            message.header.id.CopyFrom(
                stage_pb2.MicrobatchId(
                    trainer=self.signer.peer_id, step=step, index=index, attempt=attempt
                )
            )
            if with_inputs:
                counters.resends += 1
            attempt += 1
            if attempt > 1:
                counters.retries += 1
            reserved = self.router.reserve(replica, samples)
            try:
                reply = await self._send(replica, method, message, counters)
            except _Resend:
                resend = True
                failed_at = failed_at or time.monotonic()
                continue
            except _Retry:
                excluded.add(replica.peer_id)
                prefer = ""
                failed_at = failed_at or time.monotonic()
                continue
            finally:
                self.router.release(replica, reserved)
            if failed_at is not None:
                counters.failover_seconds.append(time.monotonic() - failed_at)
                counters.failover_steps.append(step - self.session)
            self.router.done(replica, reply.compute_seconds, samples, forward=method != "Backward")
            return reply, replica.peer_id

    def _pick(
        self, stage: int, samples: int, prefer: str, excluded: set[str], resend: bool
    ) -> StageReplica | None:
        if prefer and prefer not in excluded:
            replica = self.router.replicas[stage].get(prefer)
            if replica is not None and replica in self.router.live(stage):
                return replica
        return self.router.pick(stage, samples, exclude=frozenset(excluded))

    async def _send(
        self,
        replica: StageReplica,
        method: str,
        message: MicrobatchRequest,
        counters: StageCounters,
    ) -> Any:
        stage_protocol.sign(
            self.signer, f"/{stage_protocol.SERVICE}/{method}", replica.peer_id, message
        )
        payload = message.SerializeToString()
        counters.request(message)
        await self.transport.pace(len(payload))
        channel = self.transport.channel(replica.endpoint)
        reply_type = _REPLIES[method]
        call = channel.unary_unary(
            f"/{stage_protocol.SERVICE}/{method}",
            request_serializer=lambda m: m,
            response_deserializer=reply_type.FromString,
        )
        counters.calls += 1
        try:
            reply = await call(payload, timeout=self._timeout)
        except grpc.aio.AioRpcError as error:
            self._failed(replica, error, counters)
        counters.reply(reply)
        return reply

    def _failed(
        self, replica: StageReplica, error: grpc.aio.AioRpcError, counters: StageCounters
    ) -> NoReturn:
        """Sort a failed call: raise _Resend, _Retry, or the error if no replica can help."""
        failure = from_rpc_error(error, replica.peer_id)
        name = failure.code_name if isinstance(failure, ProtocolViolation) else error.code().name
        counters.failures[name] = counters.failures.get(name, 0) + 1
        if isinstance(failure, ProtocolViolation):
            if failure.code in (ResultCode.NEED_INPUTS, ResultCode.STALE_VERSION):
                raise _Resend from None
            if failure.code == ResultCode.OVERLOADED:
                raise _Retry from None
            if failure.code == ResultCode.DRAINING:  # joining (soon serving) or leaving
                self.router.pause(replica, DRAINING_PAUSE_SECONDS)
                raise _Retry from None
            raise failure from None  # our request was refused: retrying elsewhere cannot help
        if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            self.router.penalize(replica)
        else:
            self.router.ban(replica)
        log.info("stage %d replica %s failed: %s", replica.stage, replica.peer_id, failure)
        raise _Retry from None


_REPLIES: dict[str, Any] = {
    "Forward": stage_pb2.ForwardReply,
    "ForwardLoss": stage_pb2.ForwardLossReply,
    "Backward": stage_pb2.BackwardReply,
}


def _prepare(
    spec: RunSpec,
    stage: int,
    request: MicrobatchRequest,
    inputs: stage_pb2.StageInputs | None,
    with_inputs: bool,
) -> MicrobatchRequest:
    """A copy of ``request`` for ``stage`` (a Backward with or without the inputs)."""
    message = type(request).FromString(request.SerializeToString())
    header = message.header
    header.run_id, header.spec_hash, header.stage = spec.run.id, spec.hash, stage
    if isinstance(message, stage_pb2.BackwardRequest):
        message.ClearField("inputs")
        if with_inputs and inputs is not None:
            message.inputs.CopyFrom(inputs)
    return message
