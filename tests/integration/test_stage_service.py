"""The Stage service on a real gRPC server: a replica restarted between a microbatch's forward
and its backward answers NEED_INPUTS, and the resent inputs give the very gradients of an
uninterrupted pass; thousands of malformed or impersonating requests are refused with their
documented status, crash nothing, and leave honest microbatches' results unchanged."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, cast

import grpc
import pytest
import pytest_asyncio
import torch

from swarmgrad.node.identity import Identity
from swarmgrad.node.pipeline.client import FaultyReplica, PipelineClient
from swarmgrad.node.pipeline.model import build_stage, schema_of
from swarmgrad.node.pipeline.worker import StageWorker
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.swarm import Swarm
from swarmgrad.node.swarm_config import SwarmConfig
from swarmgrad.node.transport.transport import Transport
from swarmgrad.protocol import stage as stage_protocol
from swarmgrad.protocol import stage_service
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.server import ServerLimits, open_channel, start_server
from swarmgrad.protocol.v1 import stage_pb2
from tests.helpers import until

pytestmark = pytest.mark.timeout(120)

_SPEC_TEXT = """
[run]
id = "stage-service"
[model]
vocab_size = 256
d_model = 32
n_layers = 4
n_heads = 2
seq_len = 16
[data]
batch_size = 8
[pipeline]
stages = 2
microbatches = 2
activations = "none"
gradients = "none"
"""
SPEC = RunSpec.from_toml(_SPEC_TEXT)
BATCH = 4


@dataclass
class Replica:
    identity: Identity
    worker: StageWorker
    servicer: stage_service.StageServicer
    server: grpc.aio.Server
    port: int

    async def stop(self) -> None:
        await self.server.stop(0)
        self.worker.close()


async def _replica(index: int, identity: Identity, port: int = 0) -> Replica:
    torch.manual_seed(0)
    module = build_stage(SPEC.model, SPEC.pipeline, index, seed=SPEC.data.seed)
    worker = StageWorker(module, SPEC, peer_id=identity.peer_id)
    worker.state = "serving"
    servicer = stage_service.StageServicer(
        schema_of(SPEC, index), worker, verifier=Verifier(identity.peer_id)
    )
    server, bound = await start_server(
        lambda s: stage_service.add_to_server(servicer, s), port=port
    )
    return Replica(identity, worker, servicer, server, bound)


@pytest_asyncio.fixture
async def channels() -> AsyncIterator[dict[int, grpc.aio.Channel]]:
    opened: dict[int, grpc.aio.Channel] = {}
    yield opened
    for channel in opened.values():
        await channel.close()


def _call(channel: grpc.aio.Channel, method: str, reply: type) -> Callable[..., object]:
    return channel.unary_unary(
        f"/{stage_protocol.SERVICE}/{method}",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=reply.FromString,
    )


def _header(trainer: Identity, stage: int, step: int, index: int = 0) -> stage_pb2.StageHeader:
    return stage_pb2.StageHeader(
        run_id=SPEC.run.id,
        spec_hash=SPEC.hash,
        stage=stage,
        id=stage_pb2.MicrobatchId(trainer=trainer.peer_id, step=step, index=index),
    )


def _tokens(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, SPEC.model.vocab_size, (BATCH, SPEC.model.seq_len), generator=generator)


def _forward_request(trainer: Identity, receiver: str, step: int) -> stage_pb2.ForwardRequest:
    request = stage_pb2.ForwardRequest(
        header=_header(trainer, 0, step),
        inputs=stage_pb2.StageInputs(tokens=stage_protocol.token_bytes(_tokens(step)), batch=BATCH),
    )
    stage_protocol.sign(trainer, stage_protocol.FORWARD_METHOD, receiver, request)
    return request


async def test_a_restarted_replica_asks_for_the_inputs_and_gives_the_same_gradients(
    channels: dict[int, grpc.aio.Channel],
) -> None:
    trainer = Identity.generate()
    head = await _replica(1, Identity.generate())  # the last stage: labels, loss, gradients
    first = await _replica(0, Identity.generate())
    try:
        channels[0] = channel = open_channel(f"127.0.0.1:{first.port}")
        channels[1] = open_channel(f"127.0.0.1:{head.port}")
        forward = _call(channel, "Forward", stage_pb2.ForwardReply)
        sent = _forward_request(trainer, first.identity.peer_id, step=0)
        reply = await forward(sent, timeout=10)
        loss_request = stage_pb2.ForwardLossRequest(
            header=_header(trainer, 1, 0),
            inputs=stage_pb2.StageInputs(activations=reply.outputs),
            labels=stage_protocol.token_bytes(_tokens(99)),
            loss_scale=0.5,
        )
        stage_protocol.sign(
            trainer, stage_protocol.FORWARD_LOSS_METHOD, head.identity.peer_id, loss_request
        )
        loss_reply = await _call(channels[1], "ForwardLoss", stage_pb2.ForwardLossReply)(
            loss_request, timeout=10
        )
        # The replica restarts: a new process, the same weights, nothing kept.
        port = first.port
        await first.stop()
        first = await _replica(0, first.identity, port=port)
        backward = _call(channel, "Backward", stage_pb2.BackwardReply)
        request = stage_pb2.BackwardRequest(
            header=_header(trainer, 0, 0), version=0, grad_outputs=loss_reply.grad_inputs
        )
        stage_protocol.sign(
            trainer, stage_protocol.BACKWARD_METHOD, first.identity.peer_id, request
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await backward(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (refused.value.details() or "").startswith("NEED_INPUTS")
        request.inputs.CopyFrom(sent.inputs)  # the trainer kept them: resend
        request.header.id.attempt = 1
        stage_protocol.sign(
            trainer, stage_protocol.BACKWARD_METHOD, first.identity.peer_id, request
        )
        await backward(request, timeout=10)
        assert first.worker.stats.recomputed == 1
        # The same gradients as one uninterrupted pass of both stages in this process.
        stages = [build_stage(SPEC.model, SPEC.pipeline, k, seed=SPEC.data.seed) for k in (0, 1)]
        loss = stages[1].loss(stages[0](_tokens(0)), _tokens(99)) * 0.5
        loss.backward()  # type: ignore[no-untyped-call]
        first.worker.gradients.release()  # the replica's sum of its microbatches' gradients
        for (name, got), expected in zip(
            first.worker.module.named_parameters(), stages[0].parameters(), strict=True
        ):
            assert got.grad is not None
            torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-7, msg=name)
        assert loss_reply.loss == pytest.approx(float(loss.detach()) / 0.5, rel=1e-6)
    finally:
        await first.stop()
        await head.stop()


def _mutations(
    trainer: Identity, impostor: Identity, receiver: str
) -> list[tuple[str, Callable[[int], stage_pb2.ForwardRequest | bytes]]]:
    """Ways to spoil a Forward request to stage 0, each a function of a counter."""

    def signed(
        request: stage_pb2.ForwardRequest, by: Identity = trainer
    ) -> stage_pb2.ForwardRequest:
        stage_protocol.sign(by, stage_protocol.FORWARD_METHOD, receiver, request)
        return request

    def base(n: int) -> stage_pb2.ForwardRequest:
        return stage_pb2.ForwardRequest(
            header=_header(trainer, 0, 1000 + n),
            inputs=stage_pb2.StageInputs(
                tokens=stage_protocol.token_bytes(_tokens(n)), batch=BATCH
            ),
        )

    def wrong_run(n: int) -> stage_pb2.ForwardRequest:
        request = base(n)
        request.header.run_id = "another-run"
        return signed(request)

    def wrong_spec(n: int) -> stage_pb2.ForwardRequest:
        request = base(n)
        request.header.spec_hash = bytes(32)
        return signed(request)

    def wrong_stage(n: int) -> stage_pb2.ForwardRequest:
        request = base(n)
        request.header.stage = 1 + n % 5
        return signed(request)

    def unsigned(n: int) -> stage_pb2.ForwardRequest:
        return base(n)

    def impersonated(n: int) -> stage_pb2.ForwardRequest:
        return signed(base(n), by=impostor)  # names the trainer, signed by another key

    def payload_swapped(n: int) -> stage_pb2.ForwardRequest:
        request = signed(base(n))
        request.inputs.tokens = stage_protocol.token_bytes(_tokens(n + 1))
        return request

    def for_someone_else(n: int) -> stage_pb2.ForwardRequest:
        request = base(n)
        stage_protocol.sign(trainer, stage_protocol.FORWARD_METHOD, impostor.peer_id, request)
        return request

    def replayed(n: int) -> stage_pb2.ForwardRequest:
        return REPLAYS[0]

    def truncated_tokens(n: int) -> stage_pb2.ForwardRequest:
        request = base(n)
        request.inputs.tokens = request.inputs.tokens[: -(1 + n % 7)]
        return signed(request)

    def too_many(n: int) -> stage_pb2.ForwardRequest:
        request = base(n)
        request.inputs.batch = SPEC.data.batch_size + 1 + n % 3
        request.inputs.tokens = b"\0" * (4 * request.inputs.batch * SPEC.model.seq_len)
        return signed(request)

    def bad_ids(n: int) -> stage_pb2.ForwardRequest:
        request = base(n)
        ids = _tokens(n)
        ids[0, n % SPEC.model.seq_len] = SPEC.model.vocab_size + n if n % 2 else -1 - n
        request.inputs.tokens = stage_protocol.token_bytes(ids)
        return signed(request)

    def activations_to_stage0(n: int) -> stage_pb2.ForwardRequest:
        request = base(n)
        request.inputs.activations.CopyFrom(
            stage_protocol.encode("none", torch.randn(BATCH, SPEC.model.seq_len, 32))
        )
        return signed(request)

    def no_trainer(n: int) -> stage_pb2.ForwardRequest:
        request = base(n)
        request.header.id.trainer = ""
        return signed(request)

    def garbage(n: int) -> bytes:
        return random.Random(n).randbytes(1 + n % 300)

    REPLAYS = [signed(base(10**6))]
    return [
        ("FAILED_PRECONDITION", wrong_run),
        ("FAILED_PRECONDITION", wrong_spec),
        ("FAILED_PRECONDITION", wrong_stage),
        ("UNAUTHENTICATED", unsigned),
        ("UNAUTHENTICATED", impersonated),
        ("UNAUTHENTICATED", payload_swapped),
        ("UNAUTHENTICATED", for_someone_else),
        ("UNAUTHENTICATED", replayed),
        ("INVALID_ARGUMENT", truncated_tokens),
        ("INVALID_ARGUMENT", too_many),
        ("INVALID_ARGUMENT", bad_ids),
        ("INVALID_ARGUMENT", activations_to_stage0),
        ("INVALID_ARGUMENT", no_trainer),
        ("INVALID_ARGUMENT", garbage),
    ]


async def test_malformed_and_impersonating_requests_are_refused_and_change_nothing(
    channels: dict[int, grpc.aio.Channel],
) -> None:
    trainer, impostor = Identity.generate(), Identity.generate()
    replica = await _replica(0, Identity.generate())
    middle = await _replica(1, Identity.generate())  # the last stage: it takes activations
    try:
        channels[0] = channel = open_channel(f"127.0.0.1:{replica.port}")
        channels[1] = middle_channel = open_channel(f"127.0.0.1:{middle.port}")
        forward = _call(channel, "Forward", stage_pb2.ForwardReply)
        raw = channel.unary_unary(
            f"/{stage_protocol.SERVICE}/Forward",
            request_serializer=lambda m: m,
            response_deserializer=stage_pb2.ForwardReply.FromString,
        )
        honest = await forward(_forward_request(trainer, replica.identity.peer_id, 7), timeout=10)
        mutations = _mutations(trainer, impostor, replica.identity.peer_id)
        replay = dict((f.__name__, f) for _, f in mutations)["replayed"]
        await forward(replay(0), timeout=10)  # the original of the replays: served once
        codes: Counter[str] = Counter()
        sent = 0
        for round_ in range(100):
            for expected, mutate in mutations:
                request = mutate(round_)
                call = raw if isinstance(request, bytes) else forward
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(request, timeout=10)
                assert refused.value.code().name == expected, (mutate.__name__, refused.value)
                codes[expected] += 1
                sent += 1
        # Activations to the last stage: a wrong codec or shape, NaN, cut payloads and labels.
        sent += await _spoil_middle(trainer, middle, middle_channel, codes)
        assert sent >= 2000
        assert not middle.worker.stats.backwards
        assert not replica.worker.stats.backwards
        # Still serving, and an honest microbatch gives what it gave before.
        again = await forward(_forward_request(trainer, replica.identity.peer_id, 7), timeout=10)
        assert again.outputs.payload == honest.outputs.payload
        assert replica.servicer.rejections.counts  # counted, by code
    finally:
        await replica.stop()
        await middle.stop()


async def _spoil_middle(
    trainer: Identity, middle: Replica, channel: grpc.aio.Channel, codes: Counter[str]
) -> int:
    call = _call(channel, "ForwardLoss", stage_pb2.ForwardLossReply)
    seq, width = SPEC.model.seq_len, SPEC.model.d_model
    labels = stage_protocol.token_bytes(_tokens(5))
    sent = 0
    for n in range(100):
        good = torch.randn(BATCH, seq, width)
        bad_values = good.clone()
        bad_values[0, 0, n % width] = float("nan") if n % 2 else float("inf")
        spoiled = [
            ("INVALID_ARGUMENT", stage_protocol.encode("bf16", good), labels, 0.5),
            (
                "INVALID_ARGUMENT",
                stage_protocol.encode("none", torch.randn(BATCH, seq + 1, width)),
                labels,
                0.5,
            ),
            ("INVALID_ARGUMENT", stage_protocol.encode("none", bad_values), labels, 0.5),
            ("INVALID_ARGUMENT", stage_protocol.encode("none", good), labels[:-4], 0.5),
            ("INVALID_ARGUMENT", stage_protocol.encode("none", good), labels, float("nan")),
            ("INVALID_ARGUMENT", stage_protocol.encode("none", good), labels, 1.5),
        ]
        cut = stage_protocol.encode("none", good)
        cut.payload = cut.payload[: -(1 + n)]
        spoiled.append(("INVALID_ARGUMENT", cut, labels, 0.5))
        for expected, activations, label_bytes, scale in spoiled:
            request = stage_pb2.ForwardLossRequest(
                header=_header(trainer, 1, 5000 + n),
                inputs=stage_pb2.StageInputs(activations=activations),
                labels=label_bytes,
                loss_scale=scale,
            )
            stage_protocol.sign(
                trainer, stage_protocol.FORWARD_LOSS_METHOD, middle.identity.peer_id, request
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(request, timeout=10)
            assert refused.value.code().name == expected, refused.value
            codes[expected] += 1
            sent += 1
    return sent


async def test_a_retried_microbatch_adds_neither_gradient_nor_samples() -> None:
    # The trainer retries a step with the same microbatch ids (a lost reply, a failed step):
    # the replica accumulates each microbatch once, and steps only on a whole batch's worth.
    replica = await _replica(1, Identity.generate())
    worker = replica.worker
    try:
        inputs = torch.randn(BATCH, SPEC.model.seq_len, SPEC.model.d_model)
        labels = _tokens(1)
        first = stage_protocol.Microbatch("trainer", 7, 0, 0)
        await worker.forward_loss(first, inputs, labels, 0.5)
        assert (worker.pending_samples, worker.version) == (BATCH, 0)
        retry = stage_protocol.Microbatch("trainer", 7, 0, 1)
        await worker.forward_loss(retry, inputs, labels, 0.5)
        assert (worker.pending_samples, worker.version) == (BATCH, 0), "a retry counted"
        assert worker.stats.duplicates == 1
        second = stage_protocol.Microbatch("trainer", 7, 1, 0)
        await worker.forward_loss(second, inputs, _tokens(2), 0.5)
        assert (worker.pending_samples, worker.version, worker.stats.samples) == (0, 1, 8)
        # The whole step retried after it landed: no step on a zero gradient.
        before = [p.detach().clone() for p in worker.module.parameters()]
        for index in (0, 1):
            await worker.forward_loss(
                stage_protocol.Microbatch("trainer", 7, index, 2), inputs, labels, 0.5
            )
        assert worker.version == 1
        assert all(
            torch.equal(a, p) for a, p in zip(before, worker.module.parameters(), strict=True)
        )
    finally:
        await replica.stop()


def test_a_stage_servers_transport_takes_its_largest_request() -> None:
    # Its limit was the averaging chunk's (~16 MiB): a 1024-wide model of 2048 tokens refused
    # one microbatch's activations (33.6 MB) with RESOURCE_EXHAUSTED, and no step could run.
    spec = RunSpec.from_toml(
        '[run]\nid = "wide"\n[model]\nvocab_size = 256\nd_model = 1024\nn_layers = 4\n'
        "n_heads = 8\nseq_len = 2048\n[data]\nbatch_size = 32\n[pipeline]\nstages = 2\n"
        "microbatches = 4\n"
    )
    swarm = Swarm(spec.stage_spec(0), Identity.generate(), SwarmConfig())
    limit = swarm.transport.limits.max_message_bytes
    assert limit >= schema_of(spec, 0).max_message_bytes
    activations = 32 // 4 * 2048 * 1024 * 2  # one microbatch, bf16
    assert limit > 2 * activations
    whole = Swarm(RunSpec.from_toml('[run]\nid = "one"\n'), Identity.generate(), SwarmConfig())
    assert whole.transport.limits.max_message_bytes < limit  # only stage servers pay for it


async def test_a_stages_only_replica_that_missed_one_deadline_is_tried_again() -> None:
    # It missed one call's deadline (a pause): excluded for that call, it was never tried
    # again while it stayed live, and the step failed "no live replica" after the whole wait.
    spec = RunSpec.from_toml(_SPEC_TEXT + "call_timeout_seconds = 1.0\nwait_seconds = 4.0\n")
    identity = Identity.generate()
    worker = StageWorker(build_stage(spec.model, spec.pipeline, 0, seed=0), spec, peer_id="x")
    worker.state = "serving"
    slow = [True]

    class SlowOnce:
        def __getattr__(self, name: str) -> Any:
            return getattr(worker, name)

        async def forward(self, mb: stage_protocol.Microbatch, inputs: torch.Tensor) -> Any:
            if slow.pop() if slow else False:
                await asyncio.sleep(1.5)
            return await worker.forward(mb, inputs)

    servicer = stage_service.StageServicer(
        schema_of(spec, 0), cast(Any, SlowOnce()), verifier=Verifier(identity.peer_id)
    )
    server, port = await start_server(lambda s: stage_service.add_to_server(servicer, s))
    transport = Transport(SwarmConfig().transport(ServerLimits()))
    try:
        async with transport:

            async def refresh(stage: int) -> list[tuple[str, str]]:
                return [(identity.peer_id, f"127.0.0.1:{port}")]

            client = PipelineClient(spec, Identity.generate(), transport, refresh=refresh)
            await client.refresh(0)
            request = stage_pb2.ForwardRequest(
                inputs=stage_pb2.StageInputs(tokens=stage_protocol.token_bytes(_tokens(0)), batch=4)
            )
            started = time.monotonic()
            _, peer = await client._call(0, 0, 0, 4, "Forward", request)
            assert peer == identity.peer_id
            assert time.monotonic() - started < 3.5  # the deadline, then at once: not the wait
            assert client.counters[0].failures == {"DEADLINE_EXCEEDED": 1}
    finally:
        await server.stop(0)
        worker.close()


async def test_nan_values_are_refused_as_non_finite_and_a_full_queue_as_overloaded(
    channels: dict[int, grpc.aio.Channel], monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = Identity.generate()
    replica = await _replica(1, Identity.generate())
    channel = channels[1] = open_channel(f"127.0.0.1:{replica.port}")
    call = _call(channel, "ForwardLoss", stage_pb2.ForwardLossReply)
    shape = (BATCH, SPEC.model.seq_len, SPEC.model.d_model)

    def request(step: int, values: torch.Tensor) -> stage_pb2.ForwardLossRequest:
        message = stage_pb2.ForwardLossRequest(
            header=_header(trainer, 1, step),
            inputs=stage_pb2.StageInputs(activations=stage_protocol.encode("none", values)),
            labels=stage_protocol.token_bytes(_tokens(step)),
            loss_scale=0.5,
        )
        stage_protocol.sign(
            trainer, stage_protocol.FORWARD_LOSS_METHOD, replica.identity.peer_id, message
        )
        return message

    try:
        nan = torch.randn(shape)
        nan[0, 0, 0] = float("nan")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(request(1, nan), timeout=10)
        assert "NON_FINITE" in (refused.value.details() or "")
        # The worker thread busy: beyond MAX_QUEUED the replica refuses before decoding more.
        monkeypatch.setattr(stage_service, "MAX_QUEUED", 2)
        release = asyncio.Event()
        real = replica.worker.forward_loss

        async def held(*args: Any) -> Any:
            await release.wait()
            return await real(*args)

        monkeypatch.setattr(replica.worker, "forward_loss", held)
        queued = [asyncio.ensure_future(call(request(10 + i, torch.randn(shape)), timeout=10))
                  for i in range(2)]  # fmt: skip

        async def both_admitted() -> bool:
            return replica.servicer._queued == 2

        await until(both_admitted, timeout_seconds=10, what="two requests queued")
        with pytest.raises(grpc.aio.AioRpcError) as overloaded:
            await call(request(20, torch.randn(shape)), timeout=10)
        assert overloaded.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "OVERLOADED" in (overloaded.value.details() or "")
        release.set()
        await asyncio.gather(*queued)
    finally:
        await replica.stop()


async def test_a_restarted_trainers_microbatches_are_not_taken_for_retries() -> None:
    # Replicas de-duplicate by (trainer, step, index); a trainer restarted under its identity
    # counts steps from 0 again: its new batches' gradients were dropped as "duplicates".
    trainer = Identity.generate()
    replicas = [await _replica(k, Identity.generate()) for k in range(2)]
    transport = Transport(SwarmConfig().transport(ServerLimits()))
    try:
        async with transport:

            async def refresh(stage: int) -> list[tuple[str, str]]:
                return [(replicas[stage].identity.peer_id, f"127.0.0.1:{replicas[stage].port}")]

            for run in range(2):  # the trainer, then the trainer restarted
                client = PipelineClient(SPEC, trainer, transport, refresh=refresh)
                tokens = _tokens(100 + run)
                targets = _tokens(200 + run)
                await client.step(0, tokens, targets)
            assert replicas[1].worker.stats.duplicates == 0
            assert replicas[0].worker.stats.duplicates == 0
            assert replicas[1].worker.stats.samples == 2 * BATCH  # both batches stepped on
    finally:
        for replica in replicas:
            await replica.stop()


async def test_a_replica_whose_outputs_the_next_stage_refuses_is_banned_not_fatal() -> None:
    # A faulty stage-0 replica answers NaN activations: stage 1 refuses them (NON_FINITE). The
    # trainer's request was fine: the step fails to be tried again, the faulty one banned (the
    # trainer exited on it before, and the replica kept its place).
    trainer = Identity.generate()
    bad = await _replica(0, Identity.generate())
    good = await _replica(0, Identity.generate())
    last = await _replica(1, Identity.generate())
    real = bad.worker.forward

    async def nan_outputs(*args: Any) -> Any:
        done = await real(*args)
        return dataclasses.replace(done, tensor=torch.full_like(done.tensor, float("nan")))

    bad.worker.forward = nan_outputs  # type: ignore[method-assign]
    serving = {0: [bad], 1: [last]}
    transport = Transport(SwarmConfig().transport(ServerLimits()))
    try:
        async with transport:

            async def refresh(stage: int) -> list[tuple[str, str]]:
                return [(r.identity.peer_id, f"127.0.0.1:{r.port}") for r in serving[stage]]

            client = PipelineClient(SPEC, trainer, transport, refresh=refresh)
            with pytest.raises(FaultyReplica) as fault:
                await client.step(0, _tokens(0), _tokens(50))
            assert fault.value.stage == 0
            assert bad.identity.peer_id not in {r.peer_id for r in client.router.live(0)}
            serving[0].append(good)
            await client.refresh(0)
            await client.step(0, _tokens(0), _tokens(50))  # the step again, on the good one
            assert good.worker.stats.forwards
    finally:
        for replica in (bad, good, last):
            await replica.stop()
