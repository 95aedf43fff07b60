"""What the trainer needs from its device: picking it, autocast, batches moved ahead of use, and
the peak throughput that MFU is measured against.

MFU (model FLOPs utilization) is ``6 x parameters x tokens/s`` over the device's dense bf16 peak:
the share of the chip's matrix throughput the training step turns into model arithmetic (forward
2 FLOPs per parameter per token, backward 4; attention's own FLOPs left out, as is usual).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

#: Dense bf16 tensor-core peaks from the vendors' datasheets, in TFLOP/s (no sparsity), matched
#: against the device's name in order (more specific names first).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
)


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is available")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on a GPU; full precision on a CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def peak_flops(device: torch.device, tflops: float = 0.0) -> float:
    """The device's dense bf16 peak in FLOP/s: ``tflops`` if given, else the datasheet figure of
    a known GPU, else NaN (no MFU is reported for CPUs and unknown devices)."""
    if tflops > 0:
        return tflops * 1e12
    if device.type != "cuda":
        return math.nan
    name = torch.cuda.get_device_name(device)
    for pattern, peak in PEAK_BF16_TFLOPS:
        if pattern in name:
            return peak * 1e12
    return math.nan


def model_flops_utilization(parameters: int, tokens_per_second: float, peak: float) -> float:
    """``6 x parameters x tokens/s / peak`` (NaN when the peak is unknown)."""
    return 6.0 * parameters * tokens_per_second / peak


class Prefetched:
    """Batches moved to the device one step ahead: the next batch is drawn, pinned and its copy
    queued (non-blocking) before the current one is used, so drawing and copying overlap the
    GPU's work on the step before. ``cursor`` counts the batches handed out (what a checkpoint
    resumes from), not the one drawn ahead. On a CPU it hands batches through as they come."""

    def __init__(
        self,
        batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        *,
        cursor: int = 0,
    ) -> None:
        self._batches, self.device = batches, device
        self._ahead: tuple[torch.Tensor, torch.Tensor] | None = None
        #: Batches handed out, counting the ``cursor`` the source had already drawn.
        self.cursor = cursor

    def _draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = next(self._batches)
        if self.device.type != "cuda":
            return inputs, targets
        return (
            inputs.pin_memory().to(self.device, non_blocking=True),
            targets.pin_memory().to(self.device, non_blocking=True),
        )

    def __iter__(self) -> Prefetched:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self._ahead if self._ahead is not None else self._draw()
        self._ahead = self._draw() if self.device.type == "cuda" else None
        self.cursor += 1
        return batch
