"""Dense floating-point codecs: the identity (``none``), ``fp16`` and ``bf16``."""

from __future__ import annotations

import torch

from swarmgrad.compression.base import (
    DTYPES,
    Codec,
    Meta,
    check_finite,
    dtype_name,
    expect_params,
    from_bytes,
    register,
    to_bytes,
)

_FP16_MAX = torch.finfo(torch.float16).max


@register
class NoCompression(Codec):
    """Identity: the raw bytes of the tensor in its own dtype (``numel * itemsize`` bytes)."""

    name = "none"
    version = 1
    lossless = True

    def encode(self, tensor: torch.Tensor) -> tuple[bytes, Meta]:
        dtype_name(tensor.dtype)
        return to_bytes(tensor), self._meta(tensor)

    @classmethod
    def payload_nbytes(cls, meta: Meta) -> int:
        expect_params(meta)
        return meta.raw_nbytes

    @classmethod
    def _decode(cls, data: bytes, meta: Meta) -> torch.Tensor:
        out = from_bytes(data, DTYPES[meta.dtype]).clone()
        check_finite(out, "none payload")
        return out.reshape(meta.shape)


class _CastCodec(Codec):
    """Cast to a 16-bit float on the wire, back to the original dtype on decode."""

    wire_dtype: torch.dtype

    def encode(self, tensor: torch.Tensor) -> tuple[bytes, Meta]:
        dtype_name(tensor.dtype)
        return to_bytes(self._cast(tensor.detach().reshape(-1))), self._meta(tensor)

    def _cast(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.to(self.wire_dtype)

    @classmethod
    def payload_nbytes(cls, meta: Meta) -> int:
        expect_params(meta)
        return meta.numel * cls.wire_dtype.itemsize

    @classmethod
    def _decode(cls, data: bytes, meta: Meta) -> torch.Tensor:
        wire = from_bytes(data, cls.wire_dtype)
        out = wire.to(DTYPES[meta.dtype], copy=True)
        check_finite(out, f"{cls.name} payload")
        return out.reshape(meta.shape)


@register
class Float16(_CastCodec):
    """IEEE half precision, 2 bytes a value. Values beyond +-65504 are clamped, not sent as Inf."""

    name = "fp16"
    version = 1
    wire_dtype = torch.float16

    def _cast(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.dtype == torch.float16:
            return flat
        return flat.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)


@register
class BFloat16(_CastCodec):
    """bfloat16, 2 bytes a value: fp32's range, 8 bits of mantissa (round to nearest even)."""

    name = "bf16"
    version = 1
    wire_dtype = torch.bfloat16
