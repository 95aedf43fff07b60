"""What a volunteer reads in ``--help``: choices listed where a value must be one of a few, no
type shown for a flag, defaults written one way, and the lists the same as the configuration
checks."""

from __future__ import annotations

from typing import get_args

import pytest
import typer
from typer.testing import CliRunner

from swarmgrad.node.cli import app
from swarmgrad.node.cli_common import Display, OnOff
from swarmgrad.node.config import DISPLAYS
from swarmgrad.node.discovery.base import BACKENDS
from swarmgrad.node.runspec import RunSpec, RunSpecError

COMMANDS = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def test_the_help_lists_are_the_configurations_lists() -> None:
    assert get_args(Display) == DISPLAYS
    assert BACKENDS == ("hivemind", "libp2p")
    for value in get_args(OnOff):
        RunSpec.from_toml(f'[run]\nid = "x"\n[node]\ncompile = "{value}"\n')
    with pytest.raises(RunSpecError):
        RunSpec.from_toml('[run]\nid = "x"\n[node]\ncompile = "yes"\n')


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_choices_not_free_text_and_no_type_for_a_flag(command: str) -> None:
    shown = CliRunner().invoke(app, [command, "--help"], terminal_width=80)
    assert shown.exit_code == 0, shown.output
    assert shown.output.count("<bool>") <= 1, shown.output  # --help's own, typer's to show
    assert "[default:" not in shown.output  # defaults one way: "[x]"
    names = {option.name for option in typer.main.get_command(app).commands[command].params}  # type: ignore[attr-defined]
    for name, choices in (
        ("discovery", BACKENDS),
        ("display", DISPLAYS),
        ("compile", ("off", "on")),
    ):
        if name in names:
            # (at 80 columns a long list may wrap inside its cell)
            assert f"<{'|'.join(choices)}>" in _cells(shown.output), (command, name)


def test_a_value_not_on_the_list_is_refused_by_name() -> None:
    refused = CliRunner().invoke(app, ["runs", "--discovery", "kademlia", "--bootstrap", "x"])
    assert refused.exit_code == 2
    said = " ".join(refused.output.replace("│", " ").split())
    assert "'kademlia' is not one of 'hivemind', 'libp2p'" in said


def _cells(output: str) -> str:
    """The help's text with the table's borders and every space and line break taken out."""
    return "".join(output.replace("│", " ").split())
