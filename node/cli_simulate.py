"""``swarmgrad simulate``: a local swarm of node processes (or the discrete-event model of a
large one), with profiles, churn and shaped links. Its options are ``SimulateOptions``' fields
(``simulations/simulate_options.py``: help, defaults and choices written there once)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypedDict

import typer

from swarmgrad.node.cli_common import EXIT_CONFIG
from swarmgrad.node.cli_common import fail as _fail
from swarmgrad.node.cli_common import setup_logging as _logging
from swarmgrad.node.cli_settings import with_parameters
from swarmgrad.protocol.errors import SetupError
from swarmgrad.simulations.simulate_options import OptionsError, SimulateOptions


def _parameters() -> list[inspect.Parameter]:
    """One keyword parameter per field of ``SimulateOptions``, as typer reads a command's."""
    types = typing.get_type_hints(SimulateOptions)
    parameters = []
    for setting in dataclasses.fields(SimulateOptions):
        meta = setting.metadata
        # A switch shows no type; typer makes --x/--no-x of it.
        option = typer.Option(help=meta["help"], metavar="" if meta["flag"] else None)
        parameters.append(
            inspect.Parameter(
                SimulateOptions.option_name(setting),
                inspect.Parameter.KEYWORD_ONLY,
                default=setting.default,
                annotation=Annotated[types[setting.name], option],
            )
        )
    return parameters


def _with_options(command: Callable[[SimulateOptions], None]) -> Callable[..., None]:
    """``command`` (which takes the options whole) as a typer command with one option a field;
    options that do not go together are refused, by their flags, before it runs."""
    names = {
        SimulateOptions.option_name(setting): setting.name
        for setting in dataclasses.fields(SimulateOptions)
    }

    @functools.wraps(command)
    def wrapper(**given: Any) -> None:
        try:
            options = SimulateOptions(**{names[k]: v for k, v in given.items()})
        except OptionsError as error:
            raise _fail(EXIT_CONFIG, str(error)) from None
        command(options)

    return with_parameters(wrapper, _parameters())


@_with_options
def simulate(options: SimulateOptions) -> None:
    """Run a local swarm, real processes or the discrete-event model; print and save a
    summary."""
    from swarmgrad.simulations.profiles import SimulationError

    _logging(False)
    engine = _pipeline if options.stages else _des if options.engine == "des" else _processes
    try:
        summary, show = engine(options)
    except (SetupError, SimulationError) as error:
        raise _fail(EXIT_CONFIG, str(error)) from None
    show(summary)
    raise typer.Exit(0 if summary["ok"] else 1)


#: What an engine returns: its summary, and how to print it.
Ran = tuple[dict[str, Any], Callable[[dict[str, Any]], None]]


class _Shared(TypedDict):
    """What every engine's configuration takes from the options alike (typed: mypy checks each
    configuration's keyword arguments against it)."""

    nodes: int
    rounds: int
    out_dir: Path
    spec_path: Path | None
    profile_path: Path | None
    churn_path: Path | None


def _shared(options: SimulateOptions) -> _Shared:
    return _Shared(
        nodes=options.nodes,
        rounds=options.rounds,
        out_dir=options.out_dir,
        spec_path=options.spec_path,
        profile_path=options.profile_path,
        churn_path=options.churn_path,
    )


def _pipeline(options: SimulateOptions) -> Ran:
    from swarmgrad.simulations import pipeline

    config = pipeline.PipelineSimulation(
        **_shared(options),
        stages=options.stages,
        trainers=options.trainers,
        seed=options.seed or 0,
        timeout_seconds=options.timeout_seconds,
        discovery=options.discovery,
        fork_nodes=options.fork_nodes,
    )
    return pipeline.simulate_pipeline(config), pipeline.print_pipeline_summary


def _des(options: SimulateOptions) -> Ran:
    from swarmgrad.simulations.des import driver
    from swarmgrad.simulations.summary import print_summary

    config = driver.DesConfig(
        **_shared(options),
        seed=options.seed or 0,
        step_seconds=options.step_seconds,
        codec_values_per_second=options.codec_values_per_second,
    )
    return driver.run(config), print_summary


def _processes(options: SimulateOptions) -> Ran:
    from swarmgrad.simulations import swarm
    from swarmgrad.simulations.summary import print_summary

    config = swarm.SimulationConfig(
        **_shared(options),
        timeout_seconds=options.timeout_seconds,
        discovery=options.discovery,
        seed=options.seed,
        netem=options.netem,
        launcher=options.launcher,
        ray_address=options.ray_address,
        fork_nodes=options.fork_nodes,
    )
    return swarm.simulate(config), print_summary
