"""A node whose start stalls writes every thread's stack into its log, once (``node/main.py``):
the intermittent start stall seen in CI logged nothing after the peer id for 180 s."""

from __future__ import annotations

import time

import pytest

from swarmgrad.node import main


def test_a_stalled_start_leaves_every_threads_stack_in_the_log(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(main, "START_STALL_SECONDS", 0.2)
    err = ""
    with main._stall_report():
        deadline = time.monotonic() + 30.0
        while "most recent call first" not in err and time.monotonic() < deadline:
            time.sleep(0.05)  # the stalled start, until its stacks are out (or 30 s)
            err += capfd.readouterr().err
        time.sleep(0.5)  # two more deadlines' worth: nothing more is written
    err += capfd.readouterr().err
    assert "most recent call first" in err
    assert "test_a_stalled_start_leaves_every_threads_stack_in_the_log" in err  # where it stood
    assert err.count("Timeout (") == 1  # once, not every 0.2 s


def test_a_start_in_time_leaves_nothing(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(main, "START_STALL_SECONDS", 0.3)
    with main._stall_report():
        time.sleep(0.05)
    time.sleep(0.5)  # past the stall's deadline: it was cancelled when the start ended
    assert "Timeout (" not in capfd.readouterr().err
