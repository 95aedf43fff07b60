#!/usr/bin/env python3
"""Pipeline stages across processes against the whole model in one process, on this machine.

    python benchmarks/pipeline.py                    # every arm once, 30 steps each
    python benchmarks/pipeline.py --steps 40 --repeats 3 --json out.json
    python benchmarks/pipeline.py --upload-mb 10,2.5  # the capped arms at each cap
    python benchmarks/pipeline.py --device cuda --arms "one process,S4x1,capped"  # on a GPU

On one host a pipeline shows its overhead, not a speedup: every stage is a process of its own on
the same cores, every boundary a gRPC hop through the trainer (the hub), and every backward
recomputes its stage's forward. Arms (the same model: GPT d128 x 8 layers, vocab 2048, seq 64,
batches of 16 in 4 microbatches; 1 torch thread per process):

- ``one process``: every stage chained in this process, microbatches accumulated, AdamW;
- ``S4x1 fp32`` / ``S4x1 default`` (bf16 activations, int8 gradients) / ``S4x1 int8`` (int8 both
  ways) / ``S4x2 default``: 4 stage processes with 1 or 2 replicas each, one trainer;
- ``capped fp32 @C`` / ``capped default @C``: S4x1 with every process's upload capped at C MB/s,
  for each C in ``--upload-mb`` (10 and 2.5 by default: on this CPU a step's compute is ~0.2 s,
  so 10 MB/s leaves it compute-bound; 2.5 MB/s is the link a GPU ~4x faster would see at 10);
- ``no kill`` / ``kill``: S4x1 but stage 2 has 2 replicas; in ``kill`` one of them dies
  (SIGKILL) between forwards and backwards: the time from the failed call to its answer
  elsewhere, the step's time against the median step, and the last 10 losses against ``no
  kill``'s (the same data and seeds);
- ``hivemind S4x1 fp32``: the same split served by four hivemind ``RemoteExpert`` processes
  (``benchmarks/hivemind_chain.py``), the trainer's microbatches in flight at once.

``--device cuda`` puts the stage servers' spans (and the one-process arm) on the GPU, where a
step's compute is a few milliseconds and the capped links, not the cores, set the pace.
``--arms`` runs the arms whose names contain one of its comma-separated parts.

Reported: samples/s (the batch over the median step time, the first 3 steps left out), bytes per
sample per boundary per direction (one crossing; through the hub each crosses twice), and ratios.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from hivemind_chain import chain_arm  # a sibling script: run as one, its folder is on the path

from swarmgrad.node.config import home
from swarmgrad.node.pipeline.model import Pipeline
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.training.data import load_corpus
from swarmgrad.simulations.pipeline import PIPELINE_DEMO_SPEC
from swarmgrad.simulations.pipeline_swarm import PipelineSwarm

SPEC = (
    PIPELINE_DEMO_SPEC.format(stages=4)
    .replace('id = "shakespeare-pipeline"', 'id = "pipeline-bench"')
    .replace("inner_steps = 10", "inner_steps = 100000")  # no rounds: the pipeline alone
    + 'activations = "{activations}"\ngradients = "{gradients}"\n'
)
CODECS = {"fp32": ("none", "none"), "default": ("bf16", "int8"), "int8": ("int8", "int8")}
WARMUP_STEPS = 3


def one_process(steps: int, device: str = "cpu") -> dict[str, Any]:
    """The whole model in this process: the step times of the same training."""
    torch.set_num_threads(1)
    spec = RunSpec.from_toml(SPEC.format(activations="none", gradients="none"))
    batches = _batches()
    model = Pipeline(spec.model, spec.pipeline, seed=spec.data.seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.algorithm.inner_lr, weight_decay=0)
    seconds, losses = [], []
    for _ in range(steps):
        started = time.monotonic()
        inputs, targets = (t.to(device) for t in next(batches))
        total = 0.0
        for x, y in zip(inputs.chunk(4), targets.chunk(4), strict=True):
            loss = model.loss(x, y)
            (loss * 0.25).backward()  # type: ignore[no-untyped-call]
            total += float(loss.detach()) / 4
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.monotonic() - started)
        losses.append(total)
    return _summary({"step_seconds": seconds, "losses": losses, "stages": []})


def _batches() -> Any:
    """The one-process and hivemind arms' batches (the same for both)."""
    spec = RunSpec.from_toml(SPEC.format(activations="none", gradients="none"))
    corpus = load_corpus(spec.data, vocab_size=spec.model.vocab_size, cache_dir=home() / "cache")
    return iter(corpus.batches(seq_len=64, batch_size=16, seed=spec.data.seed, peer_id="benchmark"))


def pipeline_arm(
    work: Path,
    *,
    codecs: str,
    replicas: int,
    steps: int,
    upload_mb: float | None = None,
    kill: bool = False,
    second_stage2: bool = False,
    device: str = "cpu",
) -> dict[str, Any]:
    activations, gradients = CODECS[codecs]
    spec_path = work / f"{codecs}.toml"
    spec_path.write_text(SPEC.format(activations=activations, gradients=gradients))
    cap = ["--upload-limit", str(upload_mb * 1e6)] if upload_mb else []
    on = ["--device", device]
    out = work / f"{codecs}-{replicas}-{upload_mb}-{kill}-{second_stage2}"
    with PipelineSwarm(spec_path, out) as swarm:
        for stage in range(4):
            for replica in range(replicas):
                swarm.start_stage(stage, replica, *cap, *on)
        if kill or second_stage2:  # one more replica of stage 2 (which dies mid-run: kill)
            # It gets about half of the stage's 4 x steps forwards: it dies about mid-run.
            swarm.start_stage(2, 1, *cap, *on, crash_after_forwards=steps if kill else None)
        swarm.wait_serving()
        swarm.start_trainer(0, "--max-steps", str(steps), *cap)
        status = swarm.wait_finished("trainer0")
        held = [m.read().get("parameter_bytes", 0) for m in swarm.stages()]
    summary = _summary(status)
    summary["parameter_bytes_per_stage_server"] = held
    if kill:
        stage2 = status["stages"][2]
        if not stage2["retries"]:
            raise RuntimeError("the kill arm's replica did not die while the trainer ran")
        seconds = status["step_seconds"]
        summary["kill"] = {
            "retries": stage2["retries"],
            "resends": stage2["resends"],
            "failover_seconds": stage2["failover_seconds"],
            "worst_step_over_median": max(seconds[WARMUP_STEPS:]) / statistics.median(seconds),
            "failed_steps": status["failed_steps"],
        }
    return summary


def _summary(status: dict[str, Any]) -> dict[str, Any]:
    seconds = status["step_seconds"][WARMUP_STEPS:]
    median = statistics.median(seconds)
    stages = status["stages"]
    boundaries = []
    for b in range(len(stages) - 1):  # between stage b and b + 1
        boundaries.append(
            {
                "forward": stages[b].get("received_per_sample", {}).get("activations", 0.0),
                "backward": stages[b + 1].get("received_per_sample", {}).get("gradients", 0.0),
            }
        )
    return {
        "samples_per_second": 16 / median,
        "step_seconds_median": median,
        "step_seconds_spread": [min(seconds), max(seconds)],
        "last_losses": status["losses"][-5:],
        "mean_last_10_losses": statistics.fmean(status["losses"][-10:]),
        "boundaries": boundaries,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--upload-mb", default="10,2.5", help="caps in MB/s, comma-separated")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--device", default="cpu", help="the stage servers' device: cpu or cuda")
    parser.add_argument("--arms", default="", help="only arms whose names contain one of these")
    args = parser.parse_args()
    caps = [float(c) for c in args.upload_mb.split(",")]
    wanted = [part for part in args.arms.split(",") if part]
    arm = functools.partial(pipeline_arm, device=args.device)
    arms: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for _ in range(args.repeats):
            runs = {
                "one process": lambda: one_process(args.steps, args.device),
                "S4x1 fp32": lambda: arm(work, codecs="fp32", replicas=1, steps=args.steps),
                "S4x1 default": lambda: arm(work, codecs="default", replicas=1, steps=args.steps),
                "S4x1 int8": lambda: arm(work, codecs="int8", replicas=1, steps=args.steps),
                "S4x2 default": lambda: arm(work, codecs="default", replicas=2, steps=args.steps),
                "no kill": lambda: arm(
                    work, codecs="default", replicas=1, steps=args.steps, second_stage2=True
                ),
                "kill": lambda: arm(
                    work, codecs="default", replicas=1, steps=args.steps, kill=True
                ),
                "hivemind S4x1 fp32": lambda: chain_arm(
                    work,
                    SPEC.format(activations="none", gradients="none"),
                    args.steps,
                    _batches(),
                    WARMUP_STEPS,
                ),
            }
            for cap in caps:
                for codecs in ("fp32", "default"):
                    runs[f"capped {codecs} @{cap:g}"] = functools.partial(
                        arm,
                        work,
                        codecs=codecs,
                        replicas=1,
                        steps=args.steps,
                        upload_mb=cap,
                    )
            for name, run in runs.items():
                if wanted and not any(part in name for part in wanted):
                    continue
                result = run()
                arms.setdefault(name, []).append(result)
                print(f"{name:>20}: {result['samples_per_second']:7.1f} samples/s", flush=True)
    report = _report(arms, caps, args.device)
    if args.json:
        args.json.write_text(json.dumps({"arms": arms, "report": report}, indent=1))


def _median(arms: dict[str, list[dict[str, Any]]], name: str) -> float:
    return statistics.median(r["samples_per_second"] for r in arms[name])


def _report(
    arms: dict[str, list[dict[str, Any]]], caps: list[float], device: str
) -> dict[str, Any]:
    """Print the tables of the arms that ran; return their figures."""
    report: dict[str, Any] = {"device": device}
    base = _median(arms, "one process") if "one process" in arms else None
    report["one_process"] = base
    print(f"\nthroughput on {device} (median of repeats; the batch over the median step)")
    print(f"{'arm':>20} {'samples/s':>10} {'vs one process':>15}")
    for name in arms:
        value = _median(arms, name)
        versus = f"{value / base:14.2f}x" if base else ""
        print(f"{name:>20} {value:10.1f} {versus}")
    if all(f"S4x1 {c}" in arms for c in CODECS):
        print("\nbytes per sample per boundary per direction (one crossing; the hub doubles them)")
        fp32 = arms["S4x1 fp32"][0]["boundaries"]
        for name in ("S4x1 fp32", "S4x1 default", "S4x1 int8"):
            rows = arms[name][0]["boundaries"]
            cells = "  ".join(
                f"{r['forward'] / 1024:6.1f}/{r['backward'] / 1024:6.1f}" for r in rows
            )
            total = sum(r["forward"] + r["backward"] for r in rows)
            ratio = total / sum(r["forward"] + r["backward"] for r in fp32)
            print(f"{name:>20}: KiB fwd/bwd {cells}   total {ratio:.2f}x fp32's")
    capped = {
        cap: _median(arms, f"capped default @{cap:g}") / _median(arms, f"capped fp32 @{cap:g}")
        for cap in caps
        if f"capped default @{cap:g}" in arms and f"capped fp32 @{cap:g}" in arms
    }
    for cap, ratio in capped.items():
        print(f"uploads capped at {cap:g} MB/s: default codecs {ratio:.2f}x fp32's samples/s")
    report["capped_ratio"] = {f"{cap:g}": ratio for cap, ratio in capped.items()}
    if "kill" in arms and "no kill" in arms:
        kills = [r["kill"] for r in arms["kill"]]
        for kill in kills:
            print(
                f"kill: {kill['retries']} retries, {kill['resends']} resends, failover "
                f"{[round(s * 1000) for s in kill['failover_seconds']]} ms, worst step "
                f"{kill['worst_step_over_median']:.2f}x the median, "
                f"{kill['failed_steps']} failed steps"
            )
        # Two replicas of stage 2 that never average (no rounds here) learn from whichever
        # microbatches the router gives each, so one run's loss wobbles: compare medians.
        losses = {
            name: statistics.median(r["mean_last_10_losses"] for r in arms[name])
            for name in ("kill", "no kill")
        }
        loss_vs_no_kill = losses["kill"] / losses["no kill"] - 1
        print(
            f"kill: the last 10 losses {loss_vs_no_kill:+.2%} vs no kill's (medians of "
            f"{[round(r['mean_last_10_losses'], 3) for r in arms['kill']]} and "
            f"{[round(r['mean_last_10_losses'], 3) for r in arms['no kill']]})"
        )
        report["kill"], report["kill_loss_vs_no_kill"] = kills, loss_vs_no_kill
    if "S4x1 fp32" in arms and "hivemind S4x1 fp32" in arms:
        hivemind = _median(arms, "S4x1 fp32") / _median(arms, "hivemind S4x1 fp32")
        print(f"swarmgrad's S4x1 fp32 vs hivemind RemoteExpert chain: {hivemind:.2f}x samples/s")
        report["vs_hivemind"] = hivemind
    return report


if __name__ == "__main__":
    main()
