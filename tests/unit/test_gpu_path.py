"""The GPU node's pieces that a CPU can check: codecs decoding from a payload held as a tensor
(what a GPU decodes from), the outer step's one-rounding-per-operation arithmetic (the same bits
on any device), batches moved ahead with an exact cursor, MFU, and the inner step.
benchmarks/gpu.py checks the same on a GPU."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from swarmgrad.compression import decode, get_codec
from swarmgrad.compression.base import _REGISTRY
from swarmgrad.compression.buffers import from_bytes
from swarmgrad.node.runspec import ModelSection
from swarmgrad.node.training.device import (
    Prefetched,
    model_flops_utilization,
    peak_flops,
)
from swarmgrad.node.training.model import build_model
from swarmgrad.node.training.outer import OuterOptimizer
from swarmgrad.node.training.step import InnerStep

DEVICE_CODECS = ["none", "fp16", "bf16", "int8", "int4"]


def randn(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", DEVICE_CODECS)
@pytest.mark.parametrize("numel", [1, 255, 4097, 3 * 2**20 + 5])
def test_decoding_from_a_tensor_payload_gives_the_bits_of_decoding_from_bytes(
    name: str, numel: int
) -> None:
    codec = get_codec(name)
    assert type(codec).device_decode
    values = randn(numel, numel) * 3
    payload, meta = codec.encode(values)
    from_host = decode(payload, meta)
    out = torch.full((numel,), math.nan)
    # The payload as the GPU path holds it: a uint8 tensor (here on the CPU), read through views.
    type(codec)._decode_into(from_bytes(payload, torch.uint8).clone(), meta, out)
    assert torch.equal(out, from_host.reshape(-1))
    assert torch.equal(decode(payload, meta, device="cpu"), from_host)


def test_codecs_without_a_device_decoder_say_so() -> None:
    assert not _REGISTRY[("topk", 1)].device_decode
    assert not _REGISTRY[("powersgd", 1)].device_decode


def test_decode_refuses_an_out_of_the_wrong_kind() -> None:
    payload, meta = get_codec("int8").encode(randn(1000, 1))
    with pytest.raises(ValueError, match="contiguous float32 tensor of 1000"):
        decode(payload, meta, out=torch.empty(1000, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous float32 tensor of 1000"):
        decode(payload, meta, out=torch.empty(999))


def test_outer_step_rounds_once_per_operation_like_an_independent_float32_reference() -> None:
    """numpy float32 arithmetic never fuses a multiply and an add: equal bits mean the step has
    no fused operation whose single rounding a GPU (or another CPU) might do differently."""
    n, lr, mu = 100_003, 0.7, 0.9
    theta0 = randn(n, 0)
    opt = OuterOptimizer(theta0, lr=lr, momentum=mu)
    theta, velocity = theta0.numpy().copy(), np.zeros(n, dtype=np.float32)
    f32 = np.float32
    for round_ in range(3):
        averaged = randn(n, round_ + 1) * 1e-2
        opt.step(averaged, own=averaged)
        g = averaged.numpy()
        velocity = velocity * f32(mu) + g
        update = velocity * f32(mu) + g
        theta = theta - update * f32(lr)
    assert np.array_equal(opt.theta.numpy(), theta)
    assert np.array_equal(opt.momentum_buffer.numpy(), velocity)


def test_outer_state_loads_onto_the_optimizers_device_and_saves_to_the_cpu() -> None:
    opt = OuterOptimizer(randn(10, 0), lr=0.5, momentum=0.5)
    opt.step(randn(10, 1), own=randn(10, 1))
    state = opt.state_dict()
    assert all(t.device.type == "cpu" for t in state.values())
    other = OuterOptimizer(torch.zeros(10), lr=0.5, momentum=0.5)
    other.load_state_dict(state)
    assert other.checksum() == opt.checksum()
    state["theta"][0] = 42.0  # a copy: the loaded state does not alias the given one
    assert other.theta[0] != 42.0


def test_prefetched_batches_count_what_was_handed_out_not_what_was_drawn_ahead() -> None:
    drawn = []

    def batches():  # type: ignore[no-untyped-def]
        for i in range(100):
            drawn.append(i)
            yield torch.full((2, 3), i), torch.full((2, 3), i + 1)

    feed = Prefetched(batches(), torch.device("cpu"), cursor=7)
    first, _ = next(feed)
    second, _ = next(feed)
    assert (int(first[0, 0]), int(second[0, 0])) == (0, 1)
    assert feed.cursor == 9  # 7 drawn before, 2 handed out


def test_mfu_is_six_flops_per_parameter_and_token_over_the_peak() -> None:
    assert model_flops_utilization(1_000_000_000, 100_000, 989e12) == pytest.approx(0.6067, 1e-3)
    assert math.isnan(peak_flops(torch.device("cpu")))
    assert peak_flops(torch.device("cpu"), 100) == 100e12  # an explicit peak wins


def test_the_inner_step_trains_and_returns_a_detached_loss() -> None:
    config = ModelSection(vocab_size=64, d_model=16, n_layers=1, n_heads=2, seq_len=8)
    model = build_model(config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = InnerStep(model, optimizer, torch.device("cpu"))
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
    losses = [step(tokens[:, :-1], tokens[:, 1:]) for _ in range(20)]
    assert not losses[0].requires_grad
    assert float(losses[-1]) < float(losses[0])
    assert all(p.grad is None for p in model.parameters())  # stepped and cleared
