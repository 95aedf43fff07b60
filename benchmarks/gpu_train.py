"""The GPU report's training step, for ``gpu.py`` (its section ``train``): the trainer's inner step
against a plain PyTorch loop on the same model, each eager and compiled, in tokens/s and MFU; and
the model sizes both that section and the swarm's use."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F

from swarmgrad.node.runspec import ModelSection
from swarmgrad.node.training.data import Batches, Corpus
from swarmgrad.node.training.device import (
    Prefetched,
    autocast,
    model_flops_utilization,
    peak_flops,
)
from swarmgrad.node.training.model import GPT, build_model
from swarmgrad.node.training.step import InnerStep
from swarmgrad.node.training.trainer import LOSS_READ_STEPS

#: name: (d_model, n_layers, n_heads, seq_len, batch, vocab)
SIZES: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (64, 2, 2, 64, 4, 512),
    "20m": (384, 8, 6, 512, 16, 8192),
    "125m": (768, 12, 12, 1024, 16, 50304),
    "1b": (2048, 18, 16, 1024, 8, 50304),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_section(size: str) -> ModelSection:
    d, layers, heads, seq, _, vocab = SIZES[size]
    return ModelSection(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, seq_len=seq)


def trainer_feed(size: str, device: torch.device) -> Prefetched:
    """The trainer's own sampler over a synthetic token stream, moved ahead as the trainer does."""
    _, _, _, seq, batch, vocab = SIZES[size]
    tokens = np.random.default_rng(0).integers(0, vocab, 16 * 2**20, dtype=np.uint16)
    corpus = Corpus(tokens=tokens, tokenizer=cast(Any, None))
    batches = Batches(corpus, seq_len=seq, batch_size=batch, seed=0, peer_id="bench")
    return Prefetched(batches, device, cursor=batches.cursor)


def run_trainer(model: GPT, size: str, device: torch.device, compiled: bool, steps: int) -> float:
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, weight_decay=0.0, fused=device.type == "cuda"
    )
    step = InnerStep(model, optimizer, device, compile=compiled)
    feed = trainer_feed(size, device)
    losses: list[torch.Tensor] = []

    def run(count: int) -> None:
        for _ in range(count):
            losses.append(step(*next(feed)))
            if len(losses) >= LOSS_READ_STEPS:  # as the trainer reads them
                torch.stack(losses).float().tolist()
                losses.clear()

    return timed_steps(run, steps, device, warmup=5 if compiled else 2)


def run_plain(model: GPT, size: str, device: torch.device, compiled: bool, steps: int) -> float:
    _, _, _, seq, batch, vocab = SIZES[size]
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, weight_decay=0.0, fused=device.type == "cuda"
    )
    forward = torch.compile(model) if compiled else model
    data = torch.randint(0, vocab, (batch, seq + 1), device=device)
    inputs, targets = data[:, :-1], data[:, 1:]

    def run(count: int) -> None:
        for _ in range(count):
            with autocast(device):
                logits = forward(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return timed_steps(run, steps, device, warmup=5 if compiled else 2)


def timed_steps(run: Callable[[int], None], steps: int, device: torch.device, warmup: int) -> float:
    """Seconds per step over ``steps`` timed steps (after ``warmup``)."""
    run(warmup)
    sync(device)
    start = time.perf_counter()
    run(steps)
    sync(device)
    return (time.perf_counter() - start) / steps


def bench_train(size: str, device: torch.device, steps: int, variants: list[str]) -> dict[str, Any]:
    section = model_section(size)
    _, _, _, seq, batch, _ = SIZES[size]
    model = build_model(section, seed=0).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    peak = peak_flops(device)
    result: dict[str, Any] = {
        "parameters": parameters,
        "tokens_per_step": seq * batch,
        "peak_flops": peak,
        "variants": {},
    }
    runners = {"plain": run_plain, "trainer": run_trainer}
    for variant in variants:
        kind, mode = variant.split("-")
        torch.compiler.reset()
        started = time.perf_counter()
        seconds = runners[kind](model, size, device, mode == "compiled", steps)
        tokens_per_second = seq * batch / seconds
        result["variants"][variant] = {
            "seconds_per_step": seconds,
            "tokens_per_second": tokens_per_second,
            "mfu": model_flops_utilization(parameters, tokens_per_second, peak),
            "wall_seconds": time.perf_counter() - started,
        }
        print(f"train {size} {variant}: {result['variants'][variant]}", flush=True)
    variants_done = result["variants"]
    for mode in ("eager", "compiled"):
        if f"trainer-{mode}" in variants_done and f"plain-{mode}" in variants_done:
            result[f"trainer_over_plain_{mode}"] = (
                variants_done[f"trainer-{mode}"]["tokens_per_second"]
                / variants_done[f"plain-{mode}"]["tokens_per_second"]
            )
    if device.type == "cuda":
        result["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    del model
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()
    return result
