"""Node processes for simulations: the command that starts one, and a graceful stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Protocol


class Child(Protocol):
    """A started process as a launcher holds it: ``subprocess.Popen``, or one the zygote forked."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


def node_command(*args: str) -> list[str]:
    """``swarmgrad <args>`` with this interpreter."""
    return [sys.executable, "-m", "swarmgrad.node.cli", *args]


def adversary_command(attack: str, *args: str) -> list[str]:
    """``swarmgrad <args>`` as a malicious peer making ``attack`` (``adversary.py``)."""
    return [sys.executable, "-m", "swarmgrad.simulations.adversary", "--attack", attack, *args]


def crashing_stage_command(forwards: int, *args: str) -> list[str]:
    """``swarmgrad <args>``, its stage server dying after ``forwards`` forwards (``faults.py``)."""
    module = "swarmgrad.simulations.faults"
    return [sys.executable, "-m", module, "--crash-after-forwards", str(forwards), *args]


def stop_gracefully(process: Child, timeout_seconds: float = 15.0) -> None:
    """SIGTERM (a node leaves gracefully), then SIGKILL its whole session if it is not gone
    within ``timeout_seconds``."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
