"""The CLI's trainer: the run spec's model on its data, through the same API a researcher uses.

``Trainer.train`` runs in a worker thread (torch off the event loop) and reads top to bottom:
set up the device, data and model; then step, and after each round evaluate and report. It stops
when asked (``stop``), or when the replica reaches ``max_epochs``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from swarmgrad.node.config import NodeConfig
from swarmgrad.node.data import load_corpus
from swarmgrad.node.model import GPT, build_model
from swarmgrad.node.swarm import Swarm
from swarmgrad.node.training import DiLoCo, RoundReport, SyncDataParallel

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Progress:
    """What the display and the status file show; updated by the trainer thread."""

    peer_id: str = ""
    algorithm: str = ""
    device: str = ""
    epoch: int = 0
    steps: int = 0
    samples: int = 0
    tokens: int = 0
    loss: float = math.nan  # moving average of the training loss
    val_loss: float = math.nan
    initial_val_loss: float = math.nan
    tokens_per_second: float = 0.0
    peers: int = 0
    group_size: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_round_seconds: float = 0.0
    compute_seconds: float = 0.0
    communication_seconds: float = 0.0
    checksum: str = ""
    outcomes: dict[str, int] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)  # one entry per round
    started_at: float = field(default_factory=time.time)
    finished: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is available")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


@torch.no_grad()
def evaluate(model: GPT, windows: torch.Tensor, device: torch.device) -> float:
    model.eval()
    windows = windows.to(device)
    with _autocast(device):
        loss = model.loss(windows[:, :-1], windows[:, 1:])
    model.train()
    return float(loss)


def _autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Trainer:
    def __init__(
        self,
        config: NodeConfig,
        swarm: Swarm,
        *,
        on_progress: Callable[[Progress], None] = lambda progress: None,
    ) -> None:
        self.config, self.swarm = config, swarm
        self.progress = Progress(peer_id=swarm.peer_id, algorithm=config.spec.algorithm.name)
        self._on_progress = on_progress

    def train(self, stop: threading.Event) -> Progress:
        spec, progress = self.config.spec, self.progress
        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads)
        device = pick_device(self.config.device)
        progress.device = str(device)
        corpus = load_corpus(
            spec.data, vocab_size=spec.model.vocab_size, cache_dir=self.config.cache_dir
        )
        batches = corpus.batches(
            seq_len=spec.model.seq_len,
            batch_size=spec.data.batch_size,
            seed=spec.data.seed,
            peer_id=self.swarm.peer_id,
        )
        validation = corpus.validation(
            seq_len=spec.model.seq_len, num_windows=self.config.eval_windows
        )
        model = build_model(spec.model, seed=spec.data.seed).to(device)
        algorithm = spec.algorithm
        optimizer = torch.optim.AdamW(model.parameters(), lr=algorithm.inner_lr, weight_decay=0.0)
        replica: DiLoCo | SyncDataParallel
        if algorithm.name == "diloco":
            replica = DiLoCo(
                self.swarm,
                model,
                inner_steps=algorithm.inner_steps,
                outer_lr=algorithm.outer_lr,
                outer_momentum=algorithm.outer_momentum,
            )
        else:
            replica = SyncDataParallel(
                self.swarm, model, optimizer, target_batch_size=algorithm.target_batch_size
            )
        progress.initial_val_loss = progress.val_loss = evaluate(model, validation, device)
        started = time.monotonic()
        while not stop.is_set():
            step_started = time.monotonic()
            inputs, targets = next(batches)
            inputs, targets = _to(inputs, device), _to(targets, device)
            with _autocast(device):
                loss = model.loss(inputs, targets)
            loss.backward()  # type: ignore[no-untyped-call]
            if algorithm.name == "diloco":
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            compute = time.monotonic() - step_started
            if self.config.slowdown > 1:  # a slower machine, simulated
                time.sleep(compute * (self.config.slowdown - 1))
            progress.compute_seconds += time.monotonic() - step_started
            self._count_step(len(inputs), inputs.numel(), float(loss.detach()), started)
            report = replica.step(samples=len(inputs))
            if report is None:
                continue
            progress.communication_seconds += report.seconds
            self._record_round(report, replica, evaluate(model, validation, device))
            if self.config.max_epochs is not None and replica.epoch >= self.config.max_epochs:
                break
        progress.finished = True
        self._on_progress(progress)
        return progress

    def _count_step(self, samples: int, tokens: int, loss: float, started: float) -> None:
        progress = self.progress
        progress.steps += 1
        progress.samples += samples
        progress.tokens += tokens
        progress.loss = loss if math.isnan(progress.loss) else 0.95 * progress.loss + 0.05 * loss
        progress.tokens_per_second = progress.tokens / max(time.monotonic() - started, 1e-9)

    def _record_round(
        self, report: RoundReport, replica: DiLoCo | SyncDataParallel, val_loss: float
    ) -> None:
        progress, swarm = self.progress, self.swarm
        progress.epoch = report.epoch
        progress.val_loss = val_loss
        progress.group_size = report.group_size
        progress.last_round_seconds = report.seconds
        progress.peers = len(swarm.peers)
        progress.bytes_sent = swarm.traffic["sent"]
        progress.bytes_received = swarm.traffic["received"]
        snapshot = swarm.snapshot
        progress.checksum = snapshot.checksum if snapshot is not None else ""
        progress.outcomes[report.outcome] = progress.outcomes.get(report.outcome, 0) + 1
        progress.history.append(
            {
                "epoch": report.epoch,
                "outcome": report.outcome,
                "time": time.time() - progress.started_at,
                "samples": progress.samples,
                "train_loss": progress.loss,
                "val_loss": val_loss,
                "group_size": report.group_size,
                "round_seconds": report.seconds,
                "bytes_sent": progress.bytes_sent,
                "bytes_received": progress.bytes_received,
                "missing_values": report.missing_values,
            }
        )
        log.info(
            "epoch %d: %s (group of %d) in %.2f s, val loss %.3f, %s",
            report.epoch,
            report.outcome,
            report.group_size,
            report.seconds,
            val_loss,
            report.detail or "ok",
        )
        self._on_progress(progress)


def _to(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return batch.pin_memory().to(device, non_blocking=True)
    return batch
