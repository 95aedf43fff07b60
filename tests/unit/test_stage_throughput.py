"""What a stage replica announces as its throughput: its samples over its compute seconds, the
first (warm-up) inner step left out, recent steps weighing most."""

from __future__ import annotations

import time

import pytest
import torch

from swarmgrad.node.pipeline.model import build_stage
from swarmgrad.node.pipeline.throughput import THROUGHPUT_ALPHA, Throughput
from swarmgrad.node.pipeline.worker import StageWorker
from swarmgrad.node.runspec import RunSpec
from swarmgrad.protocol.stage import Microbatch


def test_the_warm_up_step_is_left_out_and_a_slowdown_shows_within_a_few_steps() -> None:
    rate = Throughput()
    rate.work(16, 10.0)  # the first step: slow, warming up
    rate.step()
    assert rate.samples_per_second == 0.0
    for _ in range(2):  # two microbatches a step
        rate.work(8, 0.25)
    rate.step()
    assert rate.samples_per_second == 32.0
    rate.work(16, 1.0)  # the replica's GPU now shared: 16 samples/s
    rate.step()
    assert rate.samples_per_second == pytest.approx(
        THROUGHPUT_ALPHA * 16 + (1 - THROUGHPUT_ALPHA) * 32
    )
    for _ in range(10):
        rate.work(16, 1.0)
        rate.step()
    assert rate.samples_per_second == pytest.approx(16.0, rel=0.05)
    rate.step()  # a step with no compute measured leaves the rate as it was
    assert rate.samples_per_second == pytest.approx(16.0, rel=0.05)


async def test_a_stage_replica_counts_its_forwards_in_its_throughput() -> None:
    # A non-last stage computes each microbatch's forward, then again in its backward. Timing
    # the backward alone put such a stage about a third above what it serves. Here its forward
    # (the one without gradients) is made to take 50 ms: two microbatches of 4 samples a step,
    # so the rate cannot be above 8 / 0.1 s.
    spec = RunSpec.from_toml(
        '[run]\nid = "rate"\n[model]\nvocab_size = 64\nd_model = 16\nn_layers = 2\nn_heads = 2\n'
        "seq_len = 8\n[data]\nbatch_size = 8\n[pipeline]\nstages = 2\nmicrobatches = 2\n"
    )
    worker = StageWorker(build_stage(spec.model, spec.pipeline, 0, seed=0), spec, peer_id="x")
    computed = worker.module.forward

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            time.sleep(0.05)
        return computed(inputs)

    worker.module.forward = forward  # type: ignore[method-assign]
    try:
        for step in range(2):  # the first step is left out (warm-up)
            for index in range(2):
                mb = Microbatch("trainer", step, index, 0)
                seeded = torch.Generator().manual_seed(index)
                tokens = torch.randint(0, 64, (4, 8), generator=seeded)
                out = await worker.forward(mb, tokens)
                assert out.tensor is not None
                await worker.backward(mb, out.version, torch.ones_like(out.tensor), None)
    finally:
        worker.close()
    assert worker.version == 2
    assert 0 < worker.samples_per_second < 8 / 0.1
