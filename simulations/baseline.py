"""The yardstick for a swarm's loss: the same model and data trained by one process alone.

Same initial weights, same data stream as the swarm's first peer, the same inner optimizer, and
no averaging; evaluated on the same validation windows as the nodes. Also a warm start: a model
trained alone for a while on a stream no peer sees, saved for a spec's ``model.init``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.training.data import Corpus, load_corpus
from swarmgrad.node.training.model import CausalLM, build_model, save_weights
from swarmgrad.node.training.trainer import evaluate, set_lr


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
    if threads is not None:
        torch.set_num_threads(threads)
    corpus = load_corpus(spec.data, vocab_size=spec.model.vocab_size, cache_dir=cache_dir)
    windows = corpus.validation(seq_len=spec.model.seq_len, num_windows=eval_windows)
    model = build_model(spec.model, seed=spec.data.seed)
    cpu = torch.device("cpu")
    initial = evaluate(model, windows, cpu)
    steps = max(1, samples // spec.data.batch_size)
    _train(model, spec, corpus, batch_size=spec.data.batch_size, peer_id=peer_id, steps=steps)
    return initial, evaluate(model, windows, cpu)


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
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.algorithm.inner_lr, weight_decay=0.0)
    for step in range(steps):
        inputs, targets = next(batches)
        model.loss(inputs, targets).backward()  # type: ignore[no-untyped-call]
        if schedule:
            set_lr(optimizer, spec.algorithm.lr_at(step))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
