"""Faults put into a real node process from outside, for tests and benchmarks: ``python -m
swarmgrad.simulations.faults --crash-after-forwards N node ...`` is the node (``swarmgrad node
...``), whose pipeline stage server dies by SIGKILL once it has answered ``N`` forwards: at the
next forward or backward it is asked for (those forwards' replies have left, and it holds their
inputs), or a second later if none comes. That is a crash between a forward and its backward,
the case a trainer's failover must survive. Nothing in the node knows of it (the adversary's
attacks come in the same way: ``adversary.py``). Not for real runs."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import torch

from swarmgrad.node import cli
from swarmgrad.node.pipeline.worker import StageWorker
from swarmgrad.protocol.stage import Computed, Microbatch

log = logging.getLogger(__name__)
USAGE = "usage: python -m swarmgrad.simulations.faults --crash-after-forwards N node ..."


def crash_after_forwards(forwards: int) -> None:
    """Make this process's stage workers die after ``forwards`` forwards (all of them together:
    a stage server serves one stage)."""
    if forwards < 1:
        raise ValueError(f"--crash-after-forwards must be at least 1, not {forwards}")
    left = [forwards]
    honest_forward, honest_backward = StageWorker.forward, StageWorker.backward

    def die_if_done() -> None:
        if left[0] <= 0:
            log.warning("fault injection: killing this stage server (SIGKILL)")
            os.kill(os.getpid(), signal.SIGKILL)

    async def forward(self: StageWorker, mb: Microbatch, inputs: torch.Tensor) -> Computed:
        die_if_done()
        result = await honest_forward(self, mb, inputs)
        left[0] -= 1
        if left[0] <= 0:
            asyncio.get_running_loop().call_later(1.0, die_if_done)
        return result

    async def backward(
        self: StageWorker,
        mb: Microbatch,
        version: int,
        grad_outputs: torch.Tensor,
        inputs: torch.Tensor | None,
    ) -> Computed:
        die_if_done()
        return await honest_backward(self, mb, version, grad_outputs, inputs)

    StageWorker.forward = forward  # type: ignore[method-assign]
    StageWorker.backward = backward  # type: ignore[method-assign]


def main() -> None:
    argv = sys.argv[1:]
    if len(argv) < 3 or argv[0] != "--crash-after-forwards" or not argv[1].isdigit():
        sys.exit(USAGE)
    try:
        crash_after_forwards(int(argv[1]))
    except ValueError as error:
        sys.exit(str(error))
    sys.argv = [sys.argv[0], *argv[2:]]
    cli.main()


if __name__ == "__main__":
    main()
