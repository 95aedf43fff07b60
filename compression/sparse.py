"""Top-k sparsification (``topk``): the k largest-magnitude values, 8-bit quantized, and their
positions as bit-packed gaps.

Use it with error feedback: what one round leaves out is carried into the next, so small
coordinates are delayed, not lost (:class:`~swarmgrad.compression.feedback.ErrorFeedback` for a
stream of tensors; in a node, the all-reduce reports what was sent and the trainer carries it).

Aggregation: an owner in the all-reduce decodes each member's sparse slice into a dense fp32
accumulator, then re-encodes the *average* with the same k before sending it back. Every member
downloads one k-sparse message per slice, whatever the group size, at the cost of the owner's
top-k of the sum being one more lossy step (which the members' error feedback does not see; the
owner's residual is not kept, by design: owners change every round).

Payload layout (little-endian):
    the ``int8`` codec's payload for the k values (``block_size`` values per scale), then
    ``ceil(k * index_bits / 8)`` bytes of bit-packed gaps: sorted positions p_0 < p_1 < ... are
    sent as g_0 = p_0 and g_i = p_i - p_(i-1) - 1, each in ``index_bits`` bits, least
    significant bit first.
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
from swarmgrad.compression.quantization import Int8Blockwise
from swarmgrad.compression.traits import BUILTIN

_VALUE_BLOCK = 256
_PREFILTER_MIN_NUMEL = 1 << 16
_PREFILTER_SAMPLE = 1 << 16


@register
class TopK(Codec):
    """Keep ``ceil(fraction * numel)`` values (at least one). Default fraction 1%: ~150x smaller."""

    name = "topk"
    version = 1
    traits = BUILTIN["topk"]

    def __init__(self, fraction: float = 0.01) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
        self.fraction = fraction

    def encode(self, tensor: torch.Tensor) -> tuple[bytes, Meta]:
        flat = flat_float32(tensor)
        n = flat.numel()
        k = min(n, max(1, math.ceil(self.fraction * n))) if n else 0
        positions = _top_positions(flat, k)
        gaps = positions.diff(prepend=torch.tensor([-1])) - 1
        bits = max(1, int(gaps.max()).bit_length()) if k else 1
        values, _ = Int8Blockwise(_VALUE_BLOCK).encode(flat[positions])
        meta = self._meta(tensor, k=k, index_bits=bits)
        return values + to_bytes(_pack_bits(gaps, bits)), meta

    @classmethod
    def payload_nbytes(cls, meta: Meta) -> int:
        k, bits = cls._params(meta)
        return Int8Blockwise.payload_nbytes(_values_meta(k)) + -(-k * bits // 8)

    @classmethod
    def _decode(cls, data: bytes | memoryview, meta: Meta) -> torch.Tensor:
        k, bits = cls._params(meta)
        n = meta.numel
        values_meta = _values_meta(k)
        split = Int8Blockwise.payload_nbytes(values_meta)
        values = Int8Blockwise._decode(data[:split], values_meta)
        if k == 0:
            return torch.zeros(meta.shape, dtype=DTYPES[meta.dtype])
        gaps = _unpack_bits(from_bytes(data, torch.uint8, split), k, bits)
        positions = torch.cumsum(gaps + 1, 0) - 1
        if int(positions[-1]) >= n:
            raise CodecError(f"topk position {int(positions[-1])} is outside {n} values")
        out = torch.zeros(n, dtype=torch.float32)
        out[positions] = values
        if meta.dtype != "float32":
            # The k values, not the dense result: fp32 values a float16 cast would make Inf.
            check_finite(values, "topk values", dtype=DTYPES[meta.dtype])
            out = out.to(DTYPES[meta.dtype])
        return out.reshape(meta.shape)

    @staticmethod
    def _params(meta: Meta) -> tuple[int, int]:
        params = expect_params(meta, "k", "index_bits")
        k, bits = params["k"], params["index_bits"]
        if not 0 <= k <= meta.numel or (meta.numel and k == 0):
            raise CodecError(f"topk k={k} is impossible for {meta.numel} values")
        if not 1 <= bits <= 32:
            raise CodecError(f"topk index_bits must be in [1, 32], got {bits}")
        return k, bits


def _top_positions(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted positions of the k largest magnitudes: exact, deterministic, ~4x faster than topk.

    A strided sample estimates a threshold a little below the k-th largest magnitude; only the
    values above it go through topk. If fewer than k pass (the sample misjudged the data), the
    full topk runs instead, so the answer is always the exact top k.
    """
    n = flat.numel()
    if k == n:
        return torch.arange(n)
    magnitude = flat.abs()
    if n >= _PREFILTER_MIN_NUMEL and 4 * k <= n:
        sample = magnitude[:: n // _PREFILTER_SAMPLE]
        keep = min(sample.numel(), int(1.3 * sample.numel() * k / n) + 16)
        threshold = torch.kthvalue(sample, sample.numel() - keep + 1).values
        candidates = (magnitude >= threshold).nonzero().squeeze(1)
        if candidates.numel() >= k:  # then every top-k value is >= threshold: exact
            chosen = torch.topk(magnitude[candidates], k, sorted=False).indices
            return candidates[chosen].sort().values
    return torch.topk(magnitude, k, sorted=False).indices.sort().values


def _values_meta(k: int) -> Meta:
    return Meta(
        codec=Int8Blockwise.name,
        version=Int8Blockwise.version,
        shape=(k,),
        dtype="float32",
        params={"block_size": _VALUE_BLOCK},
    )


def _pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integers < 2**bits into bytes, LSB first, with no padding between."""
    if values.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    shifts = torch.arange(bits, dtype=torch.int64)
    stream = ((values.to(torch.int64)[:, None] >> shifts) & 1).to(torch.uint8).reshape(-1)
    stream = torch.nn.functional.pad(stream, (0, -stream.numel() % 8))
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return (stream.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8)
    stream = ((packed[:, None] >> shifts) & 1).reshape(-1)[: count * bits]
    weights = torch.ones(bits, dtype=torch.int64) << torch.arange(bits, dtype=torch.int64)
    return (stream.view(count, bits).to(torch.int64) * weights).sum(dim=1)
