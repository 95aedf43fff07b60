"""What the model needs to know about this machine: an inner step's time and the codec's speed,
measured the way ``simulate``'s nodes run (the real model and codec, one torch thread)."""

from __future__ import annotations

import statistics
import time

import torch

from swarmgrad.compression import get_codec
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.training.model import build_model
from swarmgrad.simulations.profiles import SimulationError

#: Larger models are not timed on this CPU: give ``--step-seconds`` (from a GPU's speed).
MAX_MEASURED_PARAMETERS = 50_000_000


def _one_thread() -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads


def step_seconds(spec: RunSpec, *, steps: int = 6) -> float:
    """Median seconds of one inner step (forward, backward, AdamW) of the run's model."""
    model = build_model(spec.model, seed=0)
    count = sum(p.numel() for p in model.parameters())
    if count > MAX_MEASURED_PARAMETERS:
        raise SimulationError(
            f"the model has {count:,} parameters: too large to time on this CPU; give "
            f"--step-seconds (one inner step's time on the peers' hardware)"
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shape = (spec.data.batch_size, spec.model.seq_len)
    tokens = torch.randint(0, spec.model.vocab_size, shape, generator=torch.Generator())
    threads = _one_thread()
    try:
        times = []
        for _ in range(steps + 1):
            started = time.perf_counter()
            model.loss(tokens, tokens).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times[1:])  # the first step pays for allocation


def codec_values_per_second(spec: RunSpec, *, numel: int = 1 << 18, repeats: int = 5) -> float:
    """Values per second the run's codec encodes and decodes (each counted once)."""
    codec = get_codec(spec.averaging.codec)
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    threads = _one_thread()
    try:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            codec.decode(*codec.encode(values))
            times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return 2 * numel / statistics.median(times)
