"""The Stage service: a pipeline stage's replica serves forward and backward passes of its layer
span to the run's trainers (the replica's side of the work: ``node/pipeline/server.py``).

Every request names its run, spec, stage and microbatch, and is signed by the trainer it names
(:mod:`swarmgrad.protocol.auth`; the signature covers the header and a SHA-256 of every payload,
so a signed header cannot carry another payload). A receiver checks, before it reads a tensor:
the run and spec (WRONG_RUN), the stage (WRONG_STAGE), the signature (UNAUTHENTICATED), each
tensor's codec (BAD_CODEC), shape and size against the stage's schema (BAD_SHAPE), the payload
(BAD_PAYLOAD), its values (NON_FINITE; token ids outside the vocabulary are BAD_PAYLOAD), and
the loss scale. A replica that is leaving answers DRAINING (UNAVAILABLE); one that no longer
holds a microbatch's inputs NEED_INPUTS (FAILED_PRECONDITION), and the trainer resends them; one
holding ``MAX_QUEUED`` requests already OVERLOADED (RESOURCE_EXHAUSTED), before decoding more.

Tensors travel through the run's codecs: activations forward as ``pipeline.activations``
(bf16 by default), their gradients back as ``pipeline.gradients`` (blockwise int8 by default);
"none" is fp32. Token ids and labels are int32, little-endian.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np
import torch

from swarmgrad.compression import CodecError, NonFiniteError, get_codec
from swarmgrad.protocol.auth import Field, Signer, Verifier, sign_request
from swarmgrad.protocol.errors import ProtocolViolation, quote
from swarmgrad.protocol.server import Rejections, unary
from swarmgrad.protocol.tensors import meta_from_proto, tensor_from_proto, tensor_to_proto
from swarmgrad.protocol.v1 import stage_pb2, tensor_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

SERVICE = "swarmgrad.v1.Stage"
INFO_METHOD = f"/{SERVICE}/Info"
FORWARD_METHOD = f"/{SERVICE}/Forward"
FORWARD_LOSS_METHOD = f"/{SERVICE}/ForwardLoss"
BACKWARD_METHOD = f"/{SERVICE}/Backward"
SYNC_METHOD = f"/{SERVICE}/Sync"
_MAX_ID_CHARS = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class StageSchema:
    """What stage ``stage`` of a run accepts: the run's model sizes and pipeline codecs."""

    run_id: str
    spec_hash: bytes
    stage: int
    stages: int
    seq_len: int
    d_model: int
    vocab_size: int
    max_batch: int  # sequences in one microbatch, at most
    activations: str  # codec names
    gradients: str

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def activation_shape(self, batch: int) -> tuple[int, int, int]:
        return (batch, self.seq_len, self.d_model)

    @property
    def max_message_bytes(self) -> int:
        """The largest request or reply this schema allows (fp32 activations, plus headers)."""
        return max_message_bytes(self.max_batch, self.seq_len, self.d_model)


def max_message_bytes(max_batch: int, seq_len: int, d_model: int) -> int:
    """The largest Stage request or reply: a microbatch of ``max_batch`` sequences, its inputs
    and their gradients in fp32 (a Backward that resends its inputs), plus headers."""
    return 4 * max_batch * seq_len * max(d_model, 2) * 2 + 64 * 1024


# -- what a signature covers --------------------------------------------------------------------


def _tensor_fields(message: tensor_pb2.EncodedTensor) -> list[Field]:
    meta = message.meta
    params = b"".join(
        k.encode() + b"\0" + str(v).encode() + b"\0" for k, v in sorted(meta.params.items())
    )
    shape = b"".join(int(d).to_bytes(8, "little", signed=True) for d in meta.shape)
    return [meta.codec, meta.version, shape, meta.dtype, params, message.payload]


def _inputs_fields(inputs: stage_pb2.StageInputs) -> list[Field]:
    return [inputs.tokens, inputs.batch, *_tensor_fields(inputs.activations)]


StageRequest = (
    stage_pb2.ForwardRequest
    | stage_pb2.ForwardLossRequest
    | stage_pb2.BackwardRequest
    | stage_pb2.SyncRequest
)


def payload_digest(request: StageRequest) -> bytes:
    """SHA-256 of everything in ``request`` but its header: what the signature binds to it."""
    fields: list[Field]
    if isinstance(request, stage_pb2.SyncRequest):
        fields = ["sync", request.round]
    elif isinstance(request, stage_pb2.ForwardRequest):
        fields = ["forward", *_inputs_fields(request.inputs)]
    elif isinstance(request, stage_pb2.ForwardLossRequest):
        fields = [
            "forward_loss",
            *_inputs_fields(request.inputs),
            request.labels,
            float(request.loss_scale),
        ]
    else:
        fields = [
            "backward",
            request.version,
            *_tensor_fields(request.grad_outputs),
            int(request.HasField("inputs")),
            *_inputs_fields(request.inputs),
        ]
    digest = hashlib.sha256()
    for field in fields:
        data = field.encode() if isinstance(field, str) else field
        if isinstance(data, bytes):
            digest.update(len(data).to_bytes(8, "little") + data)
        else:
            digest.update(repr(data).encode() + b"\0")
    return digest.digest()


def _header_fields(header: stage_pb2.StageHeader, digest: bytes) -> list[Field]:
    mb = header.id
    return [
        header.run_id,
        header.spec_hash,
        header.stage,
        mb.trainer,
        mb.step,
        mb.index,
        mb.attempt,
        digest,
    ]


def sign(signer: Signer, method: str, receiver: str, request: StageRequest) -> None:
    """Fill ``request.header``'s receiver and signature (the rest of it set already)."""
    header = request.header
    header.receiver = receiver
    header.auth.CopyFrom(
        sign_request(signer, method, receiver, _header_fields(header, payload_digest(request)))
    )


# -- what a replica computes --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Microbatch:
    """A request's microbatch, checked: who sent it (the trainer's peer id) and which it is."""

    trainer: str
    step: int
    index: int
    attempt: int

    @property
    def key(self) -> tuple[str, int, int]:
        """The microbatch, whichever attempt: what a replica caches and de-duplicates by."""
        return (self.trainer, self.step, self.index)


@dataclass(frozen=True, slots=True)
class Computed:
    """What a replica computed for one request."""

    tensor: torch.Tensor | None  # outputs (Forward) or the inputs' gradient (None: stage 0)
    version: int  # its inner steps when it ran
    seconds: float  # on its compute thread (its pace, not its queue)
    accumulated: int = 0  # samples accumulated towards its next inner step
    loss: float = 0.0  # ForwardLoss: the microbatch's mean loss


class StageBackend(Protocol):
    """The replica's compute (``node/pipeline/server.py``); tensors arrive checked."""

    @property
    def serving(self) -> bool: ...

    def info(self) -> stage_pb2.StageInfo: ...

    async def forward(self, mb: Microbatch, inputs: torch.Tensor) -> Computed:
        """The stage's outputs."""
        ...

    async def forward_loss(
        self, mb: Microbatch, inputs: torch.Tensor, labels: torch.Tensor, scale: float
    ) -> Computed:
        """The loss, and the inputs' gradient (None on a one-stage pipeline)."""
        ...

    async def backward(
        self, mb: Microbatch, version: int, grad_outputs: torch.Tensor, inputs: torch.Tensor | None
    ) -> Computed:
        """The inputs' gradient (None on stage 0); raises ProtocolViolation(NEED_INPUTS) when
        ``inputs`` is None and it holds none."""
        ...

    async def sync(self, round_: int, trainer: str) -> tuple[int, str]:
        """Run the stage group's outer round to reach epoch ``round_`` (at once if there),
        once the run's trainers have asked (``trainer`` just did): the epoch then and the
        round's outcome."""
        ...


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
        if not mb.trainer or len(mb.trainer) > _MAX_ID_CHARS:
            raise ProtocolViolation(ResultCode.BAD_PAYLOAD, "the microbatch names no trainer")
        self._verifier.verify(
            method,
            header.auth,
            receiver=header.receiver,
            fields=_header_fields(header, payload_digest(request)),
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


def payload_sizes(request: StageRequest) -> Sequence[tuple[str, int]]:
    """Each payload of ``request`` by kind (tokens, activations, gradients) and its bytes."""
    sizes: list[tuple[str, int]] = []
    if isinstance(request, stage_pb2.SyncRequest):
        return sizes
    if request.HasField("inputs"):
        sizes.append(("tokens", len(request.inputs.tokens)))
        sizes.append(("activations", len(request.inputs.activations.payload)))
    if isinstance(request, stage_pb2.ForwardLossRequest):
        sizes.append(("tokens", len(request.labels)))
    if isinstance(request, stage_pb2.BackwardRequest):
        sizes.append(("gradients", len(request.grad_outputs.payload)))
    return sizes


def encode(codec_name: str, tensor: torch.Tensor) -> tensor_pb2.EncodedTensor:
    """``tensor`` as fp32 through the codec ``codec_name``, for the wire."""
    data, meta = get_codec(codec_name).encode(tensor.detach().float().contiguous())
    return tensor_to_proto(data, meta)


def token_bytes(ids: torch.Tensor) -> bytes:
    """Token ids or labels as the wire carries them (int32, little-endian)."""
    return ids.to(torch.int32).contiguous().numpy().astype("<i4", copy=False).tobytes()


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
