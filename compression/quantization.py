"""Blockwise absmax quantization to 8 bits (``int8``) and 4 bits (``int4``, two values per byte).

The flat tensor is cut into blocks of ``block_size`` values; each block is scaled by its own
absolute maximum onto the symmetric integer range ``[-L, L]`` (L = 127 for 8 bits, 7 for 4 bits)
and rounded to nearest. Per-block scales make the error follow the local magnitude, which matters
for model deltas whose layers differ by orders of magnitude.

Payload layout (little-endian), ``nb = ceil(numel / block_size)``:
    ``float32 scale[nb]`` (the block's absmax / L) then
    ``int8 q[numel]`` (8 bits), or ``uint8 packed[ceil(numel / 2)]`` (4 bits: value ``2i`` in the
    low nibble of byte ``i``, ``2i+1`` in the high nibble, each stored as ``q + 8``).

Speed: the work runs over chunks of ~1 Mi values so that the temporaries of each eager op stay in
cache; fused this way an 8-bit encode + decode of 16 Mi fp32 values takes ~45 ms on two cores
(benchmarks/codecs.py), instead of ~85 ms for the same ops over the whole tensor. A CUDA tensor is
encoded on its GPU in parts of 8 Mi values, each part's payload copied to the host while the next
is coded: with Triton (a CUDA torch ships it) one fused kernel a part writes the scales and codes
(``kernels.py``), else eager ops in few launches (the scales in one pass, then the codes). Decoding
onto a GPU takes only the payload across; the scales are checked on the host, from the received
bytes, while the payload crosses, and one kernel (or a few eager ops) decodes.
"""

from __future__ import annotations

import torch

from swarmgrad.compression import kernels
from swarmgrad.compression.base import (
    CodecError,
    DevicePayloadCodec,
    Meta,
    NonFiniteError,
    Ready,
    check_finite,
    expect_params,
    fits,
    register,
)
from swarmgrad.compression.buffers import Wire, device_flat, from_bytes, scratch_bytes, to_device
from swarmgrad.compression.traits import BUILTIN

_CHUNK_VALUES = 1 << 20
_DEVICE_CHUNK_VALUES = 1 << 24
#: Values per part of a GPU's codes (each part copied to the host while the next is coded),
#: eager or fused alike (on an H100, fused parts of 1/2/4/8 Mi values encoded 64 MiB in
#: 1.85/0.75/0.50/0.48 ms).
_DEVICE_PART_VALUES = 1 << 23
_MAX_BLOCK = 1 << 20
_F32_MAX = torch.finfo(torch.float32).max


class _BlockwiseAbsmax(DevicePayloadCodec):
    bits: int
    default_block_size: int

    def __init__(self, block_size: int | None = None) -> None:
        block_size = self.default_block_size if block_size is None else block_size
        _check_block_size(block_size, ValueError)
        self.block_size = block_size

    @classmethod
    def levels(cls) -> int:
        return (1 << (cls.bits - 1)) - 1

    # -- encode -------------------------------------------------------------------------------

    def _payload(
        self, tensor: torch.Tensor, ready: Ready | None = None
    ) -> tuple[torch.Tensor, Meta]:
        meta = self._meta(tensor, block_size=self.block_size)
        flat = device_flat(tensor)
        if flat.dtype != torch.float32:
            flat = flat.float()
        n = flat.numel()
        # One buffer holds the whole payload: scales and codes are written in place, and the
        # only copy is the final one into the returned bytes.
        payload = scratch_bytes(4 * -(-n // self.block_size) + self._codes_len(n), flat.device)
        if flat.device.type == "cpu":
            self._encode_in_chunks(flat, payload, ready)
        elif kernels.usable(flat, self.block_size):
            self._encode_fused(flat, payload, ready)
        else:
            self._encode_in_passes(flat, payload, ready)
        return payload, meta

    def _encode_in_chunks(
        self, flat: torch.Tensor, payload: torch.Tensor, ready: Ready | None
    ) -> None:
        """A CPU's encoding: each cache-sized chunk scaled, rounded and stored in one go."""
        n, block = flat.numel(), self.block_size
        nb = -(-n // block)
        scales = payload[: 4 * nb].view(torch.float32)
        codes = payload[4 * nb :].view(self._code_dtype())
        full = (n // block) * block
        chunk = max(block, (_CHUNK_VALUES // block) * block)
        tmp = torch.empty(min(chunk, max(full, block)), dtype=torch.float32)

        def done(start: int, stop: int) -> None:
            if ready is not None:
                ready(payload, 4 * (start // block), 4 * -(-stop // block))
                base = 4 * nb
                ready(payload, base + self._codes_len(start), base + self._codes_len(stop))

        for start in range(0, full, chunk):
            stop = min(start + chunk, full)
            rows = flat[start:stop].view(-1, block)
            scaled = tmp[: stop - start].view(-1, block)
            # abs into the cached temporary, then a row max: ~15x faster than aminmax(dim=1),
            # whose per-row reduction is not vectorized on CPU. NaN propagates through amax.
            absmax = torch.abs(rows, out=scaled).amax(dim=1)
            _check_finite(absmax)
            self._scale(absmax, scales[start // block : stop // block])
            rounded = self._round(rows, absmax, scaled)
            self._store(rounded, codes[self._codes_len(start) : self._codes_len(stop)])
            done(start, stop)
        if full < n:  # the last, partial block: pad with zeros to a whole block
            tail = self._tail(flat, full)
            absmax = tail.abs().amax(dim=1)
            _check_finite(absmax)
            self._scale(absmax, scales[-1:])
            self._store_tail(self._round(tail, absmax, torch.empty_like(tail)), codes, full, n)
            done(full, n)

    def _encode_in_passes(
        self, flat: torch.Tensor, payload: torch.Tensor, ready: Ready | None
    ) -> None:
        """A GPU's encoding, in few launches (each op costs the host more than the GPU): every
        block's scale in one pass over the whole tensor (copied out at once), then the codes in
        parts, each part copied out while the next is rounded; NaN/Inf read back once, at the
        end (no wait in between that would stall the copies). The same bytes as on a CPU."""
        n, block, device = flat.numel(), self.block_size, flat.device
        nb = -(-n // block)
        scales = payload[: 4 * nb].view(torch.float32)
        codes = payload[4 * nb :].view(self._code_dtype())
        full = (n // block) * block
        work = torch.empty(full, dtype=torch.float32, device=device)
        rows = flat[:full].view(-1, block)
        absmax = torch.empty(nb, dtype=torch.float32, device=device)
        torch.amax(torch.abs(rows, out=work.view(-1, block)), dim=1, out=absmax[: full // block])
        tail = self._tail(flat, full) if full < n else None
        if tail is not None:
            torch.amax(tail.abs(), dim=1, out=absmax[-1:])
        self._scale(absmax, scales)
        if ready is not None:
            ready(payload, 0, 4 * nb)
        part = max(block, (_DEVICE_PART_VALUES // block) * block)
        for start in range(0, full, part):
            stop = min(start + part, full)
            scaled = work[start:stop].view(-1, block)
            rounded = self._round(
                rows[start // block : stop // block], absmax[start // block : stop // block], scaled
            )
            lo, hi = self._codes_len(start), self._codes_len(stop)
            self._store(rounded, codes[lo:hi])
            if ready is not None:
                ready(payload, 4 * nb + lo, 4 * nb + hi)
        if tail is not None:
            self._store_tail(self._round(tail, absmax[-1:], torch.empty_like(tail)), codes, full, n)
            if ready is not None:
                ready(payload, 4 * nb + self._codes_len(full), payload.numel())
        _check_finite(absmax)

    def _encode_fused(self, flat: torch.Tensor, payload: torch.Tensor, ready: Ready | None) -> None:
        """One fused kernel per part writes its blocks' scales and codes; each part's codes are
        copied out while the next is coded, the scales (a sixty-fourth of the input or less)
        last; NaN/Inf read back once, from the scales."""
        flat = flat.contiguous()  # the kernel reads the values at their flat offsets
        n, block = flat.numel(), self.block_size
        nb = -(-n // block)
        scales = payload[: 4 * nb].view(torch.float32)
        codes = payload[4 * nb :].view(self._code_dtype())
        part = max(1, _DEVICE_PART_VALUES // block)
        for first in range(0, nb, part):
            stop = min(first + part, nb)
            kernels.encode_blocks(flat, scales, codes, block, self.bits, first, stop)
            if ready is not None:
                lo, hi = self._codes_len(first * block), self._codes_len(min(stop * block, n))
                ready(payload, 4 * nb + lo, 4 * nb + hi)
        if ready is not None and nb:
            ready(payload, 0, 4 * nb)
        _check_finite(scales)

    def _tail(self, flat: torch.Tensor, full: int) -> torch.Tensor:
        """The last, partial block as one row padded with zeros."""
        tail = torch.zeros(1, self.block_size, dtype=torch.float32, device=flat.device)
        tail[0, : flat.numel() - full] = flat[full:]
        return tail

    def _scale(self, absmax: torch.Tensor, scales: torch.Tensor) -> None:
        # Divide by a tensor, not a Python number: a GPU divides by a host scalar as a multiply
        # by its reciprocal, whose rounding differs from the CPU's division.
        divisor = torch.full((), self.levels(), dtype=torch.float32, device=absmax.device)
        torch.div(absmax, divisor, out=scales)

    def _round(self, rows: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``rows`` scaled by their blocks' ``absmax`` onto [-L, L] and rounded (into ``out``)."""
        inv = torch.where(absmax > 0, absmax.reciprocal().mul_(self.levels()), 0.0)
        return torch.mul(rows, inv[:, None], out=out).round_().view(-1)

    def _store_tail(self, rounded: torch.Tensor, codes: torch.Tensor, full: int, n: int) -> None:
        packed = torch.empty(
            self._codes_len(self.block_size), dtype=self._code_dtype(), device=codes.device
        )
        self._store(rounded, packed)
        codes[self._codes_len(full) :] = packed[: self._codes_len(n) - self._codes_len(full)]

    # -- decode -------------------------------------------------------------------------------

    @classmethod
    def payload_nbytes(cls, meta: Meta) -> int:
        block = expect_params(meta, "block_size")["block_size"]
        _check_block_size(block, CodecError)
        nb = -(-meta.numel // block)
        return 4 * nb + cls._codes_len(meta.numel)

    @classmethod
    def _decode_into(cls, data: Wire, meta: Meta, out: torch.Tensor) -> None:
        scales, codes = cls._split(data, meta)
        cls._values(codes, scales, out, meta.params["block_size"], isinstance(data, torch.Tensor))
        # Checked last (a bad payload leaves garbage in out, as decode allows): a GPU is waited
        # for once, when all is queued.
        if scales.numel() and cls._check_scales(scales, out.dtype):
            check_finite(out, f"{cls.name} payload as {meta.dtype}")

    @classmethod
    def _decode_onto(cls, data: bytes | memoryview, meta: Meta, out: torch.Tensor) -> None:
        """Onto a GPU: the scales are checked on the host, from the received bytes, while the
        payload's last part crosses; the GPU is not waited for (the decode is queued on the
        current stream, after the copy)."""
        payload = to_device(data, out.device)
        host_scales, _ = cls._split(data, meta)
        read_values = bool(host_scales.numel()) and cls._check_scales(host_scales, out.dtype)
        scales, codes = cls._split(payload, meta)
        cls._values(codes, scales, out, meta.params["block_size"], fused=True)
        if read_values:  # a float16 out: its values are read once, for an Inf the cast made
            check_finite(out, f"{cls.name} payload as {meta.dtype}")

    @classmethod
    def _split(cls, data: Wire, meta: Meta) -> tuple[torch.Tensor, torch.Tensor]:
        """The payload's block scales and codes, as views."""
        n, block = meta.numel, meta.params["block_size"]
        nb = -(-n // block)
        scales = from_bytes(data, torch.float32, 0, nb)
        return scales, from_bytes(data, cls._code_dtype(), 4 * nb, cls._codes_len(n))

    @classmethod
    def _values(
        cls, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int, fused: bool
    ) -> None:
        """``out`` = each code times its block's scale (through fp32, as the CPU computes it;
        ``fused``: the payload is on the device, where a fused kernel may decode it)."""
        n = out.numel()
        values = out
        if out.dtype != torch.float32:
            values = torch.empty(n, dtype=torch.float32, device=out.device)
        if fused and kernels.usable(values, block):
            kernels.decode_values(codes, scales, values, block, cls.bits)
        else:
            cls._dequantize(codes, scales, values, block)
        if values is not out:
            out.copy_(values)

    @classmethod
    def _check_scales(cls, scales: torch.Tensor, dtype: torch.dtype) -> bool:
        """Raise NonFiniteError for a NaN, Inf, negative or absurd scale (one pass, one read
        back; NaN propagates through both). True when ``dtype`` may not hold every decoded
        value, so the values must be read for Inf."""
        lo, hi = torch.stack(torch.aminmax(scales)).tolist()
        if not (0 <= lo <= hi <= _F32_MAX / 256):  # False for NaN; Inf is above the limit
            raise NonFiniteError(f"{cls.name} payload has a NaN, Inf, negative or absurd scale")
        # No value exceeds the largest scale times the largest code (|-128|, |-8|): when that
        # bound fits the dtype, nothing more is read; else (a float16 out, values that may
        # pass 65504) the values are read once, for any Inf the cast made.
        bound = torch.tensor(hi * (1 << (cls.bits - 1)), dtype=torch.float32)
        return not fits(bound, dtype)

    @classmethod
    def _dequantize(
        cls, codes: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, block: int
    ) -> None:
        """Eager: ``values`` (fp32) = codes times their block's scale, in passes of chunks."""
        n = values.numel()
        full = (n // block) * block
        chunk = max(block, (_chunk_values(values.device) // block) * block)
        for start in range(0, full, chunk):
            stop = min(start + chunk, full)
            part = values[start:stop]
            cls._load(codes, start, part, n)
            part.view(-1, block).mul_(scales[start // block : stop // block, None])
        if full < n:  # the last, partial block: decode a whole (padded) block, keep its head
            tail = torch.empty(block, dtype=torch.float32, device=values.device)
            cls._load(codes, full, tail, n)
            values[full:] = tail[: n - full].mul_(scales[-1])

    # -- storage of the integer codes, per bit width ------------------------------------------

    @staticmethod
    def _code_dtype() -> torch.dtype:
        raise NotImplementedError

    @staticmethod
    def _codes_len(numel: int) -> int:
        raise NotImplementedError

    @staticmethod
    def _store(rounded: torch.Tensor, codes: torch.Tensor) -> None:
        """Write rounded values (floats in [-L, L]) into their slice of the codes."""
        raise NotImplementedError

    @staticmethod
    def _load(codes: torch.Tensor, start: int, out: torch.Tensor, numel: int) -> None:
        raise NotImplementedError


@register
class Int8Blockwise(_BlockwiseAbsmax):
    """8-bit blockwise absmax. ~3.9x smaller than fp32 at the default block of 256 values."""

    name = "int8"
    version = 1
    traits = BUILTIN["int8"]
    bits = 8
    default_block_size = 256

    @staticmethod
    def _code_dtype() -> torch.dtype:
        return torch.int8

    @staticmethod
    def _codes_len(numel: int) -> int:
        return numel

    @staticmethod
    def _store(rounded: torch.Tensor, codes: torch.Tensor) -> None:
        codes.copy_(rounded)

    @staticmethod
    def _load(codes: torch.Tensor, start: int, out: torch.Tensor, numel: int) -> None:
        have = max(0, min(out.numel(), numel - start))
        out[:have].copy_(codes[start : start + have])
        out[have:].zero_()


@register
class Int4Blockwise(_BlockwiseAbsmax):
    """4-bit blockwise absmax, two values per byte. ~7.1x smaller than fp32 at blocks of 64."""

    name = "int4"
    version = 1
    traits = BUILTIN["int4"]
    bits = 4
    default_block_size = 64

    @staticmethod
    def _code_dtype() -> torch.dtype:
        return torch.uint8

    @staticmethod
    def _codes_len(numel: int) -> int:
        return -(-numel // 2)

    @staticmethod
    def _store(rounded: torch.Tensor, codes: torch.Tensor) -> None:
        rounded.add_(8)  # [-7, 7] -> [1, 15]: an unsigned nibble
        codes.copy_(torch.add(rounded[0::2], rounded[1::2], alpha=16))

    @staticmethod
    def _load(codes: torch.Tensor, start: int, out: torch.Tensor, numel: int) -> None:
        have = max(0, min(out.numel() // 2, codes.numel() - start // 2))
        packed = codes[start // 2 : start // 2 + have]
        pairs = out.view(-1, 2)
        pairs[:have, 0].copy_(packed & 15)
        pairs[:have, 1].copy_(packed >> 4)
        pairs[have:].fill_(8)
        out.sub_(8)


def _chunk_values(device: torch.device) -> int:
    """Values per pass: cache-sized on a CPU, large on a GPU (each pass is a few launches)."""
    return _CHUNK_VALUES if device.type == "cpu" else _DEVICE_CHUNK_VALUES


def _check_finite(absmax: torch.Tensor) -> None:
    if not bool(torch.isfinite(absmax).all()):
        raise ValueError("cannot quantize a tensor that contains NaN or Inf")


def _check_block_size(block: int, error: type[Exception]) -> None:
    if (
        not isinstance(block, int)
        or isinstance(block, bool)
        or not 2 <= block <= _MAX_BLOCK
        or block % 2
    ):
        raise error(f"block_size must be an even integer in [2, {_MAX_BLOCK}], got {block!r}")
