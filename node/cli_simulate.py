"""``swarmgrad simulate``: a local swarm of node processes (or the discrete-event model of a
large one), with profiles, churn and shaped links."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from swarmgrad.node.cli_common import EXIT_CONFIG, Backend
from swarmgrad.node.cli_common import fail as _fail
from swarmgrad.node.cli_common import setup_logging as _logging
from swarmgrad.protocol.errors import SetupError


def simulate(
    nodes: Annotated[int, typer.Option(help="Number of node processes.")] = 4,
    rounds: Annotated[int, typer.Option(help="Outer rounds (epochs) to train.")] = 10,
    spec: Annotated[
        Path | None, typer.Option(help="Run spec (default: the demo spec, saved in --out).")
    ] = None,
    profile: Annotated[
        Path | None,
        typer.Option(
            help="TOML, one \\[\\[peer]] table each (cycled over the nodes): slowdown, bandwidth, "
            "upload_bytes_per_second, download_bytes_per_second, latency_ms, jitter_ms, loss, nat, "
            "session_seconds, offline_seconds, attack."
        ),
    ] = None,
    out: Annotated[
        Path, typer.Option(help="Folder for logs, status files and summary.json.")
    ] = Path("simulation"),
    churn: Annotated[
        Path | None,
        typer.Option(
            help="TOML, one \\[\\[event]] each: at_epoch, node, action (kill, stop, start, pause, "
            "resume, partition, heal; real processes partition only with --netem; --stages: "
            "kill, stop, start), and for a kill optionally during (round or state_download)."
        ),
    ] = None,
    discovery: Annotated[
        Backend,
        typer.Option(help="DHT backend of the bootstrap and the nodes: hivemind or libp2p."),
    ] = "hivemind",
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 600.0,
    seed: Annotated[
        int | None,
        typer.Option(
            help="Derive node i's key (and so its data stream) from this seed and i, so a rerun "
            "sees the same data, and draw the profiles' distributions with it. The keys are "
            "predictable: for experiments only."
        ),
    ] = None,
    engine: Annotated[
        Literal["processes", "des"],
        typer.Option(
            help="processes: real node processes on loopback; des: the discrete-event model "
            "(thousands of peers in seconds, no training: times, bytes and rounds)."
        ),
    ] = "processes",
    netem: Annotated[
        bool,
        typer.Option(
            metavar="",
            help="processes: each node in its own network namespace, links shaped by tbf and "
            "nftables from its profile, partition/heal in the churn schedule (root).",
        ),
    ] = False,
    launcher: Annotated[
        Literal["local", "ray"],
        typer.Option(
            help="processes: local (children of this one) or ray (actors on a Ray cluster; "
            "the output folder on storage every machine sees)."
        ),
    ] = "local",
    ray_address: Annotated[
        str,
        typer.Option(
            help="--launcher ray: the cluster to join (ray://... or host:port); "
            "empty: a local Ray head."
        ),
    ] = "",
    step_seconds: Annotated[
        float | None,
        typer.Option(
            help="des: one inner step's seconds at slowdown 1 (default: timed here, 1 thread)."
        ),
    ] = None,
    codec_rate: Annotated[
        float | None,
        typer.Option(
            help="des: values/s the run's codec encodes and decodes (default: measured here); "
            "with --step-seconds and --seed, runs repeat exactly on any machine."
        ),
    ] = None,
    stages: Annotated[
        int,
        typer.Option(
            help="processes: a pipeline of this many stages: --nodes stage servers (node i "
            "serves stage i mod S) and --trainers trainers; rounds are round barriers."
        ),
    ] = 0,
    trainers: Annotated[int, typer.Option(help="--stages: the pipeline's trainers.")] = 1,
    fork_nodes: Annotated[
        bool,
        typer.Option(
            metavar="",
            help="processes: fork the local node processes from one process that imported "
            "the node's modules once (faster starts); --no-fork-nodes starts each from a "
            "fresh interpreter.",
        ),
    ] = True,
) -> None:
    """Run a local swarm, real processes or the discrete-event model; print and save a
    summary."""
    from swarmgrad.simulations import swarm
    from swarmgrad.simulations.profiles import SimulationError
    from swarmgrad.simulations.summary import print_summary

    _logging(False)
    if engine == "des" and (netem or launcher != "local" or ray_address):
        raise _fail(EXIT_CONFIG, "--engine des models the swarm: no --netem, --launcher or Ray")
    if engine == "processes" and (step_seconds is not None or codec_rate is not None):
        raise _fail(EXIT_CONFIG, "--step-seconds and --codec-rate are for --engine des")
    if stages:
        from swarmgrad.simulations import pipeline

        if engine != "processes" or netem or launcher != "local":
            raise _fail(
                EXIT_CONFIG, "--stages runs local processes (no --engine des, --netem or ray)"
            )

        try:
            summary = pipeline.simulate_pipeline(
                pipeline.PipelineSimulation(
                    stages=stages,
                    nodes=nodes,
                    trainers=trainers,
                    rounds=rounds,
                    out_dir=out,
                    spec_path=spec,
                    profile_path=profile,
                    churn_path=churn,
                    seed=seed or 0,
                    timeout_seconds=timeout,
                    discovery=discovery,
                    fork_nodes=fork_nodes,
                )
            )
        except (SetupError, SimulationError) as error:
            raise _fail(EXIT_CONFIG, str(error)) from None
        pipeline.print_pipeline_summary(summary)
        raise typer.Exit(0 if summary["ok"] else 1)
    try:
        if engine == "des":
            from swarmgrad.simulations.des import driver

            summary = driver.run(
                driver.DesConfig(
                    nodes=nodes,
                    rounds=rounds,
                    out_dir=out,
                    spec_path=spec,
                    profile_path=profile,
                    churn_path=churn,
                    seed=seed or 0,
                    step_seconds=step_seconds,
                    codec_values_per_second=codec_rate,
                )
            )
        else:
            summary = swarm.simulate(
                swarm.SimulationConfig(
                    nodes=nodes,
                    rounds=rounds,
                    spec_path=spec,
                    profile_path=profile,
                    out_dir=out,
                    timeout_seconds=timeout,
                    churn_path=churn,
                    discovery=discovery,
                    seed=seed,
                    netem=netem,
                    launcher=launcher,
                    ray_address=ray_address,
                    fork_nodes=fork_nodes,
                )
            )
    except (SetupError, SimulationError) as error:
        raise _fail(EXIT_CONFIG, str(error)) from None
    print_summary(summary)
    raise typer.Exit(0 if summary["ok"] else 1)
