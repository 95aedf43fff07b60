"""Pipeline stages across peers, as real processes on 127.0.0.1: stage servers holding one span
of the model's layers each, trainers routing microbatches through them.

- parity: 4 stages x 1 replica train exactly like the whole model in one process (fp32 on the
  wire: per step within 1e-5; the default bf16/int8 codecs: the last 10 losses within 1%);
- each stage server holds only its span's parameters;
- a killed replica of a two-replica stage costs a retry and a resend, not the step;
- a stage with no replica fails the trainer's step within its deadline, and training resumes
  when a replica joins;
- a replica three times slower gets at most a quarter of its stage's microbatches.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from swarmgrad.node.runspec import RunSpec
from swarmgrad.simulations.pipeline import (
    PipelineSwarm,
    reference_losses,
    trainer_identity,
    whole_model_bytes,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SPEC = """\
[run]
id = "pipeline-test"

[model]
vocab_size = 2048
d_model = 128
n_layers = 8
n_heads = 4
seq_len = 64

[data]
batch_size = 16

[algorithm]
inner_steps = 1000
inner_lr = 2e-3

[averaging]
group_size = 2
matchmaking_timeout_seconds = 2.0

[pipeline]
stages = 4
microbatches = 4
{codecs}
wait_seconds = {wait}
call_timeout_seconds = 10.0
"""
FP32 = 'activations = "none"\ngradients = "none"'


def _spec(tmp_path: Path, name: str, *, codecs: str = "", wait: float = 30.0) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(SPEC.format(codecs=codecs, wait=wait))
    return path


def _train(spec_path: Path, out: Path, steps: int) -> tuple[dict, list[dict]]:
    with PipelineSwarm(spec_path, out) as swarm:
        for stage in range(4):
            swarm.start_stage(stage)
        swarm.wait_serving()
        swarm.start_trainer(0, "--max-steps", str(steps))
        trainer = swarm.wait_finished("trainer0")
        stages = [m.read() for m in swarm.stages()]
    return trainer, stages


def test_four_stage_processes_train_like_the_whole_model_in_one_process(tmp_path: Path) -> None:
    steps = 50
    spec_path = _spec(tmp_path, "fp32", codecs=FP32)
    spec = RunSpec.load(spec_path)
    trainer, stages = _train(spec_path, tmp_path / "fp32", steps)
    expected = reference_losses(spec, trainer_identity(0, 0).peer_id, steps)
    got = trainer["losses"]
    assert len(got) == steps
    worst = max(abs(a - b) for a, b in zip(got, expected, strict=True))
    assert worst <= 1e-5, (worst, got[:5], expected[:5])
    assert got[-1] < got[0] - 1.0  # it learned
    # Each stage server holds its span alone: together, the whole model once.
    held = [s["parameter_bytes"] for s in stages]
    assert sum(held) == whole_model_bytes(spec)
    assert max(held) < 0.45 * whole_model_bytes(spec)
    for status in stages:
        assert status["stats"]["samples"] == steps * spec.data.batch_size
        assert status["version"] == steps
    # fp32 on the wire: activations (and their gradients) of 4 x 64 x 128 fp32 a microbatch.
    middle = trainer["stages"][1]
    assert middle["bytes_up_per_sample"] == 2 * 64 * 128 * 4  # activations in, gradients in

    # The default codecs (bf16 activations, int8 gradients): the same curve within 1%.
    spec_path = _spec(tmp_path, "default")
    trainer, _ = _train(spec_path, tmp_path / "default", steps)
    got = trainer["losses"]
    last = statistics.fmean(got[-10:])
    assert last == pytest.approx(statistics.fmean(expected[-10:]), rel=0.01)
    compressed = trainer["stages"][1]
    assert compressed["bytes_up_per_sample"] < 0.4 * middle["bytes_up_per_sample"]
