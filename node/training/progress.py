"""What a node's trainer reports as it goes: the display and the status file read it."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarmgrad.node.training.replica import RoundReport


@dataclass(slots=True)
class Progress:
    """What the display and the status file show; updated by the trainer thread."""

    peer_id: str = ""
    algorithm: str = ""
    device: str = ""
    epoch: int = 0
    steps: int = 0
    samples: int = 0
    #: Of them, those sent in rounds that averaged (fully or partly): what reached the model,
    #: unless a resync later replaced the state they went into.
    samples_averaged: int = 0
    tokens: int = 0
    loss: float = math.nan  # moving average of the training loss
    val_loss: float = math.nan
    initial_val_loss: float = math.nan
    tokens_per_second: float = 0.0  # this process's: its own tokens over its own seconds
    parameters: int = 0
    #: Model FLOPs utilization: 6 x parameters x tokens/s over the device's bf16 peak (NaN:
    #: unknown peak, e.g. a CPU).
    mfu: float = math.nan
    lr: float = math.nan  # the inner optimizer's learning rate at the last step
    peers: int = 0
    group_size: int = 0
    #: Like steps, samples and tokens, these are the node's totals over its restarts (kept in
    #: its checkpoints): they never go down.
    bytes_sent: int = 0
    bytes_received: int = 0
    last_round_seconds: float = 0.0
    compute_seconds: float = 0.0
    communication_seconds: float = 0.0
    checksum: str = ""
    checkpoint: str = ""  # the last one written
    resumed_from: str = ""  # the checkpoint this run started from
    outcomes: dict[str, int] = field(default_factory=dict)
    #: Open runs: per peer this node aggregated, its scores, flags and ban (the trust ledger).
    trust: dict[str, dict[str, object]] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)  # one entry per round
    started_at: float = field(default_factory=time.time)
    finished: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def counters(self) -> dict[str, Any]:
        """The totals a checkpoint keeps over restarts (:meth:`resume_counters` reads them)."""
        return {
            "steps": self.steps,
            "samples": self.samples,
            "samples_averaged": self.samples_averaged,
            "tokens": self.tokens,
            "initial_val_loss": self.initial_val_loss,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "compute_seconds": self.compute_seconds,
            "communication_seconds": self.communication_seconds,
        }

    def resume_counters(self, counters: dict[str, Any]) -> None:
        """Go on from a checkpoint's :meth:`counters` (the bytes are the trainer's to add to
        its swarm's own). Raises KeyError, TypeError or ValueError for counters that do not
        parse; the times are absent from checkpoints before they were kept."""
        self.steps, self.samples = int(counters["steps"]), int(counters["samples"])
        self.tokens = int(counters["tokens"])
        self.samples_averaged = int(counters.get("samples_averaged", 0))  # absent before kept
        self.initial_val_loss = float(counters["initial_val_loss"])
        self.compute_seconds = float(counters.get("compute_seconds", 0.0))
        self.communication_seconds = float(counters.get("communication_seconds", 0.0))

    def take_round(
        self, report: RoundReport, *, val_loss: float, peers: int, checksum: str
    ) -> None:
        """What a round's report shows: the epoch, its outcome counted, a history entry (the
        byte counters and training loss as the trainer has just brought them up to date)."""
        self.epoch, self.val_loss = report.epoch, val_loss
        self.group_size, self.last_round_seconds = report.group_size, report.seconds
        self.peers, self.checksum = peers, checksum
        self.outcomes[report.outcome] = self.outcomes.get(report.outcome, 0) + 1
        self.samples_averaged += report.sent_samples
        self.history.append(
            {
                "epoch": report.epoch,
                "outcome": report.outcome,
                "time": time.time() - self.started_at,
                "samples": self.samples,
                "train_loss": self.loss,
                "val_loss": val_loss,
                "group_size": report.group_size,
                "sent_samples": report.sent_samples,
                "round_seconds": report.seconds,
                "allreduce_seconds": report.allreduce_seconds,
                "outer_seconds": report.outer_seconds,
                "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received,
                "missing_values": report.missing_values,
            }
        )
