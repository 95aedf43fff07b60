"""What the model needs to know about this machine: an inner step's time and the codec's speed,
measured the way ``simulate``'s nodes run (the real model and codec, one torch thread)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from swarmgrad.compression import get_codec
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.training.model import build_model
from swarmgrad.simulations.profiles import SimulationError

#: Larger models are not timed on this CPU: give ``--step-seconds`` (from a GPU's speed).
MAX_MEASURED_PARAMETERS = 50_000_000


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Torch on one thread meanwhile, as ``simulate``'s nodes run (``--threads 1``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
    times = []
    with _one_thread():
        for _ in range(steps + 1):
            started = time.perf_counter()
            model.loss(tokens, tokens).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - started)
    return statistics.median(times[1:])  # the first step pays for allocation


def step_seconds_of(
    summary: dict[str, Any], spec: RunSpec, factors: Mapping[str, float] | None = None
) -> float:
    """Seconds per inner step in a real run, from its summary (compute time over steps). With
    ``factors`` (peer id: its profile's ``compute_factor``), what a step takes at slowdown 1 on
    a whole core, as the model's ``step_seconds`` means: each peer's steps counted at its
    factor."""
    factors = factors or {}
    steps = sum(
        p["samples"] / spec.data.batch_size * factors.get(p["peer_id"], 1.0)
        for p in summary["peers"]
    )
    return float(sum(p["compute_seconds"] for p in summary["peers"]) / steps)


def codec_values_per_second(spec: RunSpec, *, numel: int = 1 << 18, repeats: int = 5) -> float:
    """Values per second the run's codec encodes and decodes (each counted once)."""
    codec = get_codec(spec.averaging.codec, **spec.averaging.codec_options)
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    times = []
    with _one_thread():
        for _ in range(repeats):
            started = time.perf_counter()
            codec.decode(*codec.encode(values))
            times.append(time.perf_counter() - started)
    return 2 * numel / statistics.median(times)
