"""Hostile codec payloads: truncated, padded, mislabelled or corrupt bytes and metadata are
refused with a CodecError (never a crash, an Inf or a NaN), and what a small payload may expand
to is capped."""

from __future__ import annotations

import dataclasses
import math
import struct

import pytest
import torch

from swarmgrad.compression import CodecError, Meta, decode, get_codec
from tests.unit.codec_data import ALL, randn, roundtrip


def encoded(name: str, n: int = 1000, **options: float) -> tuple[bytes, Meta]:
    return get_codec(name, **options).encode(randn(n, seed=19))


@pytest.mark.parametrize("name", ALL)
def test_truncated_or_padded_payload_is_rejected(name: str) -> None:
    data, meta = encoded(name)
    with pytest.raises(CodecError, match="must be"):
        decode(data[:-1], meta)
    with pytest.raises(CodecError, match="must be"):
        decode(data + b"\0", meta)
    with pytest.raises(CodecError, match="must be"):
        decode(b"", meta)


@pytest.mark.parametrize("name", [n for n in ALL if n not in ("topk", "sparse")])
def test_wrong_length_for_the_claimed_shape_is_rejected(name: str) -> None:
    # (A top-k payload's length does not depend on the shape (a sparse one's, only on its
    # number of chunks); receivers check shapes against
    # their run spec before decoding, and decode bounds every position by the claimed shape.)
    data, meta = encoded(name)
    with pytest.raises(CodecError):
        decode(data, dataclasses.replace(meta, shape=(2000,)))


def test_unknown_codec_or_version_is_rejected() -> None:
    data, meta = encoded("int8")
    with pytest.raises(CodecError, match="unknown codec 'int9'"):
        decode(data, dataclasses.replace(meta, codec="int9"))
    with pytest.raises(CodecError, match="no version 2"):
        decode(data, dataclasses.replace(meta, version=2))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("dtype", "int32", "unsupported dtype"),
        ("shape", (-1, 5), "bad shape"),
        ("shape", (1,) * 9, "bad shape"),
        ("shape", (2**63 - 1, 0), "bad shape"),  # no elements, yet torch cannot make it
        ("shape", (1 << 20, 1 << 20), "more than"),
        ("params", {"block_size": 256, "evil": 1}, "expects parameters"),
        ("params", {}, "expects parameters"),
        ("params", {"block_size": 3}, "block_size must be"),
        ("params", {"block_size": 0}, "block_size must be"),
        ("params", {"block_size": 1.5}, "must be an integer"),
    ],
)
def test_bad_metadata_is_rejected(field: str, value: object, match: str) -> None:
    data, meta = encoded("int8")
    with pytest.raises(CodecError, match=match):
        decode(data, dataclasses.replace(meta, **{field: value}))


def test_max_numel_caps_what_a_small_payload_may_expand_to() -> None:
    data, meta = encoded("topk", n=100_000)
    with pytest.raises(CodecError, match="more than 50000"):
        decode(data, meta, max_numel=50_000)
    assert decode(data, meta, max_numel=100_000).numel() == 100_000


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("bad_scale", [math.nan, math.inf, -1.0, 3e38])
def test_nan_inf_negative_or_absurd_scale_is_rejected(name: str, bad_scale: float) -> None:
    data, meta = encoded(name)
    corrupt = struct.pack("<f", bad_scale) + data[4:]
    with pytest.raises(CodecError, match="scale"):
        decode(corrupt, meta)


def test_topk_with_nan_value_scale_is_rejected() -> None:
    data, meta = encoded("topk")
    with pytest.raises(CodecError, match="scale"):
        decode(struct.pack("<f", math.nan) + data[4:], meta)


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "powersgd"])
def test_nan_or_inf_values_in_float_payloads_are_rejected(name: str) -> None:
    data, meta = encoded(name)
    nan = {
        "none": struct.pack("<f", math.nan),
        "fp16": struct.pack("<e", math.inf),
        "bf16": b"\xc0\x7f",  # bfloat16 NaN
        "powersgd": struct.pack("<f", math.nan),
    }[name]
    with pytest.raises(CodecError, match="NaN or Inf"):
        decode(data[:8] + nan + data[8 + len(nan) :], meta)


def test_powersgd_factors_whose_product_overflows_are_rejected() -> None:
    _data, meta = encoded("powersgd", rank=1)
    huge = struct.pack("<f", 1e30)
    rows, cols = meta.params["rows"], meta.params["cols"]
    corrupt = huge * rows + huge * cols
    with pytest.raises(CodecError, match="NaN or Inf"):
        decode(corrupt, meta)


@pytest.mark.parametrize("name", ["int8", "int4", "topk", "powersgd", "bf16"])
def test_values_beyond_the_declared_float16_range_are_rejected_not_decoded_to_inf(
    name: str,
) -> None:
    # Finite on the wire (fp32 scales and factors, bf16 values), Inf once cast to float16.
    data, meta = get_codec(name).encode(torch.full((64,), 1e6))
    as_float16 = dataclasses.replace(meta, dtype="float16")
    with pytest.raises(CodecError, match=r"NaN or Inf|overflows float16"):
        decode(data, as_float16)
    with pytest.raises(CodecError, match=r"NaN or Inf|overflows float16"):
        decode(data, as_float16, out=torch.empty(64, dtype=torch.float16))


def test_float16_tensors_at_the_edge_of_their_range_still_come_back_finite() -> None:
    # bf16 rounds 65504 up to 65536 (Inf in float16); the quantizers' cheap bound on their
    # scales overshoots here, so their exact check must not refuse an honest payload.
    limit = torch.finfo(torch.float16).max
    x = torch.tensor([limit, -limit, 65400.0, 1.0] * 16, dtype=torch.float16)
    for name in ["bf16", "int8", "int4", "topk", "powersgd"]:
        y, _, _ = roundtrip(name, x)
        assert y.dtype == torch.float16
        assert torch.isfinite(y).all(), name


def test_topk_positions_outside_the_tensor_are_rejected() -> None:
    data, meta = encoded("topk", n=1000, fraction=0.01)  # k=10
    bits = meta.params["index_bits"]
    values_len = len(data) - math.ceil(10 * bits / 8)
    # All-ones gaps: the positions run far past the end of a 1000-value tensor.
    corrupt = data[:values_len] + b"\xff" * (len(data) - values_len)
    with pytest.raises(CodecError, match="outside"):
        decode(corrupt, meta)


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [
        ("topk", {"k": 5000, "index_bits": 10}, "impossible"),
        ("topk", {"k": 0, "index_bits": 10}, "impossible"),
        ("topk", {"k": 10, "index_bits": 40}, "index_bits"),
        ("powersgd", {"rows": 10, "cols": 100, "rank": 4}, "does not fit"),
        ("powersgd", {"rows": 32, "cols": 32, "rank": 40}, "impossible"),
    ],
)
def test_impossible_sparse_and_low_rank_parameters_are_rejected(
    name: str, params: dict[str, int], match: str
) -> None:
    data, meta = encoded(name)
    with pytest.raises(CodecError, match=match):
        decode(data, dataclasses.replace(meta, params=params))


def test_random_garbage_never_crashes_decode() -> None:
    # Bytes of the right length but random content: either a clean CodecError or a finite
    # tensor of the claimed shape, never a crash or NaN.
    g = torch.Generator().manual_seed(20)
    for name in ALL:
        data, meta = encoded(name, n=777)
        for _ in range(50):
            noise = torch.randint(0, 256, (len(data),), generator=g, dtype=torch.uint8)
            try:
                y = decode(noise.numpy().tobytes(), meta)
            except CodecError:
                continue
            assert y.shape == (777,)
            assert torch.isfinite(y).all()
