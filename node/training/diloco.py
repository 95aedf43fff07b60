"""DiLoCo's outer loop on a flat parameter vector: pseudo-gradients and the Nesterov outer step.

After H inner steps a trainer's pseudo-gradient is ``theta_global - theta_local`` (plus what the
last rounds could not send). The group averages it; every member then applies the *same* outer
step to the *same* global parameters, so replicas stay bit-identical without ever sending weights:
the step is a fixed sequence of fp32 element-wise ops, deterministic on every CPU and GPU.

Ranges a round could not average (a dead owner's part, ``RoundResult.missing``) get no update:
each member's own delta there is carried into the next round's pseudo-gradient, so no training
is lost and no replica moves alone. (Douillard et al., "DiLoCo", 2023; Nesterov momentum as there.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch


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

    def step(
        self,
        averaged: torch.Tensor,
        *,
        own: torch.Tensor,
        missing: Sequence[tuple[int, int]] = (),
    ) -> torch.Tensor:
        """Apply the averaged pseudo-gradient; returns the new ``theta_global``.

        ``own`` is the pseudo-gradient this member contributed; in ``missing`` ranges it is kept
        as carry and nothing moves, elsewhere the carry is spent.
        """
        if averaged.shape != self.theta.shape or own.shape != self.theta.shape:
            raise ValueError("averaged and own must have the shape of theta")
        gradient = averaged.detach().clone()
        self.carry.zero_()
        for start, end in missing:
            self.carry[start:end] = own[start:end]
            gradient[start:end] = 0.0
        velocity = self.momentum_buffer.mul(self.momentum).add_(gradient)
        update = gradient.add_(velocity, alpha=self.momentum)  # Nesterov: g + mu * v
        for start, end in missing:  # no movement, and no momentum drift, where nothing arrived
            velocity[start:end] = self.momentum_buffer[start:end]
            update[start:end] = 0.0
        self.momentum_buffer = velocity
        self.theta.sub_(update, alpha=self.lr)
        return self.theta

    def checksum(self) -> str:
        """A cheap fingerprint of ``theta_global`` for replicas to compare (in peer records)."""
        return hashlib.blake2b(self.theta.numpy().tobytes(), digest_size=8).hexdigest()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "theta": self.theta.clone(),
            "momentum_buffer": self.momentum_buffer.clone(),
            "carry": self.carry.clone(),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name in ("theta", "momentum_buffer", "carry"):
            if state[name].shape != self.theta.shape or state[name].dtype != torch.float32:
                raise ValueError(f"{name} in the state does not match the model")
        self.theta = state["theta"].clone()
        self.momentum_buffer = state["momentum_buffer"].clone()
        self.carry = state["carry"].clone()
