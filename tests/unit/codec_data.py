"""Data and round trips for the codec tests: the codecs every test covers, seeded random
tensors, and one encode-then-decode."""

from __future__ import annotations

import torch

from swarmgrad.compression import Meta, decode, get_codec

ALL = ["none", "fp16", "bf16", "int8", "int4", "topk", "sparse", "powersgd"]


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def roundtrip(name: str, x: torch.Tensor, **options: float) -> tuple[torch.Tensor, bytes, Meta]:
    data, meta = get_codec(name, **options).encode(x)
    assert isinstance(data, bytes)
    return decode(data, meta), data, meta
