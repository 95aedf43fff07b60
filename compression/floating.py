"""Dense floating-point codecs: the identity (``none``), ``fp16`` and ``bf16``."""

from __future__ import annotations

import torch

from swarmgrad.compression.base import (
    DevicePayloadCodec,
    Meta,
    Ready,
    check_finite,
    expect_params,
    register,
)
from swarmgrad.compression.buffers import DTYPES, Wire, device_flat, from_bytes, scratch_bytes
from swarmgrad.compression.traits import BUILTIN

_FP16_MAX = torch.finfo(torch.float16).max
_BF16_BELOW_FP16_MAX = 65280.0  # the largest bfloat16 value that float16 holds
#: Values per part of a GPU payload (each part copied to the host while the next is cast).
_DEVICE_PART_VALUES = 1 << 22


@register
class NoCompression(DevicePayloadCodec):
    """Identity: the raw bytes of the tensor in its own dtype (``numel * itemsize`` bytes)."""

    name = "none"
    version = 1
    traits = BUILTIN["none"]
    lossless = True

    def _payload(
        self, tensor: torch.Tensor, ready: Ready | None = None
    ) -> tuple[torch.Tensor, Meta]:
        return device_flat(tensor).contiguous().view(torch.uint8), self._meta(tensor)

    def encode_view(self, tensor: torch.Tensor) -> tuple[bytes | memoryview, Meta]:
        flat = device_flat(tensor)
        if (
            flat.device.type != "cpu"
            or not flat.is_contiguous()
            or flat.dtype == torch.bfloat16
            or flat.numel() == 0
        ):
            return super().encode_view(tensor)  # numpy has no bfloat16; GPU: a pinned copy
        return flat.detach().numpy().data.cast("B"), self._meta(tensor)

    @classmethod
    def payload_nbytes(cls, meta: Meta) -> int:
        expect_params(meta)
        return meta.raw_nbytes

    @classmethod
    def _decode_into(cls, data: Wire, meta: Meta, out: torch.Tensor) -> None:
        wire = from_bytes(data, DTYPES[meta.dtype])
        check_finite(wire, "none payload")
        out.copy_(wire)


class _CastCodec(DevicePayloadCodec):
    """Cast to a 16-bit float on the wire, back to the original dtype on decode."""

    wire_dtype: torch.dtype

    def _payload(
        self, tensor: torch.Tensor, ready: Ready | None = None
    ) -> tuple[torch.Tensor, Meta]:
        flat = device_flat(tensor)
        n, size = flat.numel(), self.wire_dtype.itemsize
        payload = scratch_bytes(n * size, flat.device)
        wire = payload.view(self.wire_dtype)
        # In parts when someone copies them out meanwhile (a GPU's payload to the host).
        step = _DEVICE_PART_VALUES if ready is not None else max(n, 1)
        for start in range(0, n, step):
            stop = min(start + step, n)
            part = wire[start:stop]
            part.copy_(flat[start:stop])
            self._fix_range(part, flat.dtype)
            if ready is not None:
                ready(payload, start * size, stop * size)
        return payload, self._meta(tensor)

    def _fix_range(self, wire: torch.Tensor, source: torch.dtype) -> None:
        """Adjust the cast values in place so that they are finite in both the wire dtype and
        the ``source`` dtype they decode back into."""

    @classmethod
    def payload_nbytes(cls, meta: Meta) -> int:
        expect_params(meta)
        return meta.numel * cls.wire_dtype.itemsize

    @classmethod
    def _decode_into(cls, data: Wire, meta: Meta, out: torch.Tensor) -> None:
        wire = from_bytes(data, cls.wire_dtype)
        # On the 16-bit values (half the bytes to read), in the same pass: whether they fit out's
        # dtype (a bf16 value over 65504 would be Inf in a float16 out).
        check_finite(wire, f"{cls.name} payload", dtype=out.dtype)
        out.copy_(wire)


@register
class Float16(_CastCodec):
    """IEEE half precision, 2 bytes a value. Values beyond +-65504 are clamped, not sent as Inf."""

    name = "fp16"
    version = 1
    traits = BUILTIN["fp16"]
    wire_dtype = torch.float16

    def _fix_range(self, wire: torch.Tensor, source: torch.dtype) -> None:
        # Cast first, then clamp the (half-size) result in place: what overflowed became +-Inf
        # and is clamped back to +-65504; NaN stays NaN.
        wire.clamp_(-_FP16_MAX, _FP16_MAX)


@register
class BFloat16(_CastCodec):
    """bfloat16, 2 bytes a value: fp32's range, 8 bits of mantissa (round to nearest even)."""

    name = "bf16"
    version = 1
    traits = BUILTIN["bf16"]
    wire_dtype = torch.bfloat16

    def _fix_range(self, wire: torch.Tensor, source: torch.dtype) -> None:
        # bf16 has fp32's range, but rounds float16's largest values (from 65408) up to 65536,
        # which decodes to Inf in float16 (and is refused): keep them at bf16's largest below.
        if source == torch.float16:
            wire.clamp_(-_BF16_BELOW_FP16_MAX, _BF16_BELOW_FP16_MAX)
