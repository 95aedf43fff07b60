"""Rates and totals across a restart (no sockets): a node that resumes from its checkpoint shows
and announces what this process trains per second, not its lifetime total over this process's
seconds, and its totals (steps, tokens, bytes, compute seconds) never go down. Its status file is
strict JSON (null, not NaN, where a number is not known)."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from swarmgrad.compression import get_codec
from swarmgrad.node.config import CommandLine, node_config
from swarmgrad.node.files import jsonable
from swarmgrad.node.main import write_status
from swarmgrad.node.metrics import NodeMetrics
from swarmgrad.node.runspec import ModelSection, RunSpec
from swarmgrad.node.state.checkpoint import Checkpointer
from swarmgrad.node.status import read_scores, scores_table
from swarmgrad.node.training import replica as replica_module
from swarmgrad.node.training import trainer as trainer_module
from swarmgrad.node.training.api import DiLoCo
from swarmgrad.node.training.model import build_model
from swarmgrad.node.training.progress import Progress
from swarmgrad.node.training.trainer import Trainer
from tests.unit.test_node_parts import fake_sdist

SPEC = """\
[run]
id = "rates"
[model]
vocab_size = 512
d_model = 16
n_layers = 1
n_heads = 2
seq_len = 16
[data]
source = "demo"
batch_size = 4
[algorithm]
name = "diloco"
inner_steps = 1000
[node]
device = "cpu"
threads = 1
peak_tflops = 1
"""
TOKENS_PER_STEP = 4 * 16  # batch_size x seq_len
SWARM_SENT, SWARM_RECEIVED = 1000, 3000  # what each process's swarm counts (from zero)


class Clock:
    """Monotonic time that moves only when told: a training step takes one second."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    fake_time = SimpleNamespace(monotonic=clock.monotonic, sleep=lambda seconds: None)
    for module in (trainer_module, replica_module):
        monkeypatch.setattr(module, "time", fake_time)
    step = trainer_module.InnerStep.__call__

    def one_second(self: Any, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        clock.now += 1.0
        return step(self, inputs, targets)

    monkeypatch.setattr(trainer_module.InnerStep, "__call__", one_second)
    return clock


def _swarm(spec: RunSpec) -> Any:
    """One process's swarm, alone: no donors, no rounds; it records what it announces."""
    swarm = SimpleNamespace(
        peer_id="node-a",
        spec=spec,
        codec=get_codec("int8"),
        codec_is_lossless=False,
        owner_feedback=False,
        metrics=NodeMetrics(
            peer_id="node-a", run_id="rates", spec_hash="", algorithm="diloco", codec="int8"
        ),
        traffic={"sent": SWARM_SENT, "received": SWARM_RECEIVED},
        peers=[],
        snapshot=None,
        announced=[],
        call=lambda result: result,
        find_donors=lambda epoch, checksum: [],
    )

    def publish(snapshot: Any, *, throughput: float) -> None:
        swarm.snapshot = snapshot
        swarm.announced.append(throughput)

    swarm.publish = publish
    return swarm


class StopAfter(threading.Event):
    """Asks the trainer to stop once it has taken ``steps`` steps (over its restarts)."""

    def __init__(self, trainer: Trainer, steps: int) -> None:
        super().__init__()
        self.trainer, self.steps = trainer, steps

    def is_set(self) -> bool:
        return self.trainer.progress.steps >= self.steps


def _session(tmp_path: Path, steps: int) -> tuple[Progress, Any]:
    """One node process: start (resuming from the checkpoint folder if it holds one), train up
    to ``steps`` steps in all, checkpoint and stop."""
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(SPEC)
    config = node_config(
        spec_path=spec_path,
        cli=CommandLine(
            cache_dir=tmp_path / "cache",
            checkpoint_dir=tmp_path / "checkpoints",
            identity_path=tmp_path / "identity.key",
            eval_windows=2,
        ),
        environ={},
    )
    swarm = _swarm(config.spec)
    with Checkpointer(config.checkpoint_dir, config.spec, keep=2) as checkpoints:
        trainer = Trainer(config, swarm, checkpoints=checkpoints)
        progress = trainer.train(StopAfter(trainer, steps))
    return progress, swarm


def test_a_resumed_node_shows_and_announces_its_own_rate_and_keeps_its_totals(
    tmp_path: Path, clock: Clock
) -> None:
    fake_sdist(tmp_path / "cache" / "downloads")
    first, _ = _session(tmp_path, steps=4)
    assert first.tokens_per_second == TOKENS_PER_STEP  # a step a second
    assert (first.tokens, first.compute_seconds) == (4 * TOKENS_PER_STEP, 4.0)

    second, swarm = _session(tmp_path, steps=8)  # the restart: 4 more steps
    assert second.resumed_from
    # This process trained a step a second too: what it shows, exports and announces.
    assert second.tokens_per_second == TOKENS_PER_STEP
    assert second.mfu == pytest.approx(6 * second.parameters * TOKENS_PER_STEP / 1e12)
    assert second.mfu == pytest.approx(first.mfu)
    metrics = swarm.metrics.registry
    assert metrics.get_sample_value("swarmgrad_tokens_per_second") == TOKENS_PER_STEP
    assert swarm.announced[-1] == 0.0  # resumed, nothing trained yet by this process
    # Totals are the node's over both processes, never lower than before the restart.
    assert (first.bytes_sent, first.bytes_received) == (SWARM_SENT, SWARM_RECEIVED)
    assert (second.steps, second.tokens) == (8, 8 * TOKENS_PER_STEP)
    assert second.compute_seconds == 8.0
    assert (second.bytes_sent, second.bytes_received) == (2 * SWARM_SENT, 2 * SWARM_RECEIVED)
    for total in ("steps", "samples", "tokens", "bytes_sent", "bytes_received", "compute_seconds"):
        assert getattr(second, total) >= getattr(first, total), total


def test_a_resumed_replica_announces_the_samples_per_second_it_trains(clock: Clock) -> None:
    config = ModelSection(vocab_size=64, d_model=16, n_layers=1, n_heads=2, seq_len=8)
    spec = RunSpec.from_toml('[run]\nid = "r"\n')

    def replica(swarm: Any) -> DiLoCo:
        return DiLoCo(
            swarm, build_model(config, seed=0), inner_steps=1000, outer_lr=1.0, outer_momentum=0.0
        )

    first_swarm = _swarm(spec)
    before = replica(first_swarm)
    for _ in range(20):  # 16 samples a second for 20 s
        clock.now += 1.0
        before.step(samples=16)
    before.publish()
    assert first_swarm.announced[-1] == 16.0
    tensors, meta = before.state_dict()

    swarm = _swarm(spec)
    after = replica(swarm)  # the restarted process
    clock.now += 5.0  # its start-up: loading the checkpoint, evaluating
    after.load_state_dict(tensors, json.loads(json.dumps(meta)))
    assert swarm.announced[-1] == 0.0  # nothing trained by this process yet
    for _ in range(10):
        clock.now += 1.0
        after.step(samples=16)
    after.publish()
    assert swarm.announced[-1] == 16 * 10 / 15  # its samples over its own 15 s


def _strict(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_status_files_are_strict_json_with_null_where_a_number_is_unknown(tmp_path: Path) -> None:
    progress = Progress(peer_id="node-a", device="cpu")  # no loss yet, no MFU on a CPU
    progress.history.append({"epoch": 1, "train_loss": math.nan, "val_loss": 5.0})
    progress.trust = {"peer-b": {"rounds": 1, "clip_ema": math.nan, "cosine_ema": math.inf}}
    path = tmp_path / "status.json"
    write_status(path, progress.as_dict() | {"counts": {}})  # as the node writes it
    status = _strict(path.read_text())
    assert (status["mfu"], status["loss"], status["history"][0]["train_loss"]) == (None, None, None)
    assert status["history"][0]["val_loss"] == 5.0
    # `swarmgrad status --scores` reads it and shows "-" for what is not known.
    scores = read_scores(path)
    rows = scores_table(scores).columns
    assert [next(iter(c.cells)) for c in rows[2:4]] == ["-", "-"]
    nested = {"a": [1.0, math.nan, (math.inf, {"b": -math.inf})]}
    assert jsonable(nested) == {"a": [1.0, None, [None, {"b": None}]]}
