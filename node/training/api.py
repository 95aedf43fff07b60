"""The Python API for training in a swarm: wrap your model (and optimizer) and call ``step``.

Two algorithms, one shape of API, both driven from your own training loop in a worker thread
while the node's event loop serves peers::

    diloco = DiLoCo(swarm, model, inner_steps=50, outer_lr=0.7, outer_momentum=0.9)
    for inputs, targets in batches:             # your loop, your inner optimizer
        model.loss(inputs, targets).backward()
        inner.step(); inner.zero_grad()
        diloco.step(samples=len(inputs))        # every 50th call: one outer round with the group

    sync = SyncDataParallel(swarm, model, optimizer, target_batch_size=256)
    for inputs, targets in batches:
        model.loss(inputs, targets).backward()
        sync.step(samples=len(inputs))          # averages gradients, then optimizer.step()

Each replicated state (DiLoCo: the global parameters and the outer momentum; sync: the parameters
and the optimizer's state) is published after every round with its checksum; before a round a
replica that is behind the swarm, or holds a state fewer peers share, downloads the state from
peers instead (:meth:`Swarm.find_donors`). Lossy codecs get error feedback: what the codec drops
from a round's message is added to the next one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from swarmgrad.node.averaging.rounds import Averaged, Outcome
from swarmgrad.node.kinds import RoundOutcome
from swarmgrad.node.swarm import Swarm
from swarmgrad.node.training.diloco import OuterOptimizer
from swarmgrad.node.training.model import flatten, unflatten
from swarmgrad.protocol import state

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundReport:
    """What one round did, for displays, logs and tests."""

    epoch: int  # the epoch after the round
    outcome: RoundOutcome
    group_size: int
    seconds: float
    missing_values: int = 0
    detail: str = ""
    allreduce_seconds: float = 0.0  # the all-reduce alone (no matchmaking), when there was one


class _Replica:
    """The part both algorithms share: feedback, resync, publishing, reports."""

    def __init__(self, swarm: Swarm, model: nn.Module) -> None:
        self.swarm = swarm
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.numel = sum(p.numel() for p in self.params)
        self.epoch = 0
        self.samples = 0  # since the last round: this replica's weight in it
        self._residual = torch.zeros(self.numel)
        self._started = time.monotonic()
        self._samples_total = 0

    # -- what a subclass provides ---------------------------------------------------------------

    def state_vector(self) -> torch.Tensor:
        raise NotImplementedError

    def load_state_vector(self, values: torch.Tensor) -> None:
        raise NotImplementedError

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _load_state_tensors(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        raise NotImplementedError

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Everything needed to continue exactly from here: tensors (the replicated state as
        ``model.<parameter name>`` and the rest) and JSON-able counters."""
        tensors = self._state_tensors() | {"residual": self._residual}
        meta = {"epoch": self.epoch, "samples": self.samples, "samples_total": self._samples_total}
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`; ValueError if it is not this model's state."""
        residual = tensors.get("residual")
        if residual is None or residual.shape != (self.numel,):
            raise ValueError("the state's residual does not match the model")
        self._load_state_tensors(tensors, meta)
        self._residual = residual.float().clone()
        self.epoch, self.samples = int(meta["epoch"]), int(meta["samples"])
        self._samples_total = int(meta["samples_total"])
        self.publish()

    def _named(self, prefix: str, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        tensors, offset = {}, 0
        for name, p in zip(self.names, self.params, strict=True):
            tensors[f"{prefix}.{name}"] = vector[offset : offset + p.numel()].view(p.shape).clone()
            offset += p.numel()
        return tensors

    def _unnamed(self, prefix: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = []
        for name, p in zip(self.names, self.params, strict=True):
            t = tensors.get(f"{prefix}.{name}")
            if t is None or t.shape != p.shape:
                raise ValueError(f"{prefix}.{name} is missing from the state or has another shape")
            parts.append(t.reshape(-1).float())
        return torch.cat(parts)

    def catch_up(self) -> RoundReport | None:
        """Download the swarm's state now if this replica is behind it or diverged (a node that
        joins, or resumes an old checkpoint, need not train a round it would throw away)."""
        return self._resync_if_needed()

    # -- shared ---------------------------------------------------------------------------------

    def publish(self) -> None:
        values = self.state_vector()
        elapsed = max(time.monotonic() - self._started, 1e-9)
        self.swarm.publish(
            state.Snapshot.of(self.epoch, values), throughput=self._samples_total / elapsed
        )

    def _resync_if_needed(self) -> RoundReport | None:
        started = time.monotonic()
        snapshot = self.swarm.snapshot
        assert snapshot is not None  # published since construction
        donors = self.swarm.call(self.swarm.find_donors(self.epoch, snapshot.checksum))
        if not donors:
            return None
        downloaded = self.swarm.call(self.swarm.download_state(donors, snapshot.values.numel()))
        if downloaded is None:
            return None  # counted by the swarm; try again next round
        log.info(
            "resynced from %d donor(s): epoch %d -> %d, dropped %d local samples",
            len(donors),
            self.epoch,
            downloaded.epoch,
            self.samples,
        )
        self.load_state_vector(downloaded.values)
        self.epoch = downloaded.epoch
        self.samples = 0
        self._residual.zero_()
        self.publish()
        return RoundReport(
            epoch=self.epoch,
            outcome=RoundOutcome.RESYNCED,
            group_size=0,
            seconds=time.monotonic() - started,
            detail=f"from {', '.join(d.peer_id for d in donors)}",
        )

    def _average(self, vector: torch.Tensor) -> Averaged:
        """One round of ``vector`` plus the error-feedback residual. The residual moves on only
        if the round applied what was sent (a round that fails, or a stop mid-round, leaves the
        state as it was before): it becomes what the codec lost of what was sent (and, whatever
        the codec, values a round could not average are carried by the caller)."""
        compensated = vector + self._residual
        lossless = self.swarm.codec_is_lossless
        averaged = self.swarm.call(
            self.swarm.average(
                compensated, epoch=self.epoch, weight=self.samples, keep_sent=not lossless
            )
        )
        if averaged.outcome is Outcome.AVERAGED:
            assert averaged.sent is not None
            self._residual = compensated - averaged.sent
        return averaged

    def _report(self, averaged: Averaged, started: float) -> RoundReport:
        result = averaged.result
        missing = sum(end - start for start, end in result.missing) if result else 0
        outcome = averaged.outcome
        if result is not None and not result.complete:
            outcome = RoundOutcome.PARTIAL
        return RoundReport(
            epoch=self.epoch,
            outcome=outcome,
            group_size=len(averaged.group.members) if averaged.group else 1,
            seconds=time.monotonic() - started,
            missing_values=missing,
            detail=averaged.error,
            allreduce_seconds=averaged.seconds,
        )


class DiLoCo(_Replica):
    """DiLoCo's outer loop around a model trained by any inner optimizer (Douillard et al. 2023).

    Every ``inner_steps`` calls of :meth:`step`, the pseudo-gradient (global minus local
    parameters) is averaged with a group, weighted by samples; every member applies the same
    Nesterov outer step and continues from the new global parameters. A replica that finds no
    group keeps training and tries again after the next ``inner_steps``.
    """

    def __init__(
        self,
        swarm: Swarm,
        model: nn.Module,
        *,
        inner_steps: int,
        outer_lr: float,
        outer_momentum: float,
    ) -> None:
        super().__init__(swarm, model)
        if inner_steps < 1:
            raise ValueError("inner_steps must be at least 1")
        self.inner_steps = inner_steps
        self.outer = OuterOptimizer(flatten(self.params), lr=outer_lr, momentum=outer_momentum)
        self._steps = 0
        self.publish()

    def state_vector(self) -> torch.Tensor:
        return torch.cat([self.outer.theta, self.outer.momentum_buffer])

    def load_state_vector(self, values: torch.Tensor) -> None:
        theta, momentum = values[: self.numel], values[self.numel :]
        self.outer.load_state_dict(
            {"theta": theta, "momentum_buffer": momentum, "carry": torch.zeros(self.numel)}
        )
        unflatten(self.outer.theta, self.params)

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        return (
            self._named("model", self.outer.theta)  # the swarm's parameters
            | self._named("local", flatten(self.params))  # this replica's, mid-round
            | {"outer.momentum_buffer": self.outer.momentum_buffer, "outer.carry": self.outer.carry}
        )

    def _load_state_tensors(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.outer.load_state_dict(
            {
                "theta": self._unnamed("model", tensors),
                "momentum_buffer": tensors["outer.momentum_buffer"],
                "carry": tensors["outer.carry"],
            }
        )
        unflatten(self._unnamed("local", tensors), self.params)
        self._steps = int(meta["steps"])

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, meta = super().state_dict()
        return tensors, meta | {"steps": self._steps}

    @property
    def schedule_step(self) -> int:
        """The next inner step's place in the run, for the learning-rate schedule: the same on
        every member (epoch x inner_steps + steps into this round), resumed or resynced."""
        return self.epoch * self.inner_steps + self._steps % self.inner_steps

    def step(self, samples: int) -> RoundReport | None:
        """Count one inner step of ``samples``; run an outer round when one is due."""
        self._steps += 1
        self.samples += samples
        self._samples_total += samples
        if self._steps % self.inner_steps:
            return None
        return self.outer_round()

    def outer_round(self) -> RoundReport:
        started = time.monotonic()
        resynced = self._resync_if_needed()
        if resynced is not None:
            return resynced
        delta = self.outer.pseudo_gradient(flatten(self.params))
        averaged = self._average(delta)
        if averaged.outcome is Outcome.AVERAGED:
            assert averaged.result is not None
            assert averaged.sent is not None
            theta = self.outer.step(
                averaged.result.averaged, own=averaged.sent, missing=averaged.result.missing
            )
            unflatten(theta, self.params)
            self.epoch += 1
            self.samples = 0
            self.publish()
        return self._report(averaged, started)


class SyncDataParallel(_Replica):
    """Per-step gradient averaging toward a target global batch (the reference algorithm).

    Call :meth:`step` after each ``backward()``. Gradients accumulate until this replica holds
    its share of ``target_batch_size`` (the target split over the group size); then the mean
    gradient is averaged with a group, weighted by samples, and every member applies the same
    optimizer step. A replica that finds no group accumulates on, and steps alone once it holds
    the whole target batch itself.
    """

    def __init__(
        self,
        swarm: Swarm,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        target_batch_size: int,
    ) -> None:
        super().__init__(swarm, model)
        self.optimizer = optimizer
        self.target_batch_size = target_batch_size
        self._micro_batches = 0
        self._prime_optimizer()
        self.publish()

    def _prime_optimizer(self) -> None:
        """Create the optimizer's state now (a zero-lr step on zero gradients), so it can be
        published and loaded before the first real step."""
        saved = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        return [
            value
            for p in self.params
            for _, value in sorted(self.optimizer.state[p].items())
            if isinstance(value, torch.Tensor) and value.is_floating_point()
        ]

    def state_vector(self) -> torch.Tensor:
        tensors = [p.detach() for p in self.params] + self._optimizer_tensors()
        return torch.cat([t.reshape(-1).float().cpu() for t in tensors])

    def load_state_vector(self, values: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for t in [p.data for p in self.params] + self._optimizer_tensors():
                t.copy_(values[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        # The optimizer's own state goes with the trainer's (it is the caller's optimizer);
        # gradients accumulated toward the next step go here.
        tensors = self._named("model", flatten(self.params))
        for name, p in zip(self.names, self.params, strict=True):
            if p.grad is not None:
                tensors[f"grad.{name}"] = p.grad.detach().float().cpu()
        return tensors

    def _load_state_tensors(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        unflatten(self._unnamed("model", tensors), self.params)
        for name, p in zip(self.names, self.params, strict=True):
            grad = tensors.get(f"grad.{name}")
            p.grad = None if grad is None else grad.to(p.device, p.dtype).view_as(p).clone()
        self._micro_batches = int(meta["micro_batches"])

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, meta = super().state_dict()
        return tensors, meta | {"micro_batches": self._micro_batches}

    @property
    def schedule_step(self) -> int:
        """The next optimizer step's place in the run: the global step, the same on every member."""
        return self.epoch

    def step(self, samples: int) -> RoundReport | None:
        """Count one backward pass over ``samples``; average and step when the batch is full."""
        self._micro_batches += 1
        self.samples += samples
        self._samples_total += samples
        share = self.target_batch_size / self.swarm.spec.averaging.group_size
        if self.samples < share:
            return None
        started = time.monotonic()
        resynced = self._resync_if_needed()
        if resynced is not None:
            self.optimizer.zero_grad(set_to_none=True)
            self._micro_batches = 0
            return resynced
        gradient = torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float().cpu()
                for p in self.params
            ]
        ).div_(self._micro_batches)
        averaged = self._average(gradient)
        if averaged.outcome is Outcome.AVERAGED:
            assert averaged.result is not None
            assert averaged.sent is not None
            mean = averaged.result.averaged
            for start, end in averaged.result.missing:  # not averaged: keep it for next time
                self._residual[start:end] += averaged.sent[start:end]
                mean[start:end] = 0.0
            self._apply(mean)
            return self._report(averaged, started)
        if self.samples >= self.target_batch_size:  # the whole global batch is ours alone
            self._apply(gradient)
            return RoundReport(
                epoch=self.epoch,
                outcome=RoundOutcome.ALONE,
                group_size=1,
                seconds=0.0,
                detail=averaged.error,
            )
        return self._report(averaged, started)

    def _apply(self, gradient: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            p.grad = gradient[offset : offset + p.numel()].view_as(p).to(p.device, p.dtype)
            offset += p.numel()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._micro_batches = 0
        self.samples = 0
        self.epoch += 1
        self.publish()
