"""The fault plans that simulations put into node processes from outside (``faults.py``)."""

from __future__ import annotations

import sys

import pytest

from swarmgrad.simulations import faults
from swarmgrad.simulations.processes import crashing_stage_command


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--crash-after-forwards", "4"],  # and no command
        ["--crash-after-forwards", "four", "node", "run.toml"],
        ["--crash-after", "4", "node", "run.toml"],
    ],
)
def test_a_fault_plan_with_bad_arguments_says_how_to_use_it(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["faults", *argv])
    with pytest.raises(SystemExit) as exited:
        faults.main()
    assert exited.value.code == faults.USAGE


def test_a_crash_plan_needs_a_forward_to_crash_after() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        faults.crash_after_forwards(0)
    command = crashing_stage_command(4, "node", "run.toml", "--stage", "2")
    assert command[1:] == [
        "-m",
        "swarmgrad.simulations.faults",
        "--crash-after-forwards",
        "4",
        "node",
        "run.toml",
        "--stage",
        "2",
    ]
