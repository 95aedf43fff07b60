"""The Stage service's server: a replica's gate for trainers' requests (``stage.py`` says what
is checked, and in which order, before a tensor is read), its bounded queue of compute requests,
and the handlers it registers on the node's gRPC server.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Awaitable, Callable, Iterator

import grpc
import numpy as np
import torch

from swarmgrad.compression import CodecError, NonFiniteError, get_codec
from swarmgrad.protocol.auth import Verifier
from swarmgrad.protocol.errors import ProtocolViolation, quote
from swarmgrad.protocol.server import Rejections, unary
from swarmgrad.protocol.stage import (
    BACKWARD_METHOD,
    FORWARD_LOSS_METHOD,
    FORWARD_METHOD,
    MAX_ID_CHARS,
    SERVICE,
    SYNC_METHOD,
    Computed,
    Microbatch,
    StageBackend,
    StageRequest,
    StageSchema,
    header_fields,
    payload_digest,
    payload_sizes,
)
from swarmgrad.protocol.tensors import meta_from_proto, tensor_from_proto, tensor_to_proto
from swarmgrad.protocol.v1 import stage_pb2, tensor_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

#: Compute requests a replica holds at once (decoded, waiting for its worker thread): a
#: pipeline's trainers times their microbatches in flight, with room to spare.
MAX_QUEUED = 64


class StageServicer:
    """Checks Stage requests against ``schema``, then hands them to ``backend``."""

    def __init__(
        self,
        schema: StageSchema,
        backend: StageBackend,
        *,
        verifier: Verifier,
        rejections: Rejections | None = None,
        pace: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self.schema, self.backend = schema, backend
        self._verifier = verifier
        self.rejections = rejections if rejections is not None else Rejections()
        self._pace = pace
        self._activations = get_codec(schema.activations)
        self._gradients = get_codec(schema.gradients)
        #: Payload bytes received and sent, by kind ("activations", "gradients", "tokens").
        self.bytes_in: dict[str, int] = {}
        self.bytes_out: dict[str, int] = {}
        self._queued = 0  # compute requests admitted and not yet answered

    # -- the service's methods ----------------------------------------------------------------

    async def Info(
        self, request: stage_pb2.StageInfoRequest, context: object
    ) -> stage_pb2.StageInfo:
        self._check_run(request.run_id, request.spec_hash)
        return self.backend.info()

    async def Forward(
        self, request: stage_pb2.ForwardRequest, context: object
    ) -> stage_pb2.ForwardReply:
        mb = self._admit(FORWARD_METHOD, request)
        with self._slot():
            return await self._forward(mb, request)

    async def _forward(
        self, mb: Microbatch, request: stage_pb2.ForwardRequest
    ) -> stage_pb2.ForwardReply:
        if self.schema.last:
            raise ProtocolViolation(
                ResultCode.WRONG_STAGE, "the last stage takes ForwardLoss (it needs the labels)"
            )
        inputs = self._inputs(request.inputs)
        done = await self.backend.forward(mb, inputs)
        assert done.tensor is not None
        encoded = await self._encode(done.tensor, self._activations, "activations")
        return stage_pb2.ForwardReply(
            version=done.version, outputs=encoded, compute_seconds=done.seconds
        )

    async def ForwardLoss(
        self, request: stage_pb2.ForwardLossRequest, context: object
    ) -> stage_pb2.ForwardLossReply:
        mb = self._admit(FORWARD_LOSS_METHOD, request)
        with self._slot():
            return await self._forward_loss(mb, request)

    async def _forward_loss(
        self, mb: Microbatch, request: stage_pb2.ForwardLossRequest
    ) -> stage_pb2.ForwardLossReply:
        if not self.schema.last:
            raise ProtocolViolation(
                ResultCode.WRONG_STAGE, f"stage {self.schema.stage} is not the last stage"
            )
        inputs = self._inputs(request.inputs)
        labels = self._token_ids(request.labels, len(inputs), "labels")
        scale = request.loss_scale
        if not (math.isfinite(scale) and 0 < scale <= 1):
            raise ProtocolViolation(
                ResultCode.BAD_PAYLOAD, f"loss_scale {scale!r} is not in (0, 1]"
            )
        done = await self.backend.forward_loss(mb, inputs, labels, scale)
        reply = stage_pb2.ForwardLossReply(
            version=done.version,
            loss=done.loss,
            samples_accumulated=done.accumulated,
            compute_seconds=done.seconds,
        )
        await self._add_gradient(reply, done)
        return reply

    async def Backward(
        self, request: stage_pb2.BackwardRequest, context: object
    ) -> stage_pb2.BackwardReply:
        mb = self._admit(BACKWARD_METHOD, request)
        with self._slot():
            return await self._backward(mb, request)

    async def _backward(
        self, mb: Microbatch, request: stage_pb2.BackwardRequest
    ) -> stage_pb2.BackwardReply:
        if self.schema.last:
            raise ProtocolViolation(
                ResultCode.WRONG_STAGE, "the last stage's backward runs in ForwardLoss"
            )
        inputs = self._inputs(request.inputs) if request.HasField("inputs") else None
        batch = len(inputs) if inputs is not None else None
        grad_outputs = self._tensor(
            request.grad_outputs, self._gradients.name, "gradients", batch=batch
        )
        done = await self.backend.backward(mb, request.version, grad_outputs, inputs)
        reply = stage_pb2.BackwardReply(
            version=done.version,
            samples_accumulated=done.accumulated,
            compute_seconds=done.seconds,
        )
        await self._add_gradient(reply, done)
        return reply

    async def _add_gradient(
        self, reply: stage_pb2.ForwardLossReply | stage_pb2.BackwardReply, done: Computed
    ) -> None:
        """The inputs' gradient into ``reply`` (stage 0 has none)."""
        if done.tensor is not None:
            encoded = await self._encode(done.tensor, self._gradients, "gradients")
            reply.grad_inputs.CopyFrom(encoded)

    async def Sync(self, request: stage_pb2.SyncRequest, context: object) -> stage_pb2.SyncReply:
        mb = self._admit(SYNC_METHOD, request)
        epoch, outcome = await self.backend.sync(request.round, mb.trainer)
        return stage_pb2.SyncReply(epoch=epoch, outcome=outcome)

    @contextlib.contextmanager
    def _slot(self) -> Iterator[None]:
        """Room for one more compute request, before its tensors are decoded: each waits
        for the replica's one worker thread holding its inputs in memory, so beyond
        ``MAX_QUEUED`` the caller is told OVERLOADED (a trainer goes to another replica)."""
        if self._queued >= MAX_QUEUED:
            raise ProtocolViolation(
                ResultCode.OVERLOADED, f"{self._queued} requests are queued here already"
            )
        self._queued += 1
        try:
            yield
        finally:
            self._queued -= 1

    # -- checks -------------------------------------------------------------------------------

    def _check_run(self, run_id: str, spec_hash: bytes) -> None:
        if run_id != self.schema.run_id or spec_hash != self.schema.spec_hash:
            raise ProtocolViolation(
                ResultCode.WRONG_RUN,
                f"this replica serves run {self.schema.run_id!r} spec "
                f"{self.schema.spec_hash.hex()[:12]}",
            )

    def _admit(self, method: str, request: StageRequest) -> Microbatch:
        """The request's microbatch, once its header checks out; raises ProtocolViolation."""
        header = request.header
        self._check_run(header.run_id, header.spec_hash)
        if header.stage != self.schema.stage:
            raise ProtocolViolation(
                ResultCode.WRONG_STAGE,
                f"this replica serves stage {self.schema.stage}, not {header.stage}",
            )
        mb = header.id
        if not mb.trainer or len(mb.trainer) > MAX_ID_CHARS:
            raise ProtocolViolation(ResultCode.BAD_PAYLOAD, "the microbatch names no trainer")
        self._verifier.verify(
            method,
            header.auth,
            receiver=header.receiver,
            fields=header_fields(header, payload_digest(request)),
            sender=mb.trainer,
        )
        if not self.backend.serving:
            raise ProtocolViolation(ResultCode.DRAINING, "this replica is not serving")
        for kind, size in payload_sizes(request):
            self.bytes_in[kind] = self.bytes_in.get(kind, 0) + size
        return Microbatch(mb.trainer, mb.step, mb.index, mb.attempt)

    def _inputs(self, inputs: stage_pb2.StageInputs) -> torch.Tensor:
        if self.schema.first:
            if inputs.HasField("activations"):
                raise ProtocolViolation(ResultCode.BAD_PAYLOAD, "stage 0 takes token ids")
            if not 1 <= inputs.batch <= self.schema.max_batch:
                raise ProtocolViolation(
                    ResultCode.BAD_SHAPE,
                    f"a microbatch holds 1..{self.schema.max_batch} sequences, not {inputs.batch}",
                )
            return self._token_ids(inputs.tokens, inputs.batch, "tokens")
        if inputs.tokens or inputs.batch:
            raise ProtocolViolation(
                ResultCode.BAD_PAYLOAD, f"stage {self.schema.stage} takes activations"
            )
        return self._tensor(inputs.activations, self._activations.name, "activations")

    def _token_ids(self, data: bytes, batch: int, what: str) -> torch.Tensor:
        expected = 4 * batch * self.schema.seq_len
        if len(data) != expected:
            raise ProtocolViolation(
                ResultCode.BAD_SHAPE,
                f"{what}: {batch} x {self.schema.seq_len} int32 are {expected} bytes, "
                f"got {len(data)}",
            )
        ids = np.frombuffer(data, dtype="<i4")
        if ids.size and (ids.min() < 0 or ids.max() >= self.schema.vocab_size):
            raise ProtocolViolation(
                ResultCode.BAD_PAYLOAD, f"{what}: ids outside [0, {self.schema.vocab_size})"
            )
        return torch.from_numpy(ids.astype(np.int64)).view(batch, self.schema.seq_len)

    def _tensor(
        self, message: tensor_pb2.EncodedTensor, codec: str, what: str, *, batch: int | None = None
    ) -> torch.Tensor:
        """A checked ``(batch, seq_len, d_model)`` fp32 tensor of the codec ``codec``."""
        try:
            meta = meta_from_proto(message.meta)
        except CodecError as error:
            raise ProtocolViolation(ResultCode.BAD_PAYLOAD, f"{what}: {error}") from None
        if meta.codec != codec or meta.dtype != "float32":
            raise ProtocolViolation(
                ResultCode.BAD_CODEC,
                f"{what} travel as {codec} of float32 here, not {quote(meta.codec)} of "
                f"{quote(meta.dtype)}",
            )
        shape = meta.shape
        ok = len(shape) == 3 and 1 <= shape[0] <= self.schema.max_batch
        if not ok or shape != self.schema.activation_shape(batch or shape[0]):
            raise ProtocolViolation(
                ResultCode.BAD_SHAPE,
                f"{what}: shape {quote(list(shape))} is not (batch <= {self.schema.max_batch}, "
                f"{self.schema.seq_len}, {self.schema.d_model})"
                + (f" with batch {batch}" if batch is not None else ""),
            )
        try:
            values = tensor_from_proto(message, max_numel=meta.numel)
        except NonFiniteError as error:  # the decoder checks the values (or scales) itself
            raise ProtocolViolation(ResultCode.NON_FINITE, f"{what}: {error}") from None
        except CodecError as error:
            raise ProtocolViolation(ResultCode.BAD_PAYLOAD, f"{what}: {error}") from None
        if not bool(torch.isfinite(values).all()):
            raise ProtocolViolation(ResultCode.NON_FINITE, f"{what} hold NaN or Inf")
        return values

    async def _encode(
        self, tensor: torch.Tensor, codec: object, kind: str
    ) -> tensor_pb2.EncodedTensor:
        assert hasattr(codec, "encode")
        data, meta = codec.encode(tensor.detach().float().contiguous())
        self.bytes_out[kind] = self.bytes_out.get(kind, 0) + len(data)
        if self._pace is not None:
            await self._pace(len(data))
        return tensor_to_proto(data, meta)


def add_to_server(servicer: StageServicer, server: grpc.aio.Server) -> None:
    rejections = servicer.rejections

    def handler(method: Callable[..., Awaitable[object]], message: type) -> grpc.RpcMethodHandler:
        return unary(method, parse=message.FromString, rejections=rejections, service="Stage")  # type: ignore[attr-defined,arg-type]

    handlers = {
        "Info": handler(servicer.Info, stage_pb2.StageInfoRequest),
        "Forward": handler(servicer.Forward, stage_pb2.ForwardRequest),
        "ForwardLoss": handler(servicer.ForwardLoss, stage_pb2.ForwardLossRequest),
        "Backward": handler(servicer.Backward, stage_pb2.BackwardRequest),
        "Sync": handler(servicer.Sync, stage_pb2.SyncRequest),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
