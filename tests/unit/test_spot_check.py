"""Open runs' loss spot checks: an update is scored by the loss it takes off the round's
parameters, on windows anyone can draw from (run, peer, round)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.training.data import Corpus, train_tokenizer
from swarmgrad.node.training.model import build_model, flatten
from swarmgrad.node.training.spot_check import LossProbe
from swarmgrad.simulations.swarm import DEMO_SPEC

SPEC = RunSpec.from_toml(DEMO_SPEC)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    """A stream a small model learns in a few steps: counting modulo 37."""
    tokens = (np.arange(50_000) % 37).astype(np.uint16)
    return Corpus(tokens=tokens, tokenizer=train_tokenizer(["a b"], SPEC.model.vocab_size))


def train(model: torch.nn.Module, corpus: Corpus, steps: int, peer_id: str) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    batches = corpus.batches(seq_len=SPEC.model.seq_len, batch_size=8, seed=0, peer_id=peer_id)
    for _, (inputs, targets) in zip(range(steps), batches, strict=False):
        optimizer.zero_grad()
        model.loss(inputs, targets).backward()
        optimizer.step()


def test_an_update_is_scored_by_the_loss_it_takes_off(corpus: Corpus) -> None:
    model = build_model(SPEC.model, seed=0)
    train(model, corpus, 20, "sgearlier")  # the swarm's parameters after a few rounds
    theta = flatten(list(model.parameters()))
    train(model, corpus, 10, "sgpeer")  # a peer's inner steps
    update = theta - flatten(list(model.parameters()))  # the pseudo-gradient it sends
    probe = LossProbe(SPEC, corpus, theta=lambda: theta)
    measure = probe.snapshot()
    theta.add_(1.0)  # the trainer moves on: the snapshot keeps the round's parameters
    honest = measure("sgpeer", 3, 0, update)
    assert honest > 0.5
    assert measure("sgpeer", 3, 0, update) == honest  # the same windows, the same number
    assert measure("sgpeer", 3, 0, -update) < -0.5  # a sign flip makes the model worse
    assert measure("sgpeer", 3, 0, 100 * update) < -0.5  # so does a x100 update
    noise = torch.randn(update.numel(), generator=torch.Generator().manual_seed(0))
    assert measure("sgpeer", 3, 0, 3 * noise * update.norm() / update.numel() ** 0.5) < 0
    assert measure("sgpeer", 3, 0, torch.zeros_like(update)) == 0.0  # zeros do nothing
    # One owner's part of the update tells the same story.
    size = update.numel()
    start, end = size // 4, size // 2
    assert measure("sgpeer", 3, start, update[start:end]) > 0
    assert measure("sgpeer", 3, start, -update[start:end]) < 0
    with pytest.raises(ValueError, match="outside"):
        measure("sgpeer", 3, size - 2, update[:10])


def test_spot_check_windows_are_drawn_from_run_peer_and_round(corpus: Corpus) -> None:
    probe = LossProbe(SPEC, corpus, theta=lambda: torch.zeros(1))
    windows = probe.windows("sgpeer", 3)
    assert windows.shape == (8, SPEC.model.seq_len + 1)
    assert torch.equal(
        windows, LossProbe(SPEC, corpus, theta=lambda: torch.zeros(1)).windows("sgpeer", 3)
    )
    assert not torch.equal(windows, probe.windows("sgother", 3))
    assert not torch.equal(windows, probe.windows("sgpeer", 4))
    with pytest.raises(ValueError, match="parameters of 1 values"):
        probe.snapshot()
