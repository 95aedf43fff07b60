"""The ``sparse`` codec (chunked top-k, 2- or 4-bit values, Rice-coded positions): it keeps each
chunk's largest magnitudes, its positions cost near their entropy, error feedback recovers what
it leaves out, and every hostile payload is refused before it is written anywhere. (The generic
contract, shapes and dtypes: test_codecs.py; lengths: test_codec_payloads.py.)"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from swarmgrad.compression import CodecError, ErrorFeedback, Meta, decode, get_codec


def _x(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [1, 63, 4096, 4097, 3 * 4096 + 5])
def test_each_chunk_keeps_its_largest_magnitudes_with_their_signs(n: int) -> None:
    x = _x(n)
    data, meta = get_codec("sparse").encode(x)
    y = decode(data, meta)
    for start in range(0, n, 4096):
        chunk, got = x[start : start + 4096], y[start : start + 4096]
        k = min(64, chunk.numel())
        expected = chunk.abs().topk(k).indices.sort().values
        assert torch.equal(got.nonzero().squeeze(1), expected)
        assert torch.equal(got[expected].sign(), chunk[expected].sign())
        # 2 bits: a sign and one of two levels, the chunk's smallest and largest kept magnitude.
        kept = chunk[expected].abs()
        assert set(got[expected].abs().tolist()) <= {kept.min().item(), kept.max().item()}


def test_four_bits_are_closer_than_two() -> None:
    x = _x(1 << 16)

    def error(bits: int) -> float:
        y = decode(*get_codec("sparse", bits=bits).encode(x))
        kept = y != 0
        return float((x[kept] - y[kept]).abs().mean())

    assert error(4) < error(2) / 3


def test_positions_cost_near_their_entropy() -> None:
    n, k, chunk = 1 << 20, 64, 4096
    data, meta = get_codec("sparse").encode(_x(n))
    m = n // chunk * k
    position_bits = (meta.params["unary_bits"] + m * meta.params["rice"]) / m
    entropy = math.log2(math.comb(chunk, k)) / k  # a uniformly random k-subset of a chunk
    assert position_bits < entropy + 0.6, (position_bits, entropy)
    assert position_bits < 12 - 4  # against writing each within-chunk position plainly
    # The whole message: ~2 bits a value, its position, two scales a chunk: > 150x under fp32.
    assert n * 4 / len(data) > 150


def test_error_feedback_delivers_what_one_message_leaves_out() -> None:
    """A constant signal sent every step: with feedback, what arrives over the steps adds up to
    what was sent (within one step's residual), though each message keeps 1 value in 64."""
    x = _x(8192)
    fed = ErrorFeedback(get_codec("sparse"))
    arrived = torch.zeros_like(x)
    steps = 200
    for _ in range(steps):
        arrived += decode(*fed.encode(x))
    assert float((arrived / steps - x).abs().max()) < 0.1 * float(x.abs().max())


def _payload(n: int = 10_000) -> tuple[bytearray, Meta]:
    data, meta = get_codec("sparse").encode(_x(n))
    return bytearray(data), meta


def test_bad_scales_are_refused() -> None:
    for lo, hi in ((math.nan, 1.0), (0.0, math.inf), (-1.0, 1.0), (2.0, 1.0)):
        data, meta = _payload()
        data[0:8] = torch.tensor([lo, hi], dtype=torch.float32).numpy().tobytes()
        with pytest.raises(CodecError):
            decode(bytes(data), meta)


def test_a_unary_stream_with_a_gap_too_many_or_too_few_is_refused() -> None:
    data, meta = _payload()
    flipped = bytearray(data)
    flipped[-1] ^= 0x01  # the stream's first bit of its last byte: a 1 made 0 or a 0 made 1
    with pytest.raises(CodecError, match="unary stream"):
        decode(bytes(flipped), meta)
    longer = dataclasses.replace(meta, params={**meta.params, "unary_bits": 8 * len(data)})
    with pytest.raises(CodecError):
        decode(bytes(data), longer)


def test_a_position_past_its_chunk_is_refused() -> None:
    x = _x(4096)
    x[4095] = 100.0  # kept, at the chunk's last position
    data, meta = get_codec("sparse").encode(x)
    # The same layout (one chunk, 64 kept) claimed for 4000 values: position 4095 is outside.
    with pytest.raises(CodecError, match="outside its chunk"):
        decode(data, dataclasses.replace(meta, shape=(4000,)))


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"chunk": 0}, "impossible"),
        ({"k": 5000}, "impossible"),
        ({"bits": 3}, "impossible"),
        ({"rice": 40}, "impossible"),
        ({"unary_bits": 1}, "impossible"),
    ],
)
def test_impossible_parameters_are_refused_before_anything_is_read(
    params: dict[str, int], match: str
) -> None:
    data, meta = _payload()
    with pytest.raises(CodecError, match=match):
        decode(data, dataclasses.replace(meta, params={**meta.params, **params}))


def test_options_outside_their_range_are_refused_when_the_codec_is_built() -> None:
    for options in ({"density": 0.0}, {"bits": 8}, {"chunk": 0}, {"chunk": 1 << 20}):
        with pytest.raises(ValueError, match="must be"):
            get_codec("sparse", **options)
