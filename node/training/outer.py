"""DiLoCo's outer loop on a flat parameter vector: pseudo-gradients and the Nesterov outer step.

After H inner steps a trainer's pseudo-gradient is ``theta_global - theta_local`` (plus what the
last rounds could not send). The group averages it; every member then applies the *same* outer
step to the *same* global parameters, so replicas stay bit-identical without ever sending weights:
the step is a fixed sequence of fp32 element-wise ops, each one correctly rounded (no fused
multiply-add, whose single rounding differs from a multiply then an add), so it gives the same bits
on every CPU and GPU: the outer state lives on the model's device.

Ranges a round could not average (``missing``) get no update: this member's own delta there is
kept as carry for the next round's pseudo-gradient. (Douillard et al., "DiLoCo", 2023; Nesterov
momentum as there.) Pure torch.
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

    def pseudo_gradient(self, theta_local: torch.Tensor, offset: int | None = None) -> torch.Tensor:
        """``theta_global - theta_local + carry``: this member's contribution to the round (with
        ``offset``: of the range of theta from there that ``theta_local`` covers, a fragment)."""
        whole = offset is None
        offset = offset or 0
        end = offset + theta_local.numel()
        if (whole and theta_local.shape != self.theta.shape) or not (
            theta_local.dim() == 1 and offset >= 0 and end <= self.theta.numel()
        ):
            raise ValueError(f"theta_local has shape {tuple(theta_local.shape)}")
        theta = self.theta[offset:end]
        return (theta - theta_local.detach().float()).add_(self.carry[offset:end])

    @property
    def device(self) -> torch.device:
        return self.theta.device

    def step(
        self,
        averaged: torch.Tensor,
        *,
        own: torch.Tensor,
        missing: Sequence[tuple[int, int]] = (),
        offset: int | None = None,
    ) -> torch.Tensor:
        """Apply the averaged pseudo-gradient; returns the new ``theta_global``.

        ``own`` is the pseudo-gradient this member contributed; in ``missing`` ranges it is kept
        as carry and nothing moves, elsewhere the carry is spent. Either may live on another
        device than theta (they are copied to it). With ``offset``, both cover the range of
        theta from there (a fragment), and only that range moves; ``missing`` is relative to it.
        """
        whole = offset is None
        offset = offset or 0
        end = offset + averaged.numel()
        if (
            averaged.shape != own.shape
            or (whole and averaged.shape != self.theta.shape)
            or not (averaged.dim() == 1 and offset >= 0 and end <= self.theta.numel())
        ):
            raise ValueError("averaged and own must have the shape of theta (or of a fragment)")
        gradient = averaged.detach().to(self.device, copy=True)
        carry, momentum_buffer = self.carry[offset:end], self.momentum_buffer[offset:end]
        carry.zero_()
        for start, stop in missing:
            carry[start:stop] = own[start:stop]
            gradient[start:stop] = 0.0
        # One rounding per operation (see the module docstring): no alpha= arguments, which a
        # device may compute as a fused multiply-add.
        velocity = torch.mul(momentum_buffer, self.momentum).add_(gradient)
        update = torch.mul(velocity, self.momentum).add_(gradient)  # Nesterov: g + mu * v
        for start, stop in missing:  # no movement, and no momentum drift, where nothing arrived
            velocity[start:stop] = momentum_buffer[start:stop]
            update[start:stop] = 0.0
        momentum_buffer.copy_(velocity)
        self.theta[offset:end].sub_(update.mul_(self.lr))
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
