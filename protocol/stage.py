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
This module is the wire side (schema, signatures, payloads); the replica's server that applies
the checks is ``stage_service.py``.

Tensors travel through the run's codecs: activations forward as ``pipeline.activations``
(bf16 by default), their gradients back as ``pipeline.gradients`` (blockwise int8 by default);
"none" is fp32. Token ids and labels are int32, little-endian.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from swarmgrad.compression import get_codec
from swarmgrad.protocol.auth import Field, Signer, sign_request
from swarmgrad.protocol.tensors import tensor_to_proto
from swarmgrad.protocol.v1 import stage_pb2, tensor_pb2

SERVICE = "swarmgrad.v1.Stage"
INFO_METHOD = f"/{SERVICE}/Info"
FORWARD_METHOD = f"/{SERVICE}/Forward"
FORWARD_LOSS_METHOD = f"/{SERVICE}/ForwardLoss"
BACKWARD_METHOD = f"/{SERVICE}/Backward"
SYNC_METHOD = f"/{SERVICE}/Sync"
MAX_ID_CHARS = 128


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


def header_fields(header: stage_pb2.StageHeader, digest: bytes) -> list[Field]:
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
        sign_request(signer, method, receiver, header_fields(header, payload_digest(request)))
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
