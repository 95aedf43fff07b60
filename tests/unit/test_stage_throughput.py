"""What a stage replica announces as its throughput: its samples over its compute seconds, the
first (warm-up) inner step left out, recent steps weighing most."""

from __future__ import annotations

import pytest

from swarmgrad.node.pipeline.throughput import THROUGHPUT_ALPHA, Throughput


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
