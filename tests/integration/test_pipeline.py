"""Pipeline stages across peers, as real processes on 127.0.0.1: stage servers holding one span
of the model's layers each, trainers routing microbatches through them.

- parity: 4 stages x 1 replica train exactly like the whole model in one process (fp32 on the
  wire: per step within 1e-5; the default bf16/int8 codecs: the last 10 losses within 1%);
- each stage server holds only its span's parameters;
- a killed replica of a two-replica stage costs a retry and a resend, not the step;
- a stage with no replica fails the trainer's step within its deadline, and training resumes
  when a replica joins;
- a replica whose compute is slowed 4x gets at most a quarter of its stage's microbatches.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from swarmgrad.node.runspec import RunSpec
from swarmgrad.simulations.pipeline import (
    PipelineSimulation,
    reference_losses,
    simulate_pipeline,
    whole_model_bytes,
)
from swarmgrad.simulations.pipeline_swarm import PipelineSwarm, trainer_identity
from swarmgrad.simulations.processes import node_command
from tests.helpers import light

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


def _spec(
    tmp_path: Path, name: str, *, codecs: str = "", wait: float = 30.0, small: bool = False
) -> Path:
    """The test's spec; ``small``: an eighth of its tokens a step (``light``), for what a
    step's size does not change."""
    path = tmp_path / f"{name}.toml"
    text = SPEC.format(codecs=codecs, wait=wait)
    path.write_text(light(text) if small else text)
    return path


def _train(spec_path: Path, out: Path, steps: int) -> tuple[dict, list[dict]]:
    with PipelineSwarm(spec_path, out) as swarm:
        for stage in range(4):
            swarm.start_stage(stage)
        swarm.wait_serving()
        swarm.start_trainer(0, "--max-steps", str(steps))
        trainer = swarm.wait_finished("trainer0")
    # Read once every stage server has stopped: each writes its final status as it leaves
    # (while running, every second).
    return trainer, [m.read() for m in swarm.stages()]


def test_four_stage_processes_train_like_the_whole_model_in_one_process(tmp_path: Path) -> None:
    # Whether stages chain into the whole model does not depend on a step's size: an eighth of
    # the tokens (with the reference computed alike) keeps every comparison exact.
    steps = 50
    spec_path = _spec(tmp_path, "fp32", codecs=FP32, small=True)
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
    # fp32 on the wire: activations (and their gradients) of seq_len x d_model fp32 a sample.
    middle = trainer["stages"][1]
    per_sample = spec.model.seq_len * spec.model.d_model * 4
    assert middle["bytes_up_per_sample"] == 2 * per_sample  # activations in, gradients in

    # The default codecs (bf16 activations, int8 gradients): the same curve within 1%.
    # (Full-size steps: on a quarter of the tokens int8's error on the gradients is not lost in
    # the batch's noise, 3% off.)
    spec_path = _spec(tmp_path, "default")
    expected = reference_losses(RunSpec.load(spec_path), trainer_identity(0, 0).peer_id, 30)
    trainer, _ = _train(spec_path, tmp_path / "default", 30)
    got = trainer["losses"]
    last = statistics.fmean(got[-10:])
    assert last == pytest.approx(statistics.fmean(expected[20:30]), rel=0.01)
    full = RunSpec.load(spec_path).model
    fp32_bytes = 2 * full.seq_len * full.d_model * 4
    assert trainer["stages"][1]["bytes_up_per_sample"] < 0.4 * fp32_bytes


def _wait_steps(swarm: PipelineSwarm, steps: int) -> None:
    swarm.wait(lambda: swarm.members["trainer0"].read().get("step", 0) >= steps, f"step {steps}")


def test_replicas_fail_over_the_router_prefers_the_fast_one_and_a_lost_stage_waits(
    tmp_path: Path,
) -> None:
    """Stage 1: a replica and one whose compute is slowed 4x; stage 2: two replicas, one of
    which dies (SIGKILL) right after answering forwards, holding their inputs; then stage 3's
    only replica dies: the trainer fails that step within its wait and goes on once a replica
    is back, which resumes from its checkpoint."""
    spec_path = _spec(tmp_path, "failover", wait=3.0)
    spec_path.write_text(  # a round every 10 steps, a checkpoint every round
        spec_path.read_text().replace("inner_steps = 1000", "inner_steps = 10")
        + "\n[node]\ncheckpoint_every_rounds = 1\n"
    )
    steps = 40
    with PipelineSwarm(spec_path, tmp_path / "failover") as swarm:
        swarm.start_stage(0, 0, "--metrics-address", "127.0.0.1:0")
        swarm.start_stage(1, 0)
        swarm.start_stage(1, 1, "--slowdown", "4")
        swarm.start_stage(2, 0)
        # It dies after its 4th forward: two equal replicas need not share a stage's work
        # (an idle one that measured faster gets each microbatch, the other waits as a spare:
        # one CI run gave it 9 of 160), so a later crash might never come.
        swarm.start_stage(2, 1, crash_after_forwards=4)
        swarm.start_stage(3)
        swarm.wait_serving()
        swarm.start_trainer(0, "--max-steps", str(steps))
        trainer = swarm.members["trainer0"]
        swarm.wait(lambda: not swarm.members["stage2-1"].alive, "stage 2's replica to crash")
        crashed_at = trainer.read().get("step", 0)
        swarm.wait(lambda: trainer.read().get("step", 0) >= crashed_at + 2, "two more steps")
        before = trainer.read()
        assert before["failed_steps"] == 0  # the crash cost retries, not a step
        stage2 = before["stages"][2]
        assert stage2["retries"] >= 1
        assert stage2["resends"] >= 1  # its backwards went elsewhere, the inputs resent
        crash_steps = set(stage2["failover_steps"])
        # Prometheus: the stage's work, read from a stage server's /metrics.
        url = swarm.members["stage0-0"].read()["metrics_url"]
        scraped = urllib.request.urlopen(url, timeout=10).read().decode()
        forwards = re.search(
            r'swarmgrad_stage_work_total\{kind="forwards",stage="0"\} (\S+)', scraped
        )
        assert forwards is not None, scraped[-2000:]
        assert float(forwards.group(1)) > 0
        # swarmgrad status: the stage replicas' signed records, a row per stage, and what the
        # trainer saw of each stage.
        bootstrap = tmp_path / "failover" / "bootstrap.json"
        shown = subprocess.run(
            node_command(
                *("status", str(spec_path), "--json", "--bootstrap-file", str(bootstrap)),
                *("--traffic", str(trainer.status)),
            ),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0, shown.stderr
        body = json.loads(shown.stdout)
        layers = [row["layers"] for row in body["stages"]]
        assert layers == [[0, 2], [2, 4], [4, 6], [6, 8]]
        assert [row["serving"] for row in body["stages"]][:2] == [1, 2]
        assert all(row["serving"] >= 1 and row["versions"][1] >= 1 for row in body["stages"])
        states = {p["stage"]["state"] for p in body["peers"] if p["role"] == "stage"}
        assert states == {"serving"}  # (the crashed replica's record, until it expires)
        assert body["traffic"]["stages"][2]["retries"] >= 1

        swarm.kill("stage3-0")  # the last stage's only replica
        killed = time.monotonic()
        swarm.wait(lambda: trainer.read().get("failed_steps", 0) >= 1, "a failed step", 30.0)
        # Within its wait (3 s) and a call's deadline (10 s), with margin for this machine.
        assert time.monotonic() - killed < 20.0
        status = trainer.read()
        assert "no live replica of stage 3" in status["last_error"]
        assert status["step"] < steps
        swarm.start_stage(3)  # a replica joins again: training goes on
        final = swarm.wait_finished("trainer0")
        # The router's share over the run: the replica whose compute takes 4x as long (on this
        # crowded machine that makes it 2-4x slower per call, as the router measures it) got
        # at most a quarter of the stage's microbatches.
        replicas = final["stages"][1]["replicas"]
        assert len(replicas) == 2
        fast = replicas[swarm.members["stage1-0"].read()["peer_id"]]
        slow = replicas[swarm.members["stage1-1"].read()["peer_id"]]
        assert fast["samples"] >= 3 * slow["samples"], replicas
        stage3 = swarm.members["stage3-0"]
        swarm.wait(lambda: stage3.read().get("resumed_from", "") != "", "the resumed status")
        # It came back from its own checkpoint (of a round before the kill): nothing lost but
        # the steps since.
        resumed = Path(stage3.read()["resumed_from"]).name  # epoch-EEEEEE-step-SSSSSSSSS
        assert int(resumed.split("-")[1]) >= 1, resumed
    assert final["step"] == steps
    assert final["last_error"] == ""
    seconds = final["step_seconds"]  # (a step that failed and was taken again counts once)
    # The steps the crash hit: under twice the run's median step, or (the crash comes early,
    # among the first steps, which a loaded machine makes slow anyway: one CI run had steps 0
    # and 1 at 1.52 and 1.50 s, the crash in step 1, a median of 0.71 s) no slower than an
    # early step it did not hit.
    warm_up = [seconds[s] for s in range(3) if s not in crash_steps]
    bound = max([2 * statistics.median(seconds), *warm_up])
    for step in crash_steps:
        assert seconds[step] < bound, (step, seconds)
    losses = final["losses"]
    assert statistics.fmean(losses[-5:]) < losses[0] - 0.5


#: Rounds of the rebalancing run: enough for the moved replica to join on a loaded machine.
REBALANCE_ROUNDS = 14


def test_stages_are_diloco_groups_and_rebalancing_moves_exactly_one_replica(
    tmp_path: Path,
) -> None:
    """``simulate --stages 2 --nodes 4`` with three replicas on stage 0 and one on stage 1, a
    round every 5 trainer steps: exactly one replica moves to stage 1 (drains, leaves, joins
    its group, downloads its state) and none moves again; then at every round barrier both
    replicas of each stage average together, and they end bit-identical."""
    spec_path = tmp_path / "groups.toml"
    # Layers 0-3 | 4-7 and the head: about the same compute a sample (measured: 105-125 and
    # 120-135 samples/s a replica; with 0-4 | 5-7, 85 and 140), so one move is the plan.
    spec_path.write_text(
        SPEC.format(codecs="", wait=30.0)
        .replace("inner_steps = 1000", "inner_steps = 5")
        .replace("stages = 4", "stages = 2\nboundaries = [4]")
        + "rebalance_seconds = 2.0\n"
    )
    out = tmp_path / "groups"
    summary = simulate_pipeline(
        PipelineSimulation(
            stages=2,
            nodes=4,
            trainers=1,
            rounds=REBALANCE_ROUNDS,
            out_dir=out,
            spec_path=spec_path,
            placement=[0, 0, 0, 1],
        )
    )
    moves = [
        m
        for name in ("stage0-0", "stage0-1", "stage0-2", "stage1-0")
        for m in json.loads((out / f"{name}.json").read_text())["moves"]
    ]
    assert [(m["from"], m["to"]) for m in moves] == [(0, 1)]
    assert summary["ok"]
    assert summary["steps"] == [5 * REBALANCE_ROUNDS]
    assert summary["failed_steps"] == 0
    assert summary["final_loss"] < summary["initial_loss"] - 0.5
    rounds = json.loads((out / "trainer0.json").read_text())["rounds"]
    assert [r["step"] for r in rounds] == list(range(5, 5 * REBALANCE_ROUNDS + 5, 5))
    # Once the moved replica has joined (when depends on measured throughputs and this
    # machine's load: here from round 7, in one CI run not by round 10), both replicas of each
    # stage average together at every round barrier; it joined before the last.
    pairs = {"0": ["averaged"] * 2, "1": ["averaged"] * 2}
    joined = next((i for i, r in enumerate(rounds) if r["outcomes"]["1"] == pairs["1"]), None)
    assert joined is not None, (moves, rounds)
    assert all(r["outcomes"] == pairs for r in rounds[joined:]), rounds
    for stage in summary["per_stage"]:
        assert stage["replicas_identical"]
        replicas = list(stage["replicas"].values())
        assert len(replicas) == 2
        assert min(r["samples"] for r in replicas) > 0


def test_two_trainers_share_each_round_barrier_and_no_sample_is_lost(tmp_path: Path) -> None:
    """``simulate --stages 2 --nodes 4 --trainers 2``: a round runs once both trainers' steps
    are in, so every sample either trainer sent is applied exactly once (the last round's too:
    before the shared barrier, the slower trainer's last microbatches landed after the round
    the faster one had started, and were never applied), and each stage's replicas end
    bit-identical."""
    spec_path = tmp_path / "trainers.toml"
    spec_path.write_text(
        SPEC.format(codecs="", wait=30.0)
        .replace("inner_steps = 1000", "inner_steps = 5")
        .replace("stages = 4", "stages = 2")
    )
    out = tmp_path / "trainers"
    summary = simulate_pipeline(
        PipelineSimulation(
            stages=2, nodes=4, trainers=2, rounds=4, out_dir=out, spec_path=spec_path
        )
    )
    assert summary["ok"]
    assert summary["steps"] == [20, 20]
    assert summary["failed_steps"] == 0
    batch = RunSpec.load(spec_path).data.batch_size
    for stage in summary["per_stage"]:
        assert stage["replicas_identical"]
        replicas = list(stage["replicas"].values())
        assert all(r["epoch"] == 4 for r in replicas)
        assert sum(r["samples"] for r in replicas) == 2 * 20 * batch, stage
    for name in ("stage0-0", "stage0-1", "stage1-0", "stage1-1"):
        status = json.loads((out / f"{name}.json").read_text())
        assert status["stats"]["barrier_timeouts"] == 0
    for trainer in ("trainer0", "trainer1"):
        rounds = json.loads((out / f"{trainer}.json").read_text())["rounds"]
        assert [r["step"] for r in rounds] == [5, 10, 15, 20]
