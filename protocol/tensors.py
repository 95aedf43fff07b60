"""Adapters between codec payloads (swarmgrad.compression) and the EncodedTensor wire message."""

from __future__ import annotations

import torch

from swarmgrad.compression import MAX_NUMEL, CodecError, Meta, decode
from swarmgrad.compression.base import MAX_NDIM
from swarmgrad.protocol.v1 import tensor_pb2

_MAX_PARAMS = 16
_MAX_NAME_CHARS = 64


def meta_to_proto(meta: Meta) -> tensor_pb2.CodecMeta:
    return tensor_pb2.CodecMeta(
        codec=meta.codec,
        version=meta.version,
        shape=list(meta.shape),
        dtype=meta.dtype,
        params=dict(meta.params),
    )


def meta_from_proto(message: tensor_pb2.CodecMeta) -> Meta:
    """Build a Meta from a peer's message, bounding every field first (CodecError otherwise)."""
    if len(message.shape) > MAX_NDIM:
        raise CodecError(f"shape has {len(message.shape)} dimensions, more than {MAX_NDIM}")
    if len(message.params) > _MAX_PARAMS:
        raise CodecError(f"{len(message.params)} codec parameters, more than {_MAX_PARAMS}")
    names = [message.codec, message.dtype, *message.params.keys()]
    if any(len(name) > _MAX_NAME_CHARS for name in names):
        raise CodecError(f"a codec, dtype or parameter name is longer than {_MAX_NAME_CHARS}")
    return Meta(
        codec=message.codec,
        version=message.version,
        shape=tuple(message.shape),
        dtype=message.dtype,
        params=dict(message.params),
    )


def tensor_to_proto(data: bytes, meta: Meta) -> tensor_pb2.EncodedTensor:
    return tensor_pb2.EncodedTensor(meta=meta_to_proto(meta), payload=data)


def tensor_from_proto(
    message: tensor_pb2.EncodedTensor, *, max_numel: int = MAX_NUMEL
) -> torch.Tensor:
    """Decode a peer's EncodedTensor; raises CodecError (a ValueError) on any malformed field."""
    if not message.HasField("meta"):
        raise CodecError("EncodedTensor has no meta")
    return decode(message.payload, meta_from_proto(message.meta), max_numel=max_numel)
