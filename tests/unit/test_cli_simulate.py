"""``swarmgrad simulate``'s options are ``SimulateOptions``' fields (help, default, choices written
once), each reaches the engine it is for, and options that do not go together are refused by
their flags before anything starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from swarmgrad.node.cli import app
from swarmgrad.simulations import pipeline, swarm
from swarmgrad.simulations.des import driver
from swarmgrad.simulations.simulate_options import SimulateOptions


def _stub_engines(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Every engine's entry point replaced by one that keeps the configuration it was given
    (under "config" in the dict returned) and runs nothing."""
    seen: dict[str, Any] = {}

    def run(config: Any) -> dict[str, Any]:
        seen["config"] = config
        raise typer.Exit(0)

    for module, name in ((swarm, "simulate"), (driver, "run"), (pipeline, "simulate_pipeline")):
        monkeypatch.setattr(module, name, run)
    return seen


def test_every_option_is_a_field_with_its_help_and_default() -> None:
    command = typer.main.get_command(app).commands["simulate"]  # type: ignore[attr-defined]
    params = {p.name: p for p in command.params if p.name != "help"}
    fields = {SimulateOptions.option_name(f): f for f in dataclasses.fields(SimulateOptions)}
    assert params.keys() == fields.keys()
    for name, setting in fields.items():
        assert params[name].help == setting.metadata["help"], name
        assert params[name].default == setting.default, name
    # The processes engine's and the pipeline's own defaults are the command's.
    ours = {f.name: f.default for f in dataclasses.fields(SimulateOptions)}
    for engine in (swarm.SimulationConfig, pipeline.PipelineSimulation):
        theirs = {f.name: f.default for f in dataclasses.fields(engine)}  # type: ignore[arg-type]
        for name in ("timeout_seconds", "discovery", "fork_nodes"):
            assert theirs[name] == ours[name], (engine, name)


def test_each_option_reaches_its_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _stub_engines(monkeypatch)
    out = str(tmp_path / "out")
    runner = CliRunner()

    given = runner.invoke(app, ["simulate", "--nodes", "3", "--rounds", "2", "--timeout", "5",
                                "--seed", "9", "--no-fork-nodes", "--discovery", "libp2p",
                                "--out", out])  # fmt: skip
    assert given.exit_code == 0, given.output
    config = seen.pop("config")
    assert isinstance(config, swarm.SimulationConfig)
    assert (config.nodes, config.rounds, config.timeout_seconds, config.seed) == (3, 2, 5.0, 9)
    assert (config.fork_nodes, config.discovery, config.out_dir) == (False, "libp2p", Path(out))

    des = ["--engine", "des", "--nodes", "40", "--step-seconds", "0.02", "--codec-rate", "4e8"]
    given = runner.invoke(app, ["simulate", *des, "--out", out])
    assert given.exit_code == 0, given.output
    config = seen.pop("config")
    assert isinstance(config, driver.DesConfig)
    assert (config.nodes, config.step_seconds, config.codec_values_per_second) == (40, 0.02, 4e8)

    given = runner.invoke(app, ["simulate", "--stages", "2", "--trainers", "2", "--out", out])
    assert given.exit_code == 0, given.output
    config = seen.pop("config")
    assert isinstance(config, pipeline.PipelineSimulation)
    assert (config.stages, config.trainers, config.nodes) == (2, 2, 4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "des", "--netem"], "--engine des models the swarm: no --netem"),
        (["--engine", "des", "--ray-address", "h:1"], "no --netem, --launcher or Ray"),
        (["--codec-rate", "4e8"], "--step-seconds and --codec-rate are for --engine des"),
        (["--stages", "2", "--launcher", "ray"], "--stages runs local processes"),
        (["--stages", "2", "--engine", "des"], "--stages runs local processes"),
    ],
)
def test_options_that_do_not_go_together_are_refused_by_their_flags(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _stub_engines(monkeypatch)
    refused = CliRunner().invoke(app, ["simulate", *args])
    assert refused.exit_code == 2, refused.output
    assert message in " ".join(refused.output.split())
    assert seen == {}  # nothing started
