"""The Stage service on a real gRPC server against hostile input: thousands of malformed or
impersonating requests are refused with their documented status, crash nothing, and leave honest
microbatches' results unchanged; NaN values are refused as non-finite and a full queue as
overloaded; a stage server's transport takes its largest honest request."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import torch

from swarmgrad.node.identity import Identity
from swarmgrad.node.pipeline.model import schema_of
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.swarm import Swarm
from swarmgrad.node.swarm_config import SwarmConfig
from swarmgrad.protocol import stage as stage_protocol
from swarmgrad.protocol import stage_service
from swarmgrad.protocol.server import open_channel
from swarmgrad.protocol.v1 import stage_pb2
from tests.helpers import until
from tests.integration.stage_replicas import (
    BATCH,
    SPEC,
    Replica,
    _call,
    _forward_request,
    _header,
    _replica,
    _tokens,
)
from tests.integration.stage_replicas import channels as channels  # a fixture; "as" marks it used

pytestmark = pytest.mark.timeout(120)


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
