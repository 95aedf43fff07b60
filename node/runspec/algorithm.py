"""``[algorithm]``: DiLoCo or per-step sync, its steps, learning rates and schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarmgrad.node.averaging.slots import SETTLE_SECONDS, shortest_slot
from swarmgrad.node.runspec.errors import RunSpecError, positive

#: ``algorithm.carry_epochs``'s default: keep a split group's and a missed round's progress.
CARRY_EPOCHS = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class AlgorithmSection:
    name: str = "diloco"  # "diloco", or "sync" (per-step gradient averaging, the reference)
    inner_steps: int = 50
    inner_lr: float = 3e-4
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    target_batch_size: int = 256  # sync: samples per global step
    # The inner learning rate's schedule, by inner optimizer step over the whole run (diloco:
    # epoch x inner_steps + steps into the round; sync: the global step): a linear warm-up over
    # warmup_steps, then, if decay_steps > 0, a cosine decay that reaches min_lr_ratio x
    # inner_lr at step decay_steps and stays there. All 0: a constant inner_lr.
    warmup_steps: int = 0
    decay_steps: int = 0
    min_lr_ratio: float = 0.1
    #: diloco: overlap each round's all-reduce with the next round's inner steps (its outer
    #: update lands one round late, the local progress made meanwhile carried onto it).
    overlap: bool = False
    #: diloco: sync the model in this many fragments, one every inner_steps / fragments steps.
    fragments: int = 1
    #: diloco: a replica that downloads the swarm's state (it missed a round, or its group
    #: averaged apart from the majority's) keeps the progress it has not averaged yet, moved
    #: onto the downloaded state and sent in its next round, if that progress is at most this
    #: many rounds stale: 1 when the download is of its own epoch, 2 when it missed one round.
    #: Staler progress (a long absence) is dropped; 0 always drops it. Overlap always keeps it.
    carry_epochs: int = CARRY_EPOCHS
    #: diloco: rounds in slots of this many seconds of the DHT clock (``averaging/slots.py``),
    #: instead of every inner_steps steps: each replica trains the inner steps that end before
    #: the next slot boundary (at least one) and is weighted by its samples, so a slower
    #: machine neither delays the round nor misses it, and one that restarted or resynced comes
    #: to the next round with the rest. A blocking round must end within three quarters of a
    #: slot. 0: every inner_steps steps. inner_steps still sets the learning rate schedule's
    #: steps per round.
    round_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.overlap and self.name != "diloco":
            raise RunSpecError("algorithm.overlap is for algorithm.name = 'diloco'")
        if self.fragments != 1 and self.name != "diloco":
            raise RunSpecError("algorithm.fragments is for algorithm.name = 'diloco'")
        if self.fragments < 1 or self.inner_steps % self.fragments:
            raise RunSpecError(
                f"algorithm.fragments ({self.fragments}) must be at least 1 and divide "
                f"algorithm.inner_steps ({self.inner_steps})"
            )
        if not (math.isfinite(self.round_seconds) and self.round_seconds >= 0):
            raise RunSpecError(f"algorithm.round_seconds must be >= 0, got {self.round_seconds}")
        if self.round_seconds and (self.name != "diloco" or self.fragments != 1):
            raise RunSpecError(
                "algorithm.round_seconds is for algorithm.name = 'diloco' without fragments "
                "(fragments take turns by steps)"
            )
        if self.round_seconds and self.round_seconds < shortest_slot():
            raise RunSpecError(
                f"algorithm.round_seconds ({self.round_seconds:g}) must be at least "
                f"{shortest_slot():.2f} s: a slot's round is cut only after its readiness "
                f"records had the slot's grace and {SETTLE_SECONDS:g} s to spread, and that "
                f"must come by three quarters of the slot"
            )
        if self.carry_epochs < 0:
            raise RunSpecError(f"algorithm.carry_epochs must be >= 0, got {self.carry_epochs}")
        if self.name not in ("diloco", "sync"):
            raise RunSpecError(f"algorithm.name must be 'diloco' or 'sync', got {self.name!r}")
        positive(
            "algorithm",
            inner_steps=self.inner_steps,
            inner_lr=self.inner_lr,
            outer_lr=self.outer_lr,
            target_batch_size=self.target_batch_size,
        )
        if not 0 <= self.outer_momentum < 1:
            raise RunSpecError(
                f"algorithm.outer_momentum must be in [0, 1), got {self.outer_momentum!r}"
            )
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise RunSpecError("algorithm.warmup_steps and algorithm.decay_steps must be >= 0")
        if self.decay_steps and self.decay_steps <= self.warmup_steps:
            raise RunSpecError(
                f"algorithm.decay_steps ({self.decay_steps}) must exceed algorithm.warmup_steps "
                f"({self.warmup_steps}): the decay follows the warm-up (0 turns it off)"
            )
        if not 0 < self.min_lr_ratio <= 1:
            raise RunSpecError(
                f"algorithm.min_lr_ratio must be in (0, 1], got {self.min_lr_ratio!r}"
            )

    def lr_at(self, step: int) -> float:
        """The inner learning rate for inner optimizer step ``step`` (0-based, whole run)."""
        if step < self.warmup_steps:
            return self.inner_lr * (step + 1) / self.warmup_steps
        if not self.decay_steps:
            return self.inner_lr
        done = min(1.0, (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
        floor = self.inner_lr * self.min_lr_ratio
        return floor + (self.inner_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * done))
