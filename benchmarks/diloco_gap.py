"""Where DiLoCo's loss gap to per-step averaging comes from, on the demo model, with no network.

An algorithm study, not a swarm: N replicas of the demo model in one process, each on its own
data stream (as N peers would be), averaged exactly in fp32. It reuses the node's model, data
and outer optimizer (:class:`swarmgrad.node.training.outer.OuterOptimizer`); what it leaves
out is what ``benchmarks/communication.py`` measures (codecs, the wire, real processes). Three
settings share the initial weights and the sample budget per replica:

* ``sync``: one AdamW step per global batch of one micro-batch from each replica;
* ``alone``: one replica's stream only (1/N of the samples), the yardstick the tests use;
* ``diloco``: H inner AdamW steps per replica, then the outer step on the averaged delta.

``--warm-start-steps S`` first trains the initial model alone for S steps of batch N x B on a
stream none of the replicas sees, and starts every setting from it (the DiLoCo paper starts its
runs from a pretrained model).

    .venv/bin/python benchmarks/diloco_gap.py                          # demo budget, ~2 min
    .venv/bin/python benchmarks/diloco_gap.py --steps 250 --inner-steps 50 --warm-start-steps 250
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import torch

from swarmgrad.node import config as node_config
from swarmgrad.node.runspec import AlgorithmSection, RunSpec
from swarmgrad.node.training.data import Batches, Corpus, load_corpus
from swarmgrad.node.training.model import GPT, build_model
from swarmgrad.node.training.step import set_lr
from swarmgrad.simulations.baseline import adamw_step, diloco_exact, inner_optimizer, warm_start
from swarmgrad.simulations.swarm import DEMO_SPEC


def _loss(model: GPT, windows: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model.loss(windows[:, :-1], windows[:, 1:]))


class Study:
    def __init__(
        self, spec: RunSpec, corpus: Corpus, *, replicas: int, windows: int, data_seed: int = 0
    ) -> None:
        self.spec, self.corpus, self.replicas = spec, corpus, replicas
        self.data_seed = data_seed
        self.windows = corpus.validation(seq_len=spec.model.seq_len, num_windows=windows)
        self.initial = build_model(spec.model, seed=spec.data.seed)

    def streams(self, batch_size: int | None = None, names: int | None = None) -> list[Batches]:
        return [
            self.corpus.batches(
                seq_len=self.spec.model.seq_len,
                batch_size=batch_size or self.spec.data.batch_size,
                seed=self.spec.data.seed,
                peer_id=f"replica-{i}" if not self.data_seed else f"replica-{self.data_seed}-{i}",
            )
            for i in range(self.replicas if names is None else names)
        ]

    def sync(self, steps: int, schedule: AlgorithmSection) -> float:
        model = copy.deepcopy(self.initial)
        optimizer, streams = inner_optimizer(model, schedule.inner_lr), self.streams()
        for step in range(steps):
            for stream in streams:  # gradients add up: one step on the mean over N micro-batches
                inputs, targets = next(stream)
                loss = model.loss(inputs, targets) / self.replicas
                loss.backward()  # type: ignore[no-untyped-call]
            set_lr(optimizer, schedule.lr_at(step))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return _loss(model, self.windows)

    def alone(self, steps: int, schedule: AlgorithmSection) -> float:
        model = copy.deepcopy(self.initial)
        optimizer, stream = inner_optimizer(model, schedule.inner_lr), self.streams(names=1)[0]
        for step in range(steps):
            adamw_step(model, optimizer, stream, schedule.lr_at(step))
        return _loss(model, self.windows)

    def diloco(
        self,
        steps: int,
        schedule: AlgorithmSection,
        *,
        inner_steps: int,
        outer_lr: float,
        outer_momentum: float,
    ) -> list[float]:
        """Validation loss after each outer round."""
        return diloco_exact(
            self.initial,
            self.streams(),
            self.windows,
            rounds=steps // inner_steps,
            schedule=schedule,
            inner_steps=inner_steps,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=250, help="inner steps per replica")
    parser.add_argument("--inner-steps", type=int, nargs="+", default=[10, 50], help="H values")
    parser.add_argument("--outer", nargs="+", default=["1.0/0.0", "0.7/0.9"], help="lr/momentum")
    parser.add_argument("--lr", type=float, help="inner AdamW lr (default: the demo spec's)")
    parser.add_argument(
        "--diloco-lr",
        type=float,
        nargs="+",
        help="DiLoCo's inner lr(s), if not --lr (sync and alone keep --lr)",
    )
    parser.add_argument("--warm-start-steps", type=int, default=0)
    parser.add_argument(
        "--schedule",
        default="0/0",
        help="inner lr WARMUP/DECAY steps (the spec's algorithm.warmup_steps/decay_steps)",
    )
    parser.add_argument(
        "--data-seed", type=int, default=0, help="another draw of the replicas' data streams"
    )
    parser.add_argument("--eval-windows", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        run(args, Path(tmp))


def run(args: argparse.Namespace, tmp: Path) -> None:
    spec = RunSpec.from_toml(DEMO_SPEC)
    warmup, decay = (int(x) for x in args.schedule.split("/"))
    schedule = dataclasses.replace(
        spec.algorithm,
        inner_lr=args.lr or spec.algorithm.inner_lr,
        warmup_steps=warmup,
        decay_steps=decay,
    )
    lr = schedule.inner_lr
    corpus = load_corpus(
        spec.data, vocab_size=spec.model.vocab_size, cache_dir=node_config.home() / "cache"
    )
    if args.warm_start_steps:
        weights = Path(tmp) / "warm.safetensors"
        digest, _ = warm_start(
            spec,
            steps=args.warm_start_steps,
            batch_size=args.replicas * spec.data.batch_size,
            cache_dir=node_config.home() / "cache",
            path=weights,
        )
        init = dataclasses.replace(spec.model, init=str(weights), init_sha256=digest)
        spec = dataclasses.replace(spec, model=init)
    lab = Study(
        spec, corpus, replicas=args.replicas, windows=args.eval_windows, data_seed=args.data_seed
    )
    start = _loss(lab.initial, lab.windows)
    print(
        f"{args.replicas} replicas x {args.steps} steps of batch {spec.data.batch_size}, "
        f"inner lr {lr:g} (schedule {args.schedule}), "
        f"warm start {args.warm_start_steps} steps (val loss {start:.3f}), "
        f"{args.eval_windows} validation windows"
    )
    rows: list[tuple[str, float, str]] = []
    began = time.monotonic()
    reference = lab.sync(args.steps, schedule)
    rows.append(("sync (batch N x B)", reference, ""))
    print(f"sync: {reference:.3f}", flush=True)
    rows.append(("alone (1/N samples)", lab.alone(args.steps, schedule), ""))
    for h, outer, inner_lr in itertools.product(
        args.inner_steps, args.outer, args.diloco_lr or [lr]
    ):
        outer_lr, momentum = (float(x) for x in outer.split("/"))
        curve = lab.diloco(
            args.steps,
            dataclasses.replace(schedule, inner_lr=inner_lr),
            inner_steps=h,
            outer_lr=outer_lr,
            outer_momentum=momentum,
        )
        name = f"diloco H={h} outer {outer}" + (f" lr {inner_lr:g}" if args.diloco_lr else "")
        print(f"{name}: {curve[-1]:.3f}", flush=True)
        shape = f"worst round {max(curve):.3f}, last 3 {statistics.fmean(curve[-3:]):.3f}"
        rows.append((name, curve[-1], shape))
    width = max(28, *(len(name) + 2 for name, _, _ in rows))
    print(f"{'setting':<{width}}{'val loss':>9}{'gap':>8}  curve")
    for name, loss, shape in rows:
        print(f"{name:<{width}}{loss:>9.3f}{(loss - reference) / reference:>+8.1%}  {shape}")
    print(f"({time.monotonic() - began:.0f} s)")


if __name__ == "__main__":
    main()
