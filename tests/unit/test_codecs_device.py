"""The dense codecs' device path: payload parts reported as they are final, and (where a GPU is
at hand) encoding on it and decoding onto it give the CPU's bytes and bits."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from swarmgrad.compression import NonFiniteError, decode, get_codec, quantization
from swarmgrad.compression.base import DevicePayloadCodec
from swarmgrad.compression.buffers import STAGE_BYTES, to_device

DENSE = ["none", "fp16", "bf16", "int8", "int4"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def _values(numel: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator) * torch.logspace(-3, 2, numel)


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "int4"])
@pytest.mark.parametrize("numel", [3, 1000, (1 << 20) * 3 + 77, (1 << 22) + 5])
def test_reported_parts_cover_the_payload_once_and_are_final_when_reported(
    name: str, numel: int
) -> None:
    codec = get_codec(name)
    assert isinstance(codec, DevicePayloadCodec)
    tensor = _values(numel)
    copied: list[tuple[int, int, bytes]] = []

    def ready(payload: torch.Tensor, start: int, stop: int) -> None:
        copied.append((start, stop, payload[start:stop].numpy().tobytes()))

    payload, meta = codec._payload(tensor, ready)
    expected, expected_meta = codec.encode(tensor)
    assert meta == expected_meta
    assert payload.numpy().tobytes() == expected
    # Every byte reported exactly once, and what was there when reported is what was sent.
    covered = bytearray(len(expected))
    for start, stop, part in copied:
        assert covered[start:stop] == bytes(stop - start), "a byte reported twice"
        covered[start:stop] = part
    assert bytes(covered) == expected
    assert sum(stop - start for start, stop, _ in copied) == len(expected)


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("numel", [3, 64 * 5, (1 << 14) * 5 + 77])
def test_the_gpus_two_pass_encoding_gives_the_cpus_bytes(
    name: str, numel: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's encoding path (scales in one pass, codes in parts), run here on the CPU."""
    monkeypatch.setattr(quantization, "_DEVICE_PART_VALUES", 1 << 14)  # several parts
    codec = get_codec(name)
    tensor = _values(numel, seed=numel)
    expected, _ = codec.encode(tensor)
    payload = torch.empty(len(expected), dtype=torch.uint8)
    reported: list[tuple[int, int]] = []
    codec._encode_in_passes(tensor, payload, lambda _p, start, stop: reported.append((start, stop)))
    assert payload.numpy().tobytes() == expected
    assert sum(stop - start for start, stop in reported) == len(expected)
    full = numel // codec.block_size * codec.block_size
    # The scales, then each part of whole blocks, then the padded last block if any.
    assert len(reported) == 1 + -(-full // (1 << 14)) + (full < numel)
    tensor[numel // 2] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec._encode_in_passes(tensor, payload, None)


def test_quantizing_nan_raises_after_the_parts_before_it_were_reported() -> None:
    tensor = _values((1 << 20) * 2)
    tensor[(1 << 20) + 3] = float("nan")
    reported: list[int] = []
    with pytest.raises(ValueError, match="NaN or Inf"):
        get_codec("int8")._payload(tensor, lambda _p, start, _s: reported.append(start))
    assert reported, "the first chunk was reported before the second's NaN was found"


@cuda
@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize("numel", [1, 4097, (1 << 23) * 2 + 333])
def test_gpu_encode_and_decode_match_the_cpu_bit_for_bit(name: str, numel: int) -> None:
    codec = get_codec(name)
    host = _values(numel, seed=numel)
    on_gpu = host.cuda()
    wire, meta = codec.encode_view(on_gpu)
    expected, expected_meta = codec.encode(host)
    assert meta == expected_meta
    assert bytes(wire) == expected
    # Decoded from pageable bytes (as received) and from the pinned view, onto the GPU.
    cpu_values = decode(expected, meta)
    for source in (expected, wire):
        assert torch.equal(decode(source, meta, device="cuda").cpu(), cpu_values)
    out = torch.empty(numel, device="cuda")
    decode(expected, meta, out=out)
    assert torch.equal(out.cpu(), cpu_values.reshape(-1))


@cuda
@pytest.mark.parametrize("name", ["none", "fp16", "bf16"])
def test_gpu_decode_refuses_a_nan_in_any_staged_part_and_float16_overflow(name: str) -> None:
    numel = STAGE_BYTES  # 2-4 staged parts of payload
    codec = get_codec(name)
    payload, meta = codec.encode(_values(numel))
    wire = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
    nan = torch.tensor([math.nan], dtype=wire).view(torch.uint8).numpy().tobytes()
    for index in (5, numel - 3):  # in the first part, in the last
        bad = bytearray(payload)
        bad[index * wire.itemsize : (index + 1) * wire.itemsize] = nan
        with pytest.raises(NonFiniteError, match="NaN or Inf"):
            decode(bytes(bad), meta, device="cuda")
    if name == "bf16":  # 65536 is a bfloat16 value; as float16 it is Inf: refused
        values = torch.full((numel,), 1.0, dtype=torch.bfloat16)
        values[-1] = 65536.0
        half_meta = get_codec("bf16").encode(torch.ones(numel, dtype=torch.float16))[1]
        with pytest.raises(NonFiniteError, match="float16"):
            decode(values.view(torch.uint8).numpy().tobytes(), half_meta, device="cuda")
    assert torch.equal(decode(payload, meta, device="cuda").cpu(), decode(payload, meta))


@cuda
def test_staged_copies_to_the_gpu_are_exact_back_to_back() -> None:
    generator = torch.Generator().manual_seed(3)
    blobs = [
        torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).numpy().tobytes()
        for size in (1, STAGE_BYTES - 1, STAGE_BYTES * 3 + 17, 5 * STAGE_BYTES)
    ]
    copies = [to_device(blob, torch.device("cuda")) for blob in blobs]  # no wait in between
    for blob, copy in zip(blobs, copies, strict=True):
        assert copy.cpu().numpy().tobytes() == blob


@cuda
def test_gpu_encode_of_nan_raises_and_the_next_encode_is_right() -> None:
    bad = _values((1 << 22) * 2).cuda()
    bad[-5] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        get_codec("int8").encode_view(bad)
    good = _values(1 << 22, seed=9)
    wire, _ = get_codec("int8").encode_view(good.cuda())
    assert bytes(wire) == get_codec("int8").encode(good)[0]


@cuda
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_gpu_decode_refuses_bad_scales_and_float16_overflow_from_received_bytes(name: str) -> None:
    codec = get_codec(name)
    payload, meta = codec.encode(_values(5000))
    for scale in (math.nan, math.inf, -1.0):
        bad = bytearray(payload)
        bad[4:8] = struct.pack("<f", scale)  # the second block's scale
        with pytest.raises(NonFiniteError, match="scale"):
            decode(bytes(bad), meta, device="cuda")
    # A float16 tensor's payload whose scale makes a value pass 65504: Inf once cast, refused.
    half, half_meta = codec.encode(torch.full((300,), 60000.0, dtype=torch.float16))
    big = bytearray(half)
    big[0:4] = struct.pack("<f", 1e6)
    with pytest.raises(NonFiniteError, match="float16"):
        decode(bytes(big), half_meta, device="cuda")
    assert torch.equal(
        decode(half, half_meta, device="cuda").cpu(), decode(half, half_meta)
    )  # in range: decoded as the CPU does
