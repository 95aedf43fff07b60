"""One inner training step as a node runs it, the learning rate it runs at, and the validation
loss (``evaluate``): shared by the trainer, a pipeline stage, the baselines and benchmarks."""

from __future__ import annotations

import torch

from swarmgrad.node.training.device import (
    autocast,
)
from swarmgrad.node.training.model import CausalLM


@torch.no_grad()
def evaluate(model: CausalLM, windows: torch.Tensor, device: torch.device) -> float:
    model.eval()
    windows = windows.to(device)
    with autocast(device):
        loss = model.loss(windows[:, :-1], windows[:, 1:])
    model.train()
    return float(loss)


class InnerStep:
    """One inner training step as the trainer runs it, with no host sync: bf16 autocast on a GPU,
    the forward and loss compiled on request (the model itself stays a plain module: replicas,
    checkpoints and evaluation see its parameters), backward, and (DiLoCo) the optimizer's step.
    Returns the loss, detached, still on the device. ``benchmarks/gpu.py`` times this very code.
    """

    def __init__(
        self,
        model: CausalLM,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        compile: bool = False,
        optimizer_steps: bool = True,
    ) -> None:
        self.optimizer, self.device, self.optimizer_steps = optimizer, device, optimizer_steps
        self._loss = torch.compile(model.loss) if compile else model.loss

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with autocast(self.device):
            loss = self._loss(inputs, targets)
        loss.backward()  # type: ignore[no-untyped-call]
        if self.optimizer_steps:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
