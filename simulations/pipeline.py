"""A pipeline swarm on this machine: a bootstrap, stage servers and trainers as real node
processes on 127.0.0.1 (``swarmgrad simulate --stages S``, and the pipeline tests).

:class:`PipelineSwarm` (``pipeline_swarm.py``) starts and watches them;
:func:`reference_losses` trains the same model on the same data in this process (every stage
chained, one optimizer per stage), the parity reference for a pipeline of one replica per stage.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarmgrad.node import config as node_config
from swarmgrad.node.pipeline.model import GradientSum, Pipeline, Stage, parameter_bytes
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.training.data import load_corpus
from swarmgrad.simulations.churn import ScheduleError, load_schedule
from swarmgrad.simulations.pipeline_swarm import Member, PipelineSwarm
from swarmgrad.simulations.profiles import SimulationError, load_profile
from swarmgrad.simulations.simulate_options import DISCOVERY, FORK_NODES, TIMEOUT_SECONDS
from swarmgrad.simulations.swarm import DEMO_SPEC


def reference_losses(
    spec: RunSpec, trainer: str, steps: int, *, cache_dir: Path | None = None
) -> list[float]:
    """The per-step losses of ``spec``'s whole pipeline model trained in this process on the
    batches trainer ``trainer`` (a peer id) draws, as one replica per stage trains it: each
    step's microbatches accumulate, weighted by their share, then every stage's AdamW steps."""
    corpus = load_corpus(
        spec.data,
        vocab_size=spec.model.vocab_size,
        cache_dir=cache_dir or node_config.home() / "cache",
    )
    batches = iter(
        corpus.batches(
            seq_len=spec.model.seq_len,
            batch_size=spec.data.batch_size,
            seed=spec.data.seed,
            peer_id=trainer,
        )
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the stage servers run: the same float reductions
    try:
        return _reference(spec, batches, steps)
    finally:
        torch.set_num_threads(threads)


def _reference(
    spec: RunSpec, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], steps: int
) -> list[float]:
    model = Pipeline(spec.model, spec.pipeline, seed=spec.data.seed)
    sums = [GradientSum(stage) for stage in model.stages]
    optimizers = [
        torch.optim.AdamW(stage.parameters(), lr=spec.algorithm.inner_lr, weight_decay=0.0)
        for stage in model.stages
    ]
    losses = []
    parts = spec.pipeline.microbatches
    for step in range(steps):
        inputs, targets = next(batches)
        total = 0.0
        for x, y in zip(inputs.chunk(parts), targets.chunk(parts), strict=True):
            loss = model.loss(x, y)
            (loss * (len(x) / len(inputs))).backward()  # type: ignore[no-untyped-call]
            total += float(loss.detach())
            for gradients in sums:
                gradients.collect()
        for gradients in sums:
            gradients.release()
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = spec.algorithm.lr_at(step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(total / parts)
    return losses


def whole_model_bytes(spec: RunSpec) -> int:
    """The pipeline model's parameter bytes, all stages together."""
    with torch.device("meta"):
        spans = spec.pipeline.spans(spec.model.n_layers)
        stages = [
            Stage(spec.model, span, first=k == 0, last=k == len(spans) - 1)
            for k, span in enumerate(spans)
        ]
    return sum(parameter_bytes(s) for s in stages)


#: The demo run as a pipeline: the demo GPT made deeper (8 layers) and cut into ``{stages}``.
PIPELINE_DEMO_SPEC = (
    DEMO_SPEC.replace('id = "shakespeare-demo"', 'id = "shakespeare-pipeline"')
    .replace("n_layers = 2", "n_layers = 8")
    .replace("group_size = 256", "group_size = 2")
    .replace("matchmaking_timeout_seconds = 20.0", "matchmaking_timeout_seconds = 5.0")
    + "\n[pipeline]\nstages = {stages}\nmicrobatches = 4\n"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSimulation:
    """``swarmgrad simulate --stages S``: ``nodes`` stage servers (node i serves stage i mod S)
    and ``trainers`` trainers, for ``rounds`` round barriers (``rounds x inner_steps`` trainer
    steps). Profiles apply to stage servers (slowdown, upload cap), as do churn events
    (kill, stop, start of node i at a round)."""

    stages: int
    nodes: int
    trainers: int
    rounds: int
    out_dir: Path
    spec_path: Path | None = None
    profile_path: Path | None = None
    churn_path: Path | None = None
    seed: int = 0
    timeout_seconds: float = TIMEOUT_SECONDS
    discovery: str = DISCOVERY
    fork_nodes: bool = FORK_NODES
    #: The stage node i starts on (None: i mod stages).
    placement: list[int] | None = None

    def __post_init__(self) -> None:
        if self.placement is not None and (
            len(self.placement) != self.nodes
            or not all(0 <= k < self.stages for k in self.placement)
        ):
            raise SimulationError(f"placement must name a stage for each of the {self.nodes} nodes")
        if self.stages < 2:
            raise SimulationError("--stages must be at least 2 (1 stage is a plain swarm)")
        if self.nodes < self.stages:
            raise SimulationError(
                f"--nodes ({self.nodes}) must be at least --stages ({self.stages}): every stage "
                f"needs a server"
            )
        if self.trainers < 1 or self.rounds < 1:
            raise SimulationError("--trainers and --rounds must be at least 1")


#: Churn events a pipeline simulation plays on its stage servers.
PIPELINE_ACTIONS = ("kill", "stop", "start")


def simulate_pipeline(config: PipelineSimulation) -> dict[str, Any]:
    """Run the pipeline swarm until every trainer is done; its summary (also summary.json)."""
    out = config.out_dir
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "run.toml"
    if config.spec_path is None:
        spec_path.write_text(PIPELINE_DEMO_SPEC.format(stages=config.stages))
    else:
        shutil.copyfile(config.spec_path, spec_path)
    spec = RunSpec.load(spec_path)
    if spec.pipeline.stages != config.stages:
        raise SimulationError(
            f"--stages {config.stages}, but the spec's [pipeline] has {spec.pipeline.stages}"
        )
    profiles = load_profile(config.profile_path, config.nodes, seed=config.seed)
    try:
        events = load_schedule(config.churn_path, nodes=config.nodes) if config.churn_path else []
    except ScheduleError as error:
        raise SimulationError(str(error)) from None
    for event in events:
        if event.node >= config.nodes:  # a new node: it would need a profile and a stage
            raise SimulationError(
                f"{event.describe()}: a pipeline simulation's events are for its --nodes "
                f"stage servers (0..{config.nodes - 1}), not new ones"
            )
        if event.during:
            raise SimulationError("a pipeline simulation's kills do not wait for a phase")
        if event.action not in PIPELINE_ACTIONS:  # the others would restart the server
            raise SimulationError(
                f"{event.describe()}: a pipeline simulation's events are "
                f"{', '.join(PIPELINE_ACTIONS)}"
            )
    steps = config.rounds * spec.algorithm.inner_steps
    started = time.monotonic()
    fired: list[dict[str, Any]] = []
    with PipelineSwarm(
        spec_path,
        out,
        seed=config.seed,
        timeout_seconds=config.timeout_seconds,
        discovery=config.discovery,
        fork_nodes=config.fork_nodes,
    ) as swarm:
        placement = config.placement or [i % config.stages for i in range(config.nodes)]

        def start(node: int) -> Member:
            profile = profiles[node]
            extra = ["--slowdown", str(profile.slowdown)]
            if profile.upload_bytes_per_second is not None:
                extra += ["--upload-limit", str(profile.upload_bytes_per_second)]
            stage = placement[node]
            return swarm.start_stage(stage, placement[:node].count(stage), *extra)

        servers = [start(i) for i in range(config.nodes)]
        swarm.wait_serving()
        trainers = [
            swarm.start_trainer(t, "--max-steps", str(steps)) for t in range(config.trainers)
        ]
        pending = sorted(events, key=lambda e: e.at_epoch)

        def done() -> bool:
            round_ = len(trainers[0].read().get("rounds", []))
            while pending and pending[0].at_epoch <= round_:
                event = pending.pop(0)
                member = servers[event.node]
                if event.action == "kill":
                    swarm.kill(member.name)
                elif event.action == "stop" and member.process is not None:
                    member.process.stop()
                else:
                    servers[event.node] = start(event.node)
                fired.append({"round": round_, "action": event.action, "node": event.node})
            return not any(t.alive for t in trainers)

        swarm.wait(done, "the trainers to finish")
        statuses = [t.read() for t in trainers]
        for trainer in trainers:
            assert trainer.process is not None
            if trainer.process.poll() != 0:
                raise SimulationError(f"{trainer.name} failed:\n{trainer.process.tail(30)}")
    # Once the stage servers have stopped: each writes its final status as it leaves.
    replicas = {m.name: m.read() for m in swarm.stages()}
    summary = _pipeline_summary(config, spec, statuses, replicas, time.monotonic() - started)
    summary["churn"] = fired
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _pipeline_summary(
    config: PipelineSimulation,
    spec: RunSpec,
    trainers: list[dict[str, Any]],
    replicas: dict[str, dict[str, Any]],
    wall_seconds: float,
) -> dict[str, Any]:
    stages = []
    for k in range(config.stages):
        mine = {n: s for n, s in replicas.items() if s.get("stage") == k}
        checksums = {s.get("checksum") for s in mine.values() if s.get("state") != "joining"}
        stages.append(
            {
                "stage": k,
                "replicas": {
                    name: {
                        "peer_id": s.get("peer_id", ""),
                        "samples": s.get("stats", {}).get("samples", 0),
                        "epoch": s.get("epoch", 0),
                        "parameter_bytes": s.get("parameter_bytes", 0),
                    }
                    for name, s in mine.items()
                },
                "replicas_identical": len(checksums) == 1,
                "retries": sum(t["stages"][k]["retries"] for t in trainers),
                "resends": sum(t["stages"][k]["resends"] for t in trainers),
                "bytes_up_per_sample": statistics.fmean(
                    t["stages"][k]["bytes_up_per_sample"] for t in trainers
                ),
                "bytes_down_per_sample": statistics.fmean(
                    t["stages"][k]["bytes_down_per_sample"] for t in trainers
                ),
            }
        )
    seconds = [s for t in trainers for s in t["step_seconds"][3:]] or [math.nan]
    return {
        "engine": "pipeline",
        "run": spec.run.id,
        "spec_hash": spec.short_hash,
        "stages": config.stages,
        "nodes": config.nodes,
        "trainers": config.trainers,
        "steps": [t["step"] for t in trainers],
        "wall_seconds": wall_seconds,
        "initial_loss": statistics.fmean(t["losses"][0] for t in trainers),
        "final_loss": statistics.fmean(statistics.fmean(t["losses"][-5:]) for t in trainers),
        "samples_per_second": config.trainers * spec.data.batch_size / statistics.median(seconds),
        "failed_steps": sum(t["failed_steps"] for t in trainers),
        "whole_model_bytes": whole_model_bytes(spec),
        "per_stage": stages,
        "ok": all(s["replicas_identical"] for s in stages)
        and all(t["step"] == config.rounds * spec.algorithm.inner_steps for t in trainers),
    }


def print_pipeline_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"pipeline {summary['run']} ({summary['spec_hash']})")
    for column in ("stage", "replicas", "samples", "MB held", "identical", "retries", "resends"):
        table.add_column(column)
    table.add_column("KiB/sample up/down")
    for stage in summary["per_stage"]:
        replicas = stage["replicas"].values()
        table.add_row(
            str(stage["stage"]),
            str(len(stage["replicas"])),
            "/".join(str(r["samples"]) for r in replicas),
            "/".join(f"{r['parameter_bytes'] / 1e6:.1f}" for r in replicas),
            "yes" if stage["replicas_identical"] else "NO",
            str(stage["retries"]),
            str(stage["resends"]),
            f"{stage['bytes_up_per_sample'] / 1024:.1f}/"
            f"{stage['bytes_down_per_sample'] / 1024:.1f}",
        )
    console.print(table)
    console.print(
        f"loss {summary['initial_loss']:.3f} -> {summary['final_loss']:.3f} in "
        f"{max(summary['steps'])} steps, {summary['samples_per_second']:.1f} samples/s, "
        f"{summary['failed_steps']} failed steps, whole model "
        f"{summary['whole_model_bytes'] / 1e6:.1f} MB, {summary['wall_seconds']:.0f} s"
    )
