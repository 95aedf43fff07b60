"""Stage replicas on real gRPC servers (127.0.0.1:0) for tests, and the signed requests a trainer
sends them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import pytest_asyncio
import torch

from swarmgrad.node.identity import Identity
from swarmgrad.node.pipeline.model import build_stage, schema_of
from swarmgrad.node.pipeline.worker import StageWorker
from swarmgrad.node.runspec import RunSpec
from swarmgrad.protocol import stage as stage_protocol
from swarmgrad.protocol import stage_service
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.server import start_server
from swarmgrad.protocol.v1 import stage_pb2

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
