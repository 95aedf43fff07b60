"""A node whose start stalls writes every thread's stack into its log, once (``node/main.py``):
the intermittent start stall seen in CI logged nothing after the peer id for 180 s."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from swarmgrad.node import main

#: A node process whose start stalls for 3 s, its stall report due after 0.2 s.
STALLED = """
import time
from swarmgrad.node import main
main.START_STALL_SECONDS = 0.2
with main._stall_report():
    time.sleep(3.0)  # the stalled start
"""


def test_a_stalled_start_leaves_every_threads_stack_in_the_log() -> None:
    # In a process of its own, its stderr read whole once it has exited: the report is written
    # by faulthandler's thread, and reading a captured stderr while it writes can lose a part.
    stalled = subprocess.run(
        [sys.executable, "-c", STALLED], capture_output=True, text=True, timeout=120
    )
    assert stalled.returncode == 0, stalled.stderr[-2000:]
    err = stalled.stderr
    assert "most recent call first" in err
    stood = next(i for i, line in enumerate(STALLED.splitlines(), 1) if "stalled start" in line)
    assert f'File "<string>", line {stood}' in err  # where it stood: in the stalled start
    assert err.count("Timeout (") == 1  # once, not every 0.2 s


def test_a_start_in_time_leaves_nothing(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(main, "START_STALL_SECONDS", 0.3)
    with main._stall_report():
        time.sleep(0.05)
    time.sleep(0.5)  # past the stall's deadline: it was cancelled when the start ended
    assert "Timeout (" not in capfd.readouterr().err
