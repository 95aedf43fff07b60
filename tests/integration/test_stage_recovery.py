"""Stage replicas and their trainer through restarts, retries and faults, on real gRPC servers
(127.0.0.1:0): a replica restarted between a microbatch's forward and its backward answers
NEED_INPUTS, and the resent inputs give the very gradients of an uninterrupted pass; a retried
microbatch counts once while a restarted trainer's new ones count; a replica that missed one
deadline is tried again, and one whose outputs the next stage refuses is banned, not fatal."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, cast

import grpc
import pytest
import torch

from swarmgrad.node.identity import Identity
from swarmgrad.node.pipeline.client import FaultyReplica, PipelineClient
from swarmgrad.node.pipeline.model import build_stage, schema_of
from swarmgrad.node.pipeline.worker import StageWorker
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.swarm_config import SwarmConfig
from swarmgrad.node.transport.transport import Transport
from swarmgrad.protocol import stage as stage_protocol
from swarmgrad.protocol import stage_service
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.server import ServerLimits, open_channel, start_server
from swarmgrad.protocol.v1 import stage_pb2
from tests.integration.stage_replicas import (
    _SPEC_TEXT,
    BATCH,
    SPEC,
    _call,
    _forward_request,
    _header,
    _replica,
    _tokens,
)
from tests.integration.stage_replicas import channels as channels  # a fixture; "as" marks it used

pytestmark = pytest.mark.timeout(120)


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
