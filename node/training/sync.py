"""Synchronous data parallel: per-step gradient averaging toward a target global batch (the
reference algorithm, in the manner of hivemind's Optimizer)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from swarmgrad.node.averaging.rounds import Outcome
from swarmgrad.node.kinds import RoundOutcome
from swarmgrad.node.swarm import Swarm
from swarmgrad.node.training.model import flatten, unflatten
from swarmgrad.node.training.replica import Replica, RoundReport


class SyncDataParallel(Replica):
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
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                for p in self.params
            ]
        ).div_(self._micro_batches)
        weight = self.samples
        averaged = self._average(gradient)
        if averaged.outcome is Outcome.AVERAGED:
            assert averaged.result is not None
            assert averaged.sent is not None
            mean, sent = averaged.result.averaged.to(self.device), averaged.sent.to(self.device)
            for start, end in averaged.result.missing:  # not averaged: keep it for next time
                self._residual[start:end] += sent[start:end]
                mean[start:end] = 0.0
            self._apply(mean)
            return self._report(averaged, started, weight=weight)
        if self.samples >= self.target_batch_size:  # the whole global batch is ours alone
            self._apply(gradient)
            return RoundReport(
                epoch=self.epoch,
                outcome=RoundOutcome.ALONE,
                group_size=1,
                seconds=0.0,
                detail=averaged.error,
            )
        return self._report(averaged, started, weight=weight)

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
