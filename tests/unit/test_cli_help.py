"""What a volunteer reads in ``--help``: choices listed where a value must be one of a few, no
type shown for a flag, defaults written one way, and the lists the same as the configuration
checks."""

from __future__ import annotations

from typing import Any, get_args

import pytest
import typer
from typer.testing import CliRunner

from swarmgrad.node.cli import app
from swarmgrad.node.cli_common import Display
from swarmgrad.node.config import DISPLAYS
from swarmgrad.node.discovery.base import BACKENDS
from swarmgrad.node.runspec import RunSpec, RunSpecError
from swarmgrad.node.runspec.operational import SWITCH
from swarmgrad.simulations.launchers import LAUNCHERS

COMMANDS = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def test_the_help_lists_are_the_configurations_lists() -> None:
    assert get_args(Display) == DISPLAYS
    assert BACKENDS == ("hivemind", "libp2p")
    for value in SWITCH:
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
        ("device", ("auto", "cpu", "cuda")),
        ("engine", ("processes", "des")),
        ("launcher", LAUNCHERS),
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


def test_every_node_setting_is_an_option_with_its_default_and_its_choices() -> None:
    # One place: a [node] field's default, help, panel and choices make its option.
    import dataclasses

    from swarmgrad.node.runspec.operational import NodeSection

    shown = _cells(CliRunner().invoke(app, ["node", "--help"], terminal_width=80).output)
    for setting in dataclasses.fields(NodeSection):
        flag = "--" + setting.name.replace("_", "-")
        assert flag in shown, flag
        default = setting.default if setting.default != "" else "unset"
        assert f"[{default}]." in shown, (flag, default)
        if setting.metadata["choices"]:
            assert "<" + "|".join(setting.metadata["choices"]) + ">" in shown, flag


def test_a_node_setting_given_as_an_option_reaches_the_node_and_wrong_ones_are_refused(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from swarmgrad.node import config as node_config

    seen: dict[str, Any] = {}

    def configured(*, spec_path: Any, cli: Any) -> Any:
        seen.update(cli.settings)
        raise node_config.ConfigError("stop here")

    monkeypatch.setattr(node_config, "node_config", configured)
    (tmp_path / "run.toml").write_text('[run]\nid = "x"\n')
    spec = str(tmp_path / "run.toml")
    given = CliRunner().invoke(app, ["node", spec, "--keep-checkpoints", "7", "--device", "cpu"])
    assert given.exit_code == 2
    assert "stop here" in given.output
    assert (seen["keep_checkpoints"], seen["device"], seen["host"]) == (7, "cpu", None)
    refused = CliRunner().invoke(app, ["node", spec, "--device", "gpu"])
    assert refused.exit_code == 2
    assert "'gpu'isnotoneof'auto','cpu','cuda'" in _cells(refused.output)
