"""Fused GPU kernels for the blockwise codecs (Triton, where it is installed with a CUDA torch).

Eager torch quantizes a GPU part in about six launches (scale, reciprocal, multiply, round, cast,
pack), each a full pass over the part and each costing the host more time than the GPU; the
copy of the payload across PCIe waits behind them. Here one launch per part reads the values
once and writes their block scales and codes: the bytes are the eager path's (and the CPU's) to
the bit, because every step is the same correctly rounded IEEE operation: the scale a true
division, the inverse a true reciprocal times the level count, the product rounded once and then
rounded half to even. One launch likewise decodes the codes times their scales.

A NaN anywhere in a block makes its scale NaN (Triton's max would skip it), an Inf makes it Inf;
the caller checks the scales once, as the eager path does.
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:  # a CUDA torch ships Triton; a CPU-only install (CI, most laptops) has none
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the install
    triton = None

#: Block sizes the kernels take (a block's values are one tile row): larger or odd-sized blocks
#: take the eager path.
MAX_BLOCK = 4096
#: Values per program of the encode: a program quantizes this many values' worth of blocks.
_TILE_ENCODE = 2048
#: Values per program of the decode.
_TILE = 4096
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def usable(tensor: torch.Tensor, block: int) -> bool:
    """Whether the fused kernels can code ``tensor`` (on a GPU, or on the CPU under Triton's
    interpreter) with blocks of ``block`` values."""
    if triton is None or block > MAX_BLOCK:
        return False
    return tensor.device.type == "cuda" or (_INTERPRET and tensor.device.type == "cpu")


def encode_blocks(
    flat: torch.Tensor,
    scales: torch.Tensor,
    codes: torch.Tensor,
    block: int,
    bits: int,
    first: int,
    stop: int,
) -> None:
    """Write the scales and codes of blocks ``first`` .. ``stop - 1`` of the fp32 ``flat`` (its
    last block may be partial: padded with zeros, as the eager path pads it)."""
    count = stop - first
    if count <= 0:
        return
    kernel: Any = _encode_int8 if bits == 8 else _encode_int4
    width = triton.next_power_of_2(block if bits == 8 else block // 2)
    rows = max(1, _TILE_ENCODE // width)
    grid = (triton.cdiv(count, rows),)
    kernel[grid](
        flat,
        scales,
        codes,
        flat.numel(),
        first,
        stop,
        BLOCK=block,
        WIDTH=width,
        ROWS=rows,
        LEVELS=float((1 << (bits - 1)) - 1),
        INTERPRET=_INTERPRET,
    )


def decode_values(
    codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int, bits: int
) -> None:
    """``out`` (fp32, flat) = each code times its block's scale."""
    n = out.numel()
    if not n:
        return
    kernel: Any = _decode_int8 if bits == 8 else _decode_int4
    kernel[(triton.cdiv(n, _TILE),)](codes, scales, out, n, BLOCK=block, TILE=_TILE)


if triton is not None:
    # Triton reads a kernel's annotations (only tl.constexpr may appear there).

    @triton.jit
    def _round_half_even(y, INTERPRET: tl.constexpr):
        if INTERPRET:
            # 1.5 * 2**23: adding it leaves no fraction bits (|y| <= 128 here), and the
            # addition rounds half to even; subtracting it back is exact.
            return (y + 12582912.0) - 12582912.0
        else:
            return libdevice.rint(y)

    @triton.jit
    def _absmax(a, b):
        # Per row: the largest |value| of a and b, NaN if any value is NaN.
        top = tl.maximum(tl.max(tl.abs(a), axis=1), tl.max(tl.abs(b), axis=1))
        nan = tl.max((a != a).to(tl.int32), axis=1) + tl.max((b != b).to(tl.int32), axis=1)
        return tl.where(nan > 0, float("nan"), top)

    @triton.jit
    def _inverse(absmax, LEVELS: tl.constexpr):
        return tl.where(absmax > 0, tl.math.div_rn(1.0, absmax) * LEVELS, 0.0)

    @triton.jit
    def _encode_int8(
        x_ptr,
        scales_ptr,
        codes_ptr,
        n,
        first,
        stop,
        BLOCK: tl.constexpr,
        WIDTH: tl.constexpr,
        ROWS: tl.constexpr,
        LEVELS: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        rows = first + tl.program_id(0) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        cols = tl.arange(0, WIDTH)
        index = rows[:, None] * BLOCK + cols[None, :]
        inside = (rows[:, None] < stop) & (cols[None, :] < BLOCK)
        x = tl.load(x_ptr + index, mask=inside & (index < n), other=0.0)
        absmax = _absmax(x, x)
        tl.store(scales_ptr + rows, tl.math.div_rn(absmax, LEVELS), mask=rows < stop)
        q = _round_half_even(x * _inverse(absmax, LEVELS)[:, None], INTERPRET)
        tl.store(codes_ptr + index, q.to(tl.int8), mask=inside & (index < n))

    @triton.jit
    def _encode_int4(
        x_ptr,
        scales_ptr,
        codes_ptr,
        n,
        first,
        stop,
        BLOCK: tl.constexpr,
        WIDTH: tl.constexpr,
        ROWS: tl.constexpr,
        LEVELS: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        rows = first + tl.program_id(0) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        pairs = tl.arange(0, WIDTH)  # byte j of a block holds values 2j and 2j + 1
        even = rows[:, None] * BLOCK + 2 * pairs[None, :]
        inside = (rows[:, None] < stop) & (pairs[None, :] < BLOCK // 2)
        low = tl.load(x_ptr + even, mask=inside & (even < n), other=0.0)
        high = tl.load(x_ptr + even + 1, mask=inside & (even + 1 < n), other=0.0)
        absmax = _absmax(low, high)
        tl.store(scales_ptr + rows, tl.math.div_rn(absmax, LEVELS), mask=rows < stop)
        inverse = _inverse(absmax, LEVELS)[:, None]
        lo = _round_half_even(low * inverse, INTERPRET) + 8.0
        hi = _round_half_even(high * inverse, INTERPRET) + 8.0
        packed = (lo + hi * 16.0).to(tl.uint8)
        tl.store(codes_ptr + even // 2, packed, mask=inside & (even < n))

    @triton.jit
    def _decode_int8(
        codes_ptr,
        scales_ptr,
        out_ptr,
        n,
        BLOCK: tl.constexpr,
        TILE: tl.constexpr,
    ):
        index = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
        inside = index < n
        code = tl.load(codes_ptr + index, mask=inside, other=0).to(tl.float32)
        scale = tl.load(scales_ptr + index // BLOCK, mask=inside, other=0.0)
        tl.store(out_ptr + index, code * scale, mask=inside)

    @triton.jit
    def _decode_int4(
        codes_ptr,
        scales_ptr,
        out_ptr,
        n,
        BLOCK: tl.constexpr,
        TILE: tl.constexpr,
    ):
        index = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
        inside = index < n
        byte = tl.load(codes_ptr + index // 2, mask=inside, other=0).to(tl.int32)
        nibble = (byte >> ((index % 2) * 4).to(tl.int32)) & 15
        scale = tl.load(scales_ptr + index // BLOCK, mask=inside, other=0.0)
        tl.store(out_ptr + index, (nibble - 8).to(tl.float32) * scale, mask=inside)
