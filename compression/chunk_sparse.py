"""Chunked top-k with 2- (or 4-) bit values (``sparse``): for pseudo-gradients on home links.

The vector is cut into chunks of ``chunk`` values; each chunk keeps its ``k`` largest
magnitudes (the last, shorter chunk at most as many as it has). A kept value is sent as a sign and
``bits - 1`` bits of magnitude: the chunk's kept magnitudes span ``[lo, hi]`` (two fp32 numbers
per chunk), cut into ``2**(bits-1)`` evenly spaced levels, each value rounded to the nearest.
Positions within a chunk are sent as gaps (``g_0 = p_0``, ``g_i = p_i - p_(i-1) - 1``) in a Rice
code: each gap's low ``rice`` bits in one fixed-width array, its high part ``g >> rice`` in unary
(that many 1 bits, then a 0) in another stream; the encoder picks the ``rice`` that makes the
message smallest. At a density of 1/64 (64 of 4096) a position costs ~7.5 bits, near the ~7.4 bits
of entropy of a uniformly random 64-subset of 4096, against 12 bits written plainly.

Use it with error feedback, as ``topk``: what a round leaves out (the unkept values and each kept
value's rounding) is carried into the next. At the defaults a message is ~0.29 bits per value,
~110x smaller than fp32 (``int8``: ~4x).

Payload layout (little-endian), for ``c`` chunks and ``m`` kept values in all:
    ``2c`` float32: each chunk's ``lo`` then ``hi``;
    ``ceil(m * bits / 8)`` bytes: each kept value's code (sign bit first, then the level), LSB
    first, in chunk order and, within a chunk, in position order;
    ``ceil(m * rice / 8)`` bytes: each gap's low bits, LSB first;
    ``ceil(unary_bits / 8)`` bytes: the unary stream, LSB first.
Decoding checks every piece before it writes: finite ``0 <= lo <= hi``, exactly ``m`` zeros in the
unary stream's ``unary_bits`` bits (the last of them a zero), and every chunk's last position
inside the chunk. Positions strictly increase by construction, so no position repeats.
"""

from __future__ import annotations

import math

import torch

from swarmgrad.compression.base import (
    Codec,
    CodecError,
    Meta,
    check_finite,
    expect_params,
    register,
)
from swarmgrad.compression.buffers import DTYPES, flat_float32, from_bytes, to_bytes
from swarmgrad.compression.sparse import _pack_bits, _unpack_bits
from swarmgrad.compression.traits import BUILTIN

MAX_CHUNK = 1 << 16
MAX_RICE = 16


@register
class ChunkSparse(Codec):
    """Keep ``ceil(density * chunk)`` values a chunk, each in ``bits`` bits (2 or 4)."""

    name = "sparse"
    version = 1
    traits = BUILTIN["sparse"]

    def __init__(self, density: float = 1 / 64, bits: int = 2, chunk: int = 4096) -> None:
        if float(bits) != int(bits) or float(chunk) != int(chunk):  # a spec's 2.0 is 2
            raise ValueError(f"bits and chunk must be whole numbers, got {bits!r}, {chunk!r}")
        bits, chunk = int(bits), int(chunk)
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        if bits not in (2, 4):
            raise ValueError(f"bits must be 2 or 4, got {bits!r}")
        if not 1 <= chunk <= MAX_CHUNK:
            raise ValueError(f"chunk must be in [1, {MAX_CHUNK}], got {chunk!r}")
        self.bits, self.chunk = bits, chunk
        self.k = min(chunk, max(1, math.ceil(density * chunk)))

    def encode(self, tensor: torch.Tensor) -> tuple[bytes, Meta]:
        flat = flat_float32(tensor)
        n, chunk, k = flat.numel(), self.chunk, self.k
        if n == 0:
            return b"", self._meta(tensor, chunk=chunk, k=k, bits=self.bits, rice=0, unary_bits=0)
        rows, whole = -(-n // chunk), n // chunk
        magnitude = flat.abs()
        # Positions in order within each chunk: the whole chunks as one batch, then the rest.
        pieces = []
        if whole:
            top = torch.topk(magnitude[: whole * chunk].view(whole, chunk), k, dim=1,
                             sorted=False).indices  # fmt: skip
            pieces.append(top.sort(dim=1).values.reshape(-1))
        if whole < rows:
            tail = magnitude[whole * chunk :]
            pieces.append(torch.topk(tail, min(k, tail.numel()), sorted=False).indices.sort()[0])
        local = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        counts = _counts(n, chunk, k)
        starts = torch.repeat_interleave(torch.arange(rows) * chunk, counts)
        positions = starts + local
        values = flat[positions]
        # Levels: each chunk's kept magnitudes, lo..hi, in 2**(bits-1) steps.
        mags = values.abs()
        owner = torch.repeat_interleave(torch.arange(rows), counts)
        lo = torch.full((rows,), math.inf).scatter_reduce(0, owner, mags, "amin")
        hi = torch.zeros(rows).scatter_reduce(0, owner, mags, "amax")
        levels = (1 << (self.bits - 1)) - 1
        span = (hi - lo)[owner]
        step = torch.where(span > 0, span / max(levels, 1), torch.ones_like(span))
        level = ((mags - lo[owner]) / step).round().clamp(0, levels).to(torch.int64)
        codes = ((values < 0).to(torch.int64)) | (level << 1)
        # Gaps within each chunk, Rice-coded with the best parameter for this message.
        first = torch.ones_like(local, dtype=torch.bool)
        first[1:] = owner[1:] != owner[:-1]
        gaps = torch.where(first, local, local - torch.roll(local, 1) - 1)
        rice = _best_rice(gaps)
        high = gaps >> rice
        unary = _unary(high)
        payload = (
            to_bytes(torch.stack([lo, hi], dim=1).reshape(-1))
            + to_bytes(_pack_bits(codes, self.bits))
            + to_bytes(_pack_bits(gaps & ((1 << rice) - 1), rice) if rice else torch.empty(0))
            + to_bytes(unary)
        )
        meta = self._meta(tensor, chunk=chunk, k=k, bits=self.bits, rice=rice,
                          unary_bits=int(high.sum()) + high.numel())  # fmt: skip
        return payload, meta

    @classmethod
    def payload_nbytes(cls, meta: Meta) -> int:
        p = cls._params(meta)
        rows, m = _layout(meta.numel, p["chunk"], p["k"])
        return 8 * rows + _nbytes(m * p["bits"]) + _nbytes(m * p["rice"]) + _nbytes(p["unary_bits"])

    @classmethod
    def _decode(cls, data: bytes | memoryview, meta: Meta) -> torch.Tensor:
        p = cls._params(meta)
        n, chunk, k, bits, rice = meta.numel, p["chunk"], p["k"], p["bits"], p["rice"]
        if n == 0:
            return torch.zeros(meta.shape, dtype=DTYPES[meta.dtype])
        rows, m = _layout(n, chunk, k)
        scales = from_bytes(data, torch.float32, 0, 2 * rows).view(rows, 2)
        check_finite(scales, "sparse scales")
        lo, hi = scales[:, 0], scales[:, 1]
        if bool((lo < 0).any()) or bool((lo > hi).any()):
            raise CodecError("sparse scales must satisfy 0 <= lo <= hi")
        offset = 8 * rows
        packed = from_bytes(data, torch.uint8, offset, _nbytes(m * bits))
        codes = _unpack_bits(packed, m, bits)
        offset += _nbytes(m * bits)
        low = torch.zeros(m, dtype=torch.int64)
        if rice:
            low = _unpack_bits(from_bytes(data, torch.uint8, offset, _nbytes(m * rice)), m, rice)
        offset += _nbytes(m * rice)
        unary = from_bytes(data, torch.uint8, offset, _nbytes(p["unary_bits"]))
        high = _read_unary(unary, p["unary_bits"], m)
        gaps = (high << rice) | low
        counts = _counts(n, chunk, k)
        owner = torch.repeat_interleave(torch.arange(rows), counts)
        # Positions within each chunk: the running sum of (gap + 1) within the chunk, less one.
        steps = torch.cumsum(gaps + 1, 0)
        before = torch.zeros(rows, dtype=torch.int64)
        ends = torch.cumsum(counts, 0)
        before[1:] = steps[ends[:-1] - 1]
        local = steps - before[owner] - 1
        lengths = torch.full((rows,), chunk, dtype=torch.int64)
        lengths[-1] = n - (rows - 1) * chunk
        last = local[ends - 1]
        if bool((last >= lengths).any()):
            raise CodecError("a sparse position lies outside its chunk")
        levels = (1 << (bits - 1)) - 1
        span = (hi - lo)[owner]
        step = torch.where(span > 0, span / max(levels, 1), torch.zeros_like(span))
        mags = lo[owner] + (codes >> 1).to(torch.float32) * step
        values = torch.where((codes & 1).bool(), -mags, mags)
        out = torch.zeros(n, dtype=torch.float32)
        out[owner * chunk + local] = values
        if meta.dtype != "float32":
            check_finite(values, "sparse values", dtype=DTYPES[meta.dtype])
            return out.to(DTYPES[meta.dtype]).reshape(meta.shape)
        return out.reshape(meta.shape)

    @staticmethod
    def _params(meta: Meta) -> dict[str, int]:
        p = expect_params(meta, "chunk", "k", "bits", "rice", "unary_bits")
        if not 1 <= p["chunk"] <= MAX_CHUNK or not 1 <= p["k"] <= p["chunk"]:
            raise CodecError(f"sparse chunk={p['chunk']}, k={p['k']} is impossible")
        if p["bits"] not in (2, 4) or not 0 <= p["rice"] <= MAX_RICE:
            raise CodecError(f"sparse bits={p['bits']}, rice={p['rice']} is impossible")
        _, m = _layout(meta.numel, p["chunk"], p["k"])
        # Each gap is below the chunk: its unary part is at most chunk >> rice ones and a zero.
        if not m <= p["unary_bits"] <= m * ((p["chunk"] >> p["rice"]) + 1):
            raise CodecError(f"sparse unary_bits={p['unary_bits']} is impossible")
        return p


def _counts(n: int, chunk: int, k: int) -> torch.Tensor:
    """Values kept in each chunk: k, the last chunk at most its length."""
    rows = -(-n // chunk)
    counts = torch.full((rows,), k, dtype=torch.int64)
    counts[-1] = min(k, n - (rows - 1) * chunk)
    return counts


def _layout(n: int, chunk: int, k: int) -> tuple[int, int]:
    """(chunks, values kept in all) for ``n`` values."""
    if n == 0:
        return 0, 0
    rows = -(-n // chunk)
    return rows, (rows - 1) * k + min(k, n - (rows - 1) * chunk)


def _nbytes(bits: int) -> int:
    return -(-bits // 8)


def _best_rice(gaps: torch.Tensor) -> int:
    """The Rice parameter that makes the gaps' code shortest (``m * (r + 1) + sum(g >> r)``),
    among the three around the optimum for geometric gaps of their mean."""
    mean = max(1.0, float(gaps.float().mean()))
    guess = max(0, min(MAX_RICE, round(math.log2(mean * math.log(2)))))
    candidates = [r for r in (guess - 1, guess, guess + 1) if 0 <= r <= MAX_RICE]
    sizes = [gaps.numel() * (r + 1) + int((gaps >> r).sum()) for r in candidates]
    return candidates[sizes.index(min(sizes))]


def _unary(high: torch.Tensor) -> torch.Tensor:
    """``high[i]`` ones then a zero, for each i, as bytes (LSB first)."""
    stream = torch.ones(int(high.sum()) + high.numel(), dtype=torch.int64)
    stream[torch.cumsum(high + 1, 0) - 1] = 0
    return _pack_bits(stream, 1)


def _read_unary(packed: torch.Tensor, nbits: int, count: int) -> torch.Tensor:
    """The ``count`` numbers of a unary stream of ``nbits`` bits; CodecError unless it holds
    exactly ``count`` of them and nothing after the last."""
    stream = _unpack_bits(packed, nbits, 1)
    zeros = (stream == 0).nonzero().squeeze(1)
    if zeros.numel() != count or (count and int(zeros[-1]) != nbits - 1):
        raise CodecError(f"the sparse unary stream does not hold exactly {count} gaps")
    return torch.diff(zeros, prepend=torch.tensor([-1])) - 1
