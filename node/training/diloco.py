"""DiLoCo: the replica a trainer drives (:class:`DiLoCo`), and its outer loop on a flat
parameter vector (:class:`OuterOptimizer`: pseudo-gradients and the Nesterov outer step).

After H inner steps a trainer's pseudo-gradient is ``theta_global - theta_local`` (plus what the
last rounds could not send). The group averages it; every member then applies the *same* outer
step to the *same* global parameters, so replicas stay bit-identical without ever sending weights:
the step is a fixed sequence of fp32 element-wise ops, each one correctly rounded (no fused
multiply-add, whose single rounding differs from a multiply then an add), so it gives the same bits
on every CPU and GPU: the outer state lives on the model's device.

Ranges a round could not average (a dead owner's part, ``RoundResult.missing``) get no update:
each member's own delta there is carried into the next round's pseudo-gradient, so no training
is lost and no replica moves alone. (Douillard et al., "DiLoCo", 2023; Nesterov momentum as there.)
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from swarmgrad.node.averaging.rounds import Outcome
from swarmgrad.node.swarm import Swarm
from swarmgrad.node.training.model import flatten, unflatten
from swarmgrad.node.training.replica import Replica, RoundReport


class OuterOptimizer:
    """Holds ``theta_global`` (fp32, flat) and the Nesterov momentum buffer."""

    def __init__(self, theta_global: torch.Tensor, *, lr: float, momentum: float) -> None:
        if theta_global.dim() != 1 or theta_global.dtype != torch.float32:
            raise ValueError("theta_global must be a flat float32 tensor")
        if not lr > 0 or not 0 <= momentum < 1:
            raise ValueError(f"need lr > 0 and momentum in [0, 1), got {lr}, {momentum}")
        self.theta = theta_global.detach().clone()
        self.momentum_buffer = torch.zeros_like(self.theta)
        self.lr, self.momentum = lr, momentum
        #: What earlier rounds could not average, added to the next pseudo-gradient.
        self.carry = torch.zeros_like(self.theta)

    def pseudo_gradient(self, theta_local: torch.Tensor) -> torch.Tensor:
        """``theta_global - theta_local + carry``: this member's contribution to the round."""
        if theta_local.shape != self.theta.shape:
            raise ValueError(f"theta_local has shape {tuple(theta_local.shape)}")
        return (self.theta - theta_local.detach().float()).add_(self.carry)

    @property
    def device(self) -> torch.device:
        return self.theta.device

    def step(
        self,
        averaged: torch.Tensor,
        *,
        own: torch.Tensor,
        missing: Sequence[tuple[int, int]] = (),
    ) -> torch.Tensor:
        """Apply the averaged pseudo-gradient; returns the new ``theta_global``.

        ``own`` is the pseudo-gradient this member contributed; in ``missing`` ranges it is kept
        as carry and nothing moves, elsewhere the carry is spent. Either may live on another
        device than theta (they are copied to it).
        """
        if averaged.shape != self.theta.shape or own.shape != self.theta.shape:
            raise ValueError("averaged and own must have the shape of theta")
        gradient = averaged.detach().to(self.device, copy=True)
        self.carry.zero_()
        for start, end in missing:
            self.carry[start:end] = own[start:end]
            gradient[start:end] = 0.0
        # One rounding per operation (see the module docstring): no alpha= arguments, which a
        # device may compute as a fused multiply-add.
        velocity = torch.mul(self.momentum_buffer, self.momentum).add_(gradient)
        update = torch.mul(velocity, self.momentum).add_(gradient)  # Nesterov: g + mu * v
        for start, end in missing:  # no movement, and no momentum drift, where nothing arrived
            velocity[start:end] = self.momentum_buffer[start:end]
            update[start:end] = 0.0
        self.momentum_buffer = velocity
        self.theta.sub_(update.mul_(self.lr))
        return self.theta

    def checksum(self) -> str:
        """A cheap fingerprint of ``theta_global`` for replicas to compare (in peer records)."""
        return hashlib.blake2b(self.theta.cpu().numpy().tobytes(), digest_size=8).hexdigest()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The state on the CPU (for checkpoints and peers)."""
        return {
            "theta": self.theta.cpu().clone(),
            "momentum_buffer": self.momentum_buffer.cpu().clone(),
            "carry": self.carry.cpu().clone(),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take ``state`` (on any device) onto this optimizer's device."""
        for name in ("theta", "momentum_buffer", "carry"):
            if state[name].shape != self.theta.shape or state[name].dtype != torch.float32:
                raise ValueError(f"{name} in the state does not match the model")
        device = self.device
        self.theta = state["theta"].to(device, copy=True)
        self.momentum_buffer = state["momentum_buffer"].to(device, copy=True)
        self.carry = state["carry"].to(device, copy=True)


class DiLoCo(Replica):
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
            {"theta": theta, "momentum_buffer": momentum, "carry": torch.zeros_like(theta)}
        )
        unflatten(self.outer.theta, self.params)

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        outer = self.outer.state_dict()
        return (
            self._named("model", outer["theta"])  # the swarm's parameters
            | self._named("local", flatten(self.params))  # this replica's, mid-round
            | {"outer.momentum_buffer": outer["momentum_buffer"], "outer.carry": outer["carry"]}
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
