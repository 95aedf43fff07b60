"""Yardsticks for a swarm's loss, trained in this one process with no network.

``train_alone``: the same model and data trained by one process alone (same initial weights, the
same inner optimizer, no averaging). ``train_together``: the same swarm with nobody lost and the
averaging exact: one replica per peer, each on that peer's data stream, DiLoCo's rounds with the
node's own outer optimizer on the fp32 mean of their deltas. Both are evaluated on the nodes'
validation windows. Also a warm start: a model trained alone for a while on a stream no peer
sees, saved for a spec's ``model.init``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from swarmgrad.node.runspec import AlgorithmSection, RunSpec
from swarmgrad.node.training.data import Batches, Corpus, load_corpus
from swarmgrad.node.training.model import CausalLM, build_model, flatten, save_weights, unflatten
from swarmgrad.node.training.outer import OuterOptimizer
from swarmgrad.node.training.step import evaluate, set_lr


def train_alone(
    spec: RunSpec,
    *,
    samples: int,
    cache_dir: Path,
    peer_id: str = "alone",
    eval_windows: int = 32,
    threads: int | None = None,
) -> tuple[float, float]:
    """Train on ``samples`` samples with plain AdamW; returns (initial, final) validation loss."""
    corpus, windows, model, initial = _untrained(spec, cache_dir, eval_windows, threads)
    steps = max(1, samples // spec.data.batch_size)
    _train(model, spec, corpus, batch_size=spec.data.batch_size, peer_id=peer_id, steps=steps)
    return initial, evaluate(model, windows, torch.device("cpu"))


def train_together(
    spec: RunSpec,
    *,
    peer_ids: Sequence[str],
    rounds: int,
    cache_dir: Path,
    eval_windows: int = 32,
    threads: int | None = None,
) -> tuple[float, list[float]]:
    """The DiLoCo run of a swarm of ``peer_ids`` that loses nobody and averages exactly, for
    ``rounds`` outer rounds of the spec's inner steps; returns (initial validation loss, the
    validation loss after each round)."""
    if spec.algorithm.name != "diloco":
        raise ValueError(f"train_together runs DiLoCo, not {spec.algorithm.name!r}")
    corpus, windows, model, initial = _untrained(spec, cache_dir, eval_windows, threads)
    streams = [
        corpus.batches(
            seq_len=spec.model.seq_len,
            batch_size=spec.data.batch_size,
            seed=spec.data.seed,
            peer_id=peer_id,
        )
        for peer_id in peer_ids
    ]
    algorithm = spec.algorithm
    curve = diloco_exact(
        model,
        streams,
        windows,
        rounds=rounds,
        schedule=algorithm,
        inner_steps=algorithm.inner_steps,
        outer_lr=algorithm.outer_lr,
        outer_momentum=algorithm.outer_momentum,
    )
    return initial, curve


def diloco_exact(
    initial: CausalLM,
    streams: Sequence[Batches],
    windows: torch.Tensor,
    *,
    rounds: int,
    schedule: AlgorithmSection,
    inner_steps: int,
    outer_lr: float,
    outer_momentum: float,
    average: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
) -> list[float]:
    """DiLoCo with one replica of ``initial`` per stream, averaged exactly in fp32 (or by
    ``average``, e.g. a model of a round through a codec): each round, ``inner_steps`` AdamW steps
    per replica (lr from ``schedule``, its optimizer kept across rounds, as a node keeps it), then
    the node's outer step on the mean delta. The validation loss after each round."""
    models = [copy.deepcopy(initial) for _ in streams]
    optimizers = [inner_optimizer(m, schedule.inner_lr) for m in models]
    outer = OuterOptimizer(
        flatten(list(initial.parameters())), lr=outer_lr, momentum=outer_momentum
    )
    cpu, curve = torch.device("cpu"), []
    for round_ in range(rounds):
        deltas = []
        for model, optimizer, stream in zip(models, optimizers, streams, strict=True):
            for i in range(inner_steps):
                adamw_step(model, optimizer, stream, schedule.lr_at(round_ * inner_steps + i))
            deltas.append(outer.pseudo_gradient(flatten(list(model.parameters()))))
        mean = average(deltas) if average is not None else torch.stack(deltas).mean(0)
        theta = outer.step(mean, own=deltas[0])
        for model in models:
            unflatten(theta, list(model.parameters()))
        curve.append(evaluate(models[0], windows, cpu))
    return curve


def warm_start(
    spec: RunSpec, *, steps: int, batch_size: int, cache_dir: Path, path: Path
) -> tuple[str, float]:
    """Train ``steps`` AdamW steps of ``batch_size`` from the spec's initial model on a stream of
    its own, and save the weights at ``path``; returns (SHA-256 for ``model.init_sha256``, the
    validation loss reached)."""
    corpus = load_corpus(spec.data, vocab_size=spec.model.vocab_size, cache_dir=cache_dir)
    model = build_model(spec.model, seed=spec.data.seed)
    _train(
        model,
        spec,
        corpus,
        batch_size=batch_size,
        peer_id="warm-start",
        steps=steps,
        schedule=False,
    )
    windows = corpus.validation(seq_len=spec.model.seq_len, num_windows=32)
    return save_weights(model, path), evaluate(model, windows, torch.device("cpu"))


def _train(
    model: CausalLM,
    spec: RunSpec,
    corpus: Corpus,
    *,
    batch_size: int,
    peer_id: str,
    steps: int,
    schedule: bool = True,
) -> None:
    """``steps`` plain AdamW steps on ``peer_id``'s stream of batches, at the spec's inner lr and
    (with ``schedule``) its warm-up and decay, as a node's inner optimizer runs them."""
    batches = corpus.batches(
        seq_len=spec.model.seq_len, batch_size=batch_size, seed=spec.data.seed, peer_id=peer_id
    )
    optimizer = inner_optimizer(model, spec.algorithm.inner_lr)
    for step in range(steps):
        adamw_step(model, optimizer, batches, spec.algorithm.lr_at(step) if schedule else None)


def inner_optimizer(model: CausalLM, lr: float) -> torch.optim.AdamW:
    """A node's inner optimizer, as the yardsticks run it on CPU: AdamW, no weight decay."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)


def adamw_step(
    model: CausalLM, optimizer: torch.optim.Optimizer, batches: Batches, lr: float | None
) -> None:
    """One inner step on the next batch, at ``lr`` (None: the optimizer's as it is)."""
    inputs, targets = next(batches)
    model.loss(inputs, targets).backward()  # type: ignore[no-untyped-call]
    if lr is not None:
        set_lr(optimizer, lr)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _untrained(
    spec: RunSpec, cache_dir: Path, eval_windows: int, threads: int | None
) -> tuple[Corpus, torch.Tensor, CausalLM, float]:
    """The spec's corpus, the nodes' validation windows, its initial model and that model's loss."""
    if threads is not None:
        torch.set_num_threads(threads)
    corpus = load_corpus(spec.data, vocab_size=spec.model.vocab_size, cache_dir=cache_dir)
    windows = corpus.validation(seq_len=spec.model.seq_len, num_windows=eval_windows)
    model = build_model(spec.model, seed=spec.data.seed)
    return corpus, windows, model, evaluate(model, windows, torch.device("cpu"))
