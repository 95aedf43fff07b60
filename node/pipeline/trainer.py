"""A pipeline trainer (``swarmgrad node run.toml --role trainer``): it owns the data and the
labels and no parameters, and routes every microbatch through one replica of each stage.

One step: the step's batch (``data.batch_size`` sequences) is cut into ``pipeline.microbatches``
microbatches, all in flight at once. Each goes forward through stages 0..S-2 (Forward), takes
its loss and backward in one hop on the last stage (ForwardLoss, the loss weighted by the
microbatch's share of the batch), and its gradient goes back through stages S-2..0 (Backward).
The step ends when every microbatch's backward has reached stage 0: the stages step their inner
optimizers by accumulated samples, so a step's microbatches never mix parameter versions when
each stage has one replica (then a pipeline trains exactly like the whole model in one process).

Tensors pass through the trainer as they arrive (a stage's encoded outputs become the next
stage's inputs, bytes untouched). The trainer keeps what it sent each stage until that stage's
backward succeeds, for failover:

- Forward fails on a replica (UNAVAILABLE, DRAINING, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED):
  the same inputs go to another replica of that stage; upstream work is not redone.
- Backward fails on the replica that ran the forward: another replica recomputes the forward
  from the resent inputs (stateless backward); NEED_INPUTS (a restarted replica, an evicted
  input) or STALE_VERSION: the same replica gets the inputs resent.
- No live replica for a stage: the trainer waits for one (watching the stage's DHT records) up
  to ``pipeline.wait_seconds``, then fails the step with :class:`StageUnavailable`, which says which
  stage; the next step tries again. It never hangs: every call has a deadline.

The :class:`Router` picks, per microbatch per stage, the replica with the earliest projected
finish (the work already routed to it, and an EMA of the compute seconds per sample its replies
report); UNAVAILABLE bans a replica with exponential backoff (DRAINING, a replica joining or
leaving, pauses it for a second), DEADLINE_EXCEEDED doubles its EMA, RESOURCE_EXHAUSTED only
retries elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Protocol

import grpc
import torch

from swarmgrad.node.config import NodeConfig
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.discovery.start import start_discovery
from swarmgrad.node.files import write_json
from swarmgrad.node.identity import Identity
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.training.data import load_corpus
from swarmgrad.node.transport.transport import Transport
from swarmgrad.protocol import stage as stage_protocol
from swarmgrad.protocol.auth import Signer
from swarmgrad.protocol.errors import (
    PeerUnavailable,
    ProtocolViolation,
    SwarmgradError,
    from_rpc_error,
)
from swarmgrad.protocol.server import ServerLimits
from swarmgrad.protocol.v1 import stage_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

log = logging.getLogger(__name__)

#: First ban of a replica that was unreachable; doubled at each further failure.
BAN_SECONDS = 15.0
#: A replica that answers DRAINING (joining, or leaving) is left alone this long.
DRAINING_PAUSE_SECONDS = 1.0
#: Weight of the newest measurement in a replica's seconds-per-sample average.
EMA_ALPHA = 0.3
#: A projection is an estimate, off by more the slower the replica: new work is projected at
#: this much more than its pace, so a slower replica gets it only if clearly done sooner (on a
#: tie, the faster one takes it).
PROJECTION_MARGIN = 0.25
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


@dataclass(slots=True)
class StageReplica:
    """What the trainer knows of one replica of one stage."""

    peer_id: str
    endpoint: str
    stage: int
    seconds_per_sample: float | None = None  # an EMA of its compute seconds per sample
    reserved: float = 0.0  # seconds of work routed to it and not answered yet (estimated)
    banned_until: float = 0.0
    ban_seconds: float = BAN_SECONDS
    calls: int = 0
    samples: int = 0
    failures: int = 0


#: The most compute seconds a replica's report counts for, unless its calls' deadline is less.
MAX_REPORTED_SECONDS = 3600.0


class Router:
    """Per stage, the replicas known and how fast they answer."""

    def __init__(
        self,
        stages: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_seconds: float = MAX_REPORTED_SECONDS,
    ) -> None:
        """``max_seconds``: the most a replica's reported compute time counts for (a call's
        deadline: a longer one would have missed it)."""
        self.replicas: list[dict[str, StageReplica]] = [{} for _ in range(stages)]
        self._clock = clock
        self._max_seconds = max_seconds

    def update(self, stage: int, records: list[tuple[str, str]]) -> None:
        """The stage's replicas as its DHT records say (peer id, endpoint): new ones are added,
        ones whose records are gone dropped (a banned one keeps its ban if it comes back at the
        same endpoint; at another, it is a restarted process, and starts afresh)."""
        known = self.replicas[stage]
        live = dict(records)
        for peer_id in list(known):
            if peer_id not in live and known[peer_id].banned_until <= self._clock():
                del known[peer_id]
        for peer_id, endpoint in live.items():
            if not endpoint:
                continue
            replica = known.get(peer_id)
            if replica is None or replica.endpoint != endpoint:  # new, or a restarted process:
                known[peer_id] = StageReplica(peer_id, endpoint, stage)  # its ban is lifted

    def live(self, stage: int) -> list[StageReplica]:
        now = self._clock()
        return [r for r in self.replicas[stage].values() if r.banned_until <= now]

    def pick(
        self, stage: int, samples: int, *, exclude: frozenset[str] = frozenset()
    ) -> StageReplica | None:
        """The replica with the earliest projected finish: the work already routed to it, then
        ``samples`` at its pace (with :data:`PROJECTION_MARGIN`); on a tie, the faster; None if
        the stage has none live."""
        candidates = [r for r in self.live(stage) if r.peer_id not in exclude]
        if not candidates:
            return None
        fastest = self._fastest(candidates)

        def projected(replica: StageReplica) -> tuple[float, float]:
            pace = self._pace(replica, fastest)
            return replica.reserved + samples * pace * (1 + PROJECTION_MARGIN), pace

        return min(candidates, key=projected)

    def _fastest(self, replicas: list[StageReplica]) -> float:
        known = [r.seconds_per_sample for r in replicas if r.seconds_per_sample is not None]
        return min(known) if known else 0.0  # a new replica is tried as if it were fastest

    def _pace(self, replica: StageReplica, fastest: float) -> float:
        pace = replica.seconds_per_sample
        return fastest if pace is None else pace

    def reserve(self, replica: StageReplica, samples: int) -> float:
        """Count ``samples`` of work routed to ``replica``; the seconds reserved (to release)."""
        estimate = samples * self._pace(replica, self._fastest(self.live(replica.stage)))
        replica.reserved += estimate
        return estimate

    def release(self, replica: StageReplica, reserved: float) -> None:
        replica.reserved = max(0.0, replica.reserved - reserved)

    def done(
        self, replica: StageReplica, compute_seconds: float, samples: int, *, forward: bool
    ) -> None:
        """A call of ``samples`` that took the replica ``compute_seconds`` (as it says; its
        queue is not its pace) was answered (``forward``: counted in the replica's share).
        The replica's word is kept to a non-negative finite number: a negative pace would win
        it every pick."""
        if math.isnan(compute_seconds):
            compute_seconds = self._max_seconds
        per_sample = min(max(compute_seconds, 0.0), self._max_seconds) / max(samples, 1)
        ema = replica.seconds_per_sample
        replica.seconds_per_sample = (
            per_sample if ema is None else EMA_ALPHA * per_sample + (1 - EMA_ALPHA) * ema
        )
        replica.calls += 1
        replica.samples += samples if forward else 0
        replica.ban_seconds = BAN_SECONDS

    def penalize(self, replica: StageReplica) -> None:
        """It missed a deadline: route less to it, but keep it."""
        replica.failures += 1
        replica.seconds_per_sample = 2 * (replica.seconds_per_sample or 1.0)

    def pause(self, replica: StageReplica, seconds: float) -> None:
        """It is joining or leaving (DRAINING): none of its work for ``seconds``, no backoff."""
        replica.banned_until = max(replica.banned_until, self._clock() + seconds)

    def ban(self, replica: StageReplica) -> None:
        """It is unreachable: none of its work for a while (longer each time it fails again
        after a ban; the calls in flight when it failed count once)."""
        replica.failures += 1
        if replica.banned_until > self._clock():
            return
        replica.banned_until = self._clock() + replica.ban_seconds
        replica.ban_seconds *= 2


@dataclass(slots=True)
class StageCounters:
    """What one stage's traffic and failures were, seen from the trainer."""

    calls: int = 0
    retries: int = 0  # calls repeated on another replica
    resends: int = 0  # inputs sent again for a backward
    failures: dict[str, int] = field(default_factory=dict)
    #: Payload bytes the trainer sent the stage, and received from it, by kind: "tokens" (ids
    #: and labels), "activations", "gradients", "resent" (inputs sent again for a backward).
    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    wait_seconds: float = 0.0  # waiting for a live replica
    #: Samples of steps that failed at this stage (no live replica): their work at every stage
    #: is done again when the step is.
    lost_samples: int = 0
    #: Per call that failed over: seconds from its first failure to its answer elsewhere, and
    #: the trainer step it belonged to.
    failover_seconds: list[float] = field(default_factory=list)
    failover_steps: list[int] = field(default_factory=list)

    def count(self, into: dict[str, int], kind: str, size: int) -> None:
        if size:
            into[kind] = into.get(kind, 0) + size

    def as_dict(self, samples: int) -> dict[str, Any]:
        per = max(samples, 1)
        return {
            "calls": self.calls,
            "retries": self.retries,
            "resends": self.resends,
            "failures": dict(self.failures),
            "bytes_up_per_sample": sum(self.sent.values()) / per,
            "bytes_down_per_sample": sum(self.received.values()) / per,
            "sent_per_sample": {k: v / per for k, v in self.sent.items()},
            "received_per_sample": {k: v / per for k, v in self.received.items()},
            "wait_seconds": self.wait_seconds,
            "lost_samples": self.lost_samples,
            "failover_seconds": list(self.failover_seconds),
            "failover_steps": list(self.failover_steps),
        }


class _Retry(Exception):
    """This replica cannot do it; try another."""


class _Resend(Exception):
    """This replica needs the inputs again."""


#: The requests that carry a microbatch (Sync carries none).
MicrobatchRequest = (
    stage_pb2.ForwardRequest | stage_pb2.ForwardLossRequest | stage_pb2.BackwardRequest
)


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
        _count_request(counters, message)
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
        _count_reply(counters, reply)
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


def _count_request(counters: StageCounters, message: MicrobatchRequest) -> None:
    backward = isinstance(message, stage_pb2.BackwardRequest)
    for kind, size in stage_protocol.payload_sizes(message):
        resent = backward and kind != "gradients"  # a backward's inputs are sent again
        counters.count(counters.sent, "resent" if resent else kind, size)


def _count_reply(counters: StageCounters, reply: Any) -> None:
    if isinstance(reply, stage_pb2.ForwardReply):
        counters.count(counters.received, "activations", len(reply.outputs.payload))
    else:
        counters.count(counters.received, "gradients", len(reply.grad_inputs.payload))


# -- the trainer process ------------------------------------------------------------------------


class _StageView(Protocol):
    async def find(self) -> list[PeerRecord]: ...


async def stages_round(views: Sequence[_StageView]) -> int:
    """The round every stage has reached (the lowest stage's highest epoch among its serving
    replicas), from each stage's records: a restarted trainer asks for the round after it, not
    for rounds the stages answer "done" to at once (0 when a stage cannot be read)."""
    reached = []
    for stage, view in enumerate(views):
        try:
            records = await view.find()
        except SwarmgradError:
            return 0
        epochs = [r.epoch for r in records if r.stage == stage and r.state == "serving"]
        reached.append(max(epochs, default=0))
    return min(reached, default=0)


async def train_pipeline(config: NodeConfig, stop: asyncio.Event) -> int:
    """Train through the run's stages until stopped (or ``config.max_steps``)."""
    spec = config.spec
    identity = Identity.load_or_create(config.identity_path)
    discovery = await start_discovery(
        config.swarm.discovery_config(), identity, run_id=spec.run.id, spec_hash=spec.hash
    )
    views = [
        discovery.for_run(stage_spec.run.id, stage_spec.hash)
        for stage_spec in (spec.stage_spec(k) for k in range(spec.pipeline.stages))
    ]
    spans = spec.pipeline.spans(spec.model.n_layers)

    async def refresh(stage: int) -> list[tuple[str, str]]:
        try:
            records: list[PeerRecord] = await views[stage].find()
        except SwarmgradError as error:
            log.warning("could not read stage %d's records: %s", stage, error)
            return []
        # Replicas serving this stage's span; not those joining (catching up with their group)
        # or draining (leaving), which would only answer DRAINING.
        return [
            (r.peer_id, r.endpoint)
            for r in records
            if r.stage == stage
            and (r.span_start, r.span_end) == spans[stage]
            and r.state == "serving"
        ]

    limits = ServerLimits(max_message_bytes=max(16 << 20, 4 * _activation_bytes(spec)))
    transport = Transport(config.swarm.transport(limits))
    corpus = await asyncio.to_thread(
        load_corpus, spec.data, vocab_size=spec.model.vocab_size, cache_dir=config.cache_dir
    )
    batches = corpus.batches(
        seq_len=spec.model.seq_len,
        batch_size=spec.data.batch_size,
        seed=spec.data.seed,
        peer_id=identity.peer_id,
    )
    try:
        async with transport:
            client = PipelineClient(spec, identity, transport, refresh=refresh)
            log.info(
                "trainer %s: %d stages, %d microbatches of %d per step",
                identity.peer_id,
                spec.pipeline.stages,
                spec.pipeline.microbatches,
                spec.data.batch_size // spec.pipeline.microbatches,
            )
            first_round = await stages_round(views)
            if first_round:
                log.info("the stages are at round %d: this trainer's rounds go on from there",
                         first_round)  # fmt: skip
            first_step = first_round * spec.algorithm.inner_steps
            return await _train(
                config, client, iter(batches), stop, identity.peer_id, first_step=first_step
            )
    finally:
        await discovery.close()


@dataclass(slots=True)
class TrainerStatus:
    peer_id: str
    step: int = 0
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    failed_steps: int = 0
    last_error: str = ""
    rounds: list[dict[str, Any]] = field(default_factory=list)


async def _train(
    config: NodeConfig,
    client: PipelineClient,
    batches: Any,
    stop: asyncio.Event,
    peer_id: str,
    *,
    first_step: int = 0,
) -> int:
    status = TrainerStatus(peer_id, step=first_step)
    inputs, targets = next(batches)
    while not stop.is_set() and (config.max_steps is None or status.step < config.max_steps):
        started = time.monotonic()
        try:
            loss = await client.step(status.step, inputs, targets)
        except (StageUnavailable, FaultyReplica) as error:
            status.failed_steps += 1
            client.counters[error.stage].lost_samples += len(inputs)
            status.last_error = str(error)
            log.warning("step %d: %s; trying again", status.step, error)
            _write_status(config.status_file, status, client)
            continue  # the same batch, the same step: what stages accumulated of it counts once
        status.step_seconds.append(time.monotonic() - started)
        status.losses.append(loss)
        status.step += 1
        status.last_error = ""
        log.info("step %d loss %.4f (%.2f s)", status.step, loss, status.step_seconds[-1])
        inner_steps = config.spec.algorithm.inner_steps
        if status.step % inner_steps == 0:  # the round barrier: every stage syncs
            started = time.monotonic()
            outcomes = await client.sync(status.step, status.step // inner_steps)
            seconds = time.monotonic() - started
            status.rounds.append({"step": status.step, "seconds": seconds, "outcomes": outcomes})
            log.info("round %d: %s (%.1f s)", status.step // inner_steps, outcomes, seconds)
        _write_status(config.status_file, status, client)
        inputs, targets = next(batches)
    _write_status(config.status_file, status, client)
    return 0


def _write_status(path: Path | None, status: TrainerStatus, client: PipelineClient) -> None:
    if path is None:
        return
    body = {
        "peer_id": status.peer_id,
        "role": "trainer",
        "step": status.step,
        "losses": status.losses,
        "step_seconds": status.step_seconds,
        "failed_steps": status.failed_steps,
        "last_error": status.last_error,
        "rounds": status.rounds,
        "samples": client.samples,
        "stages": [
            counters.as_dict(client.samples)
            | {
                "replicas": {
                    r.peer_id: {
                        "samples": r.samples,
                        "calls": r.calls,
                        "failures": r.failures,
                        "seconds_per_sample": r.seconds_per_sample,
                    }
                    for r in client.router.replicas[k].values()
                }
            }
            for k, counters in enumerate(client.counters)
        ],
    }
    with contextlib.suppress(OSError):
        write_json(path, body)


def _activation_bytes(spec: RunSpec) -> int:
    return 4 * spec.data.batch_size * spec.model.seq_len * spec.model.d_model
