"""The ``swarmgrad`` command: node, bootstrap, status, simulate, export, prepare-data."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from swarmgrad.node import config as node_config
from swarmgrad.node import run_commands, tasks
from swarmgrad.node.cli_common import (
    EXIT_CONFIG,
    EXIT_NETWORK,
    EXIT_SPEC_MISMATCH,
)
from swarmgrad.node.cli_common import fail as _fail
from swarmgrad.node.cli_common import setup_logging as _logging
from swarmgrad.node.config import ConfigError
from swarmgrad.node.discovery.base import DiscoveryError
from swarmgrad.node.discovery.directory import SpecMismatch
from swarmgrad.node.runspec import RunSpecError
from swarmgrad.protocol.errors import PeerUnavailable, SetupError

app = typer.Typer(
    help="Train one model on many volunteer machines: run a node, a bootstrap, or a local swarm.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.command()
def node(
    spec: Annotated[Path, typer.Argument(help="The run spec (TOML) shared by the run's peers.")],
    bootstrap: Annotated[
        list[str] | None,
        typer.Option(help="Multiaddr of a peer to join through (repeatable); adds to the spec's."),
    ] = None,
    bootstrap_file: Annotated[
        Path | None,
        typer.Option(help="Read multiaddrs from a bootstrap's --maddrs-file (JSON)."),
    ] = None,
    identity: Annotated[
        Path | None, typer.Option(help="Ed25519 key file (default: $SWARMGRAD_HOME/identity.key).")
    ] = None,
    cache_dir: Annotated[
        Path | None, typer.Option(help="Data cache (default: $SWARMGRAD_HOME/cache).")
    ] = None,
    checkpoint_dir: Annotated[
        Path | None,
        typer.Option(help="Checkpoints (default: $SWARMGRAD_HOME/checkpoints/<run id>)."),
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="Address to serve gRPC and the DHT on [127.0.0.1].")
    ] = None,
    port: Annotated[int | None, typer.Option(help="gRPC port (0: any free port) [0].")] = None,
    public_host: Annotated[
        str | None,
        typer.Option(help="Address peers dial, if not --host (a container's name) \\[unset]."),
    ] = None,
    discovery: Annotated[
        str | None,
        typer.Option(help="DHT backend: hivemind, or libp2p (pure Python, anywhere) \\[hivemind]."),
    ] = None,
    dht_secret: Annotated[
        str | None,
        typer.Option(
            help="libp2p: a private run's DHT key; nodes without it cannot connect \\[unset]."
        ),
    ] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu or cuda \\[auto].")] = None,
    threads: Annotated[
        int | None, typer.Option(help="Torch CPU threads (0: torch's default) [0].")
    ] = None,
    compile: Annotated[
        str | None,
        typer.Option(
            help="on: torch.compile the training step (faster on GPUs, slow start) \\[off]."
        ),
    ] = None,
    peak_tflops: Annotated[
        int | None,
        typer.Option(
            help="The device's dense bf16 peak for MFU, in whole TFLOP/s (0: known GPUs' "
            "figure) [0]."
        ),
    ] = None,
    metrics_address: Annotated[
        str | None,
        typer.Option(help="Serve Prometheus metrics on host:port, or 'off' [127.0.0.1:9464]."),
    ] = None,
    checkpoint_every_rounds: Annotated[
        int | None, typer.Option(help="Write a checkpoint every this many rounds [10].")
    ] = None,
    keep_checkpoints: Annotated[
        int | None, typer.Option(help="Keep this many newest checkpoints [3].")
    ] = None,
    max_epochs: Annotated[
        int | None, typer.Option(help="Stop training once the model reaches this epoch.")
    ] = None,
    linger: Annotated[
        bool,
        typer.Option(help="After --max-epochs, keep serving state to peers until stopped."),
    ] = False,
    slowdown: Annotated[
        float, typer.Option(help="Simulate slower compute: each step takes this many times longer.")
    ] = 1.0,
    bandwidth: Annotated[
        float, typer.Option(help="Relative upload capacity: the share of each vector owned.")
    ] = 1.0,
    upload_limit: Annotated[
        float | None, typer.Option(help="Cap averaging uploads at this many bytes/s (simulation).")
    ] = None,
    status_file: Annotated[
        Path | None, typer.Option(help="Write a JSON summary here after every round.")
    ] = None,
    display: Annotated[str, typer.Option(help="auto, live, log or none.")] = "auto",
    eval_windows: Annotated[
        int,
        typer.Option(
            help="Held-out windows evaluated after each round: more give a steadier "
            "validation loss and take longer."
        ),
    ] = 32,
    stage: Annotated[
        str | None,
        typer.Option(
            help="A pipeline run: serve this stage's layers (0..stages-1), or 'auto' (the "
            "stage with the least capacity)."
        ),
    ] = None,
    role: Annotated[
        str | None,
        typer.Option(help="A pipeline run: 'trainer' owns the data and routes microbatches."),
    ] = None,
    max_steps: Annotated[
        int | None, typer.Option(help="A pipeline trainer: stop after this many steps.")
    ] = None,
    crash_after_forwards: Annotated[
        int | None,
        typer.Option(
            help="Fault injection: SIGKILL this stage server after N forwards.", hidden=True
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    """Train with the run's peers: join, average every round, leave gracefully on Ctrl-C.

    A pipeline run (\\[pipeline] stages > 1) has two kinds of node: stage servers (--stage K)
    hold one span of the model's layers, trainers (--role trainer) own the data.

    Settings in \\[brackets] can also come from the run spec's \\[node] table and from
    SWARMGRAD_<SETTING> variables; the command line wins, then the environment, then the spec.
    """
    from swarmgrad.node import main

    _logging(verbose)
    try:
        command_line = node_config.CommandLine(
            bootstrap=bootstrap or (),
            bootstrap_file=bootstrap_file,
            identity_path=identity,
            cache_dir=cache_dir,
            checkpoint_dir=checkpoint_dir,
            bandwidth=bandwidth,
            upload_bytes_per_second=upload_limit,
            settings={
                "host": host,
                "port": port,
                "public_host": public_host,
                "discovery": discovery,
                "dht_secret": dht_secret,
                "device": device,
                "threads": threads,
                "compile": compile,
                "peak_tflops": peak_tflops,
                "metrics_address": metrics_address,
                "checkpoint_every_rounds": checkpoint_every_rounds,
                "keep_checkpoints": keep_checkpoints,
            },
            max_epochs=max_epochs,
            linger=linger,
            slowdown=slowdown,
            status_file=status_file,
            display=display,
            eval_windows=eval_windows,
            role=role or ("stage" if stage is not None else "node"),
            stage=None if stage is None or stage == "auto" else _stage_index(stage),
            max_steps=max_steps,
            crash_after_forwards=crash_after_forwards,
        )
        config = node_config.node_config(spec_path=spec, cli=command_line)
    except SetupError as error:
        raise _fail(EXIT_CONFIG, str(error)) from None
    code, message = 0, ""
    try:  # the node's errors may arrive grouped by its TaskGroup
        code = tasks.run(lambda stop: main.run(config, stop))
    except* SpecMismatch as group:
        code, message = EXIT_SPEC_MISMATCH, str(group.exceptions[0])
    except* PeerUnavailable as group:
        code, message = EXIT_NETWORK, str(group.exceptions[0])
    except* SetupError as group:
        code, message = EXIT_CONFIG, str(group.exceptions[0])
    if message:
        raise _fail(code, message)
    raise typer.Exit(code)


def _stage_index(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"--stage must be a stage's index or 'auto', got {value!r}") from None


@app.command()
def bootstrap(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free port).")] = 0,
    peer: Annotated[
        list[str] | None, typer.Option(help="Another bootstrap node to link with (repeatable).")
    ] = None,
    maddrs_file: Annotated[
        Path | None, typer.Option(help="Also write the multiaddrs here (JSON).")
    ] = None,
    discovery: Annotated[
        str, typer.Option(help="DHT backend: hivemind or libp2p (the run's nodes use the same).")
    ] = "hivemind",
    dht_secret: Annotated[
        str, typer.Option(help="libp2p: a private run's DHT key (its nodes give the same).")
    ] = "",
) -> None:
    """Run a DHT-only bootstrap node and print the multiaddr to give to nodes (--bootstrap)."""
    from swarmgrad.node import main

    _logging(False)
    if maddrs_file is not None:  # a stale file would send nodes to an old peer id
        maddrs_file.unlink(missing_ok=True)
    try:
        code = tasks.run(
            lambda stop: main.bootstrap(
                host=host,
                port=port,
                initial_peers=peer or [],
                maddrs_file=maddrs_file,
                stop=stop,
                backend=discovery,
                network_secret=dht_secret,
            )
        )
    except (ValueError, SetupError) as error:  # a bad address, a port in use
        raise _fail(EXIT_CONFIG, str(error)) from None
    except DiscoveryError as error:
        raise _fail(EXIT_NETWORK, str(error)) from None
    raise typer.Exit(code)


@app.command()
def status(
    spec: Annotated[
        Path | None, typer.Argument(help="The run spec (its run id, spec and bootstrap).")
    ] = None,
    run: Annotated[
        str | None, typer.Option(help="Run id, without a spec: peers of every spec in use.")
    ] = None,
    bootstrap: Annotated[
        list[str] | None, typer.Option(help="Multiaddr of a peer to ask through (repeatable).")
    ] = None,
    bootstrap_file: Annotated[
        Path | None, typer.Option(help="Read multiaddrs from a bootstrap's --maddrs-file.")
    ] = None,
    discovery: Annotated[
        str | None, typer.Option(help="DHT backend \\[the spec's node.discovery, or hivemind].")
    ] = None,
    dht_secret: Annotated[
        str | None, typer.Option(help="libp2p: a private run's DHT key \\[the spec's].")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON, not a table.")] = False,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 30.0,
    scores: Annotated[
        Path | None,
        typer.Option(
            help="Open runs: also show what the node writing this --status-file thinks of each "
            "peer (clip and cosine EMAs, flags, bans, owner checks); alone, only that."
        ),
    ] = None,
    traffic: Annotated[
        Path | None,
        typer.Option(
            help="Pipelines: also show what the trainer writing this --status-file saw of each "
            "stage (bytes per sample each way, retries, resends, lost samples); alone, only that."
        ),
    ] = None,
) -> None:
    """Show a run's peers from the DHT: id, role, epoch, throughput, reachability, last seen;
    for a pipeline, its stage replicas and a row per stage."""
    import json

    _logging(False, quiet=True)  # the table is the output; retries are warnings

    from rich.console import Console
    from rich.table import Table

    from swarmgrad.node.runspec import RunSpec
    from swarmgrad.node.status import (
        ScoresError,
        read_scores,
        read_traffic,
        run_peers,
        scores_table,
        stage_summary,
        stages_table,
        traffic_table,
    )

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        scored = read_scores(scores) if scores is not None else None
        seen = read_traffic(traffic) if traffic is not None else None
    except ScoresError as error:
        raise _fail(EXIT_CONFIG, str(error)) from None

    def print_files() -> None:
        if scored is not None:
            Console().print(scores_table(scored))
        if seen is not None:
            Console().print(traffic_table(seen))

    if (scored is not None or seen is not None) and spec is None and run is None:
        if as_json:
            typer.echo(json.dumps({"scores": scored, "traffic": seen}, indent=1))
        else:
            print_files()
        return
    try:
        loaded = RunSpec.load(spec) if spec is not None else None
        if (loaded is None) == (run is None):
            raise node_config.ConfigError("give either a run spec or --run ID")
        maddrs = node_config.bootstrap_addresses(
            loaded.network.bootstrap if loaded is not None else (),
            bootstrap or (),
            bootstrap_file=bootstrap_file,
        )
        if not maddrs:
            raise node_config.ConfigError("no bootstrap multiaddr: give --bootstrap")
    except (RunSpecError, node_config.ConfigError) as error:
        raise _fail(EXIT_CONFIG, str(error)) from None
    run_id = loaded.run.id if loaded is not None else str(run)
    pipeline = loaded.pipeline if loaded is not None and loaded.pipeline.stages > 1 else None
    try:
        found = tasks.run(
            lambda stop: tasks.unless_stopped(
                stop,
                run_peers(
                    bootstrap=maddrs,
                    run_id=run_id,
                    spec=loaded,
                    timeout_seconds=timeout,
                    backend=discovery
                    or (loaded.node.discovery if loaded is not None else "hivemind"),
                    network_secret=(
                        dht_secret
                        if dht_secret is not None
                        else (loaded.node.dht_secret if loaded is not None else "")
                    ),
                ),
            )
        )
    except tasks.Stopped:
        raise typer.Exit(130) from None
    except ValueError as error:
        raise _fail(EXIT_CONFIG, str(error)) from None
    except DiscoveryError as error:
        raise _fail(EXIT_NETWORK, f"could not read the run's peers: {error}") from None
    except TimeoutError:
        raise _fail(
            EXIT_NETWORK, f"could not read the run's peers: no answer from the DHT in {timeout:g} s"
        ) from None
    rows = found.rows
    stages = (
        stage_summary(rows, pipeline.spans(loaded.model.n_layers))
        if loaded is not None and pipeline is not None
        else None
    )
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "run": run_id,
                    "peers": rows,
                    "not_on_allowlist": found.not_on_allowlist,
                    "warnings": found.warnings,
                    "stages": stages,
                    "scores": scored,
                    "traffic": seen,
                },
                indent=1,
            )
        )
        return
    for warning in found.warnings:
        typer.echo(f"warning: {warning}")
    table = Table(title=f"run {run_id}: {len(rows)} peer(s)")
    columns = ("peer", "spec", "role", "epoch", "samples/s", "endpoint", "reached", "seen")
    for column in columns:
        table.add_column(column, justify="right" if column in ("epoch", "samples/s") else "left")
    for row in rows:
        replica = row.get("stage")
        table.add_row(
            row["peer_id"],
            row["spec"],
            row["role"]
            + (
                f" {replica['index']} ({replica['state']}, v{replica['version']}, "
                f"{replica['queue_depth']} queued)"
                if replica
                else ""
            ),
            str(row["epoch"]),
            f"{row['throughput']:.1f}",
            row["endpoint"] or "-",
            row["reachability"]
            + (f" via {row['via'][:10]}" if row["via"] else "")
            + (f", {row['punched']} punched" if row["punched"] else ""),
            f"{row['last_seen_seconds']:.0f} s ago",
        )
    Console().print(table)
    if found.not_on_allowlist:
        typer.echo(f"not on the allowlist: {found.not_on_allowlist} (peer records left out)")
    if stages is not None:
        Console().print(stages_table(stages))
    print_files()


@app.command()
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
        str, typer.Option(help="DHT backend of the bootstrap and the nodes: hivemind or libp2p.")
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
        str,
        typer.Option(
            help="processes: real node processes on loopback; des: the discrete-event model "
            "(thousands of peers in seconds, no training: times, bytes and rounds)."
        ),
    ] = "processes",
    netem: Annotated[
        bool,
        typer.Option(
            help="processes: each node in its own network namespace, links shaped by tbf and "
            "nftables from its profile, partition/heal in the churn schedule (root)."
        ),
    ] = False,
    launcher: Annotated[
        str,
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
            help="processes: fork the local node processes from one process that imported "
            "the node's modules once (faster starts); --no-fork-nodes starts each from a "
            "fresh interpreter."
        ),
    ] = True,
) -> None:
    """Run a local swarm, real processes or the discrete-event model; print and save a
    summary."""
    from swarmgrad.simulations import swarm
    from swarmgrad.simulations.profiles import SimulationError
    from swarmgrad.simulations.summary import print_summary

    _logging(False)
    if engine not in ("processes", "des"):
        raise _fail(EXIT_CONFIG, f"--engine must be processes or des, got {engine!r}")
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


@app.command()
def export(
    checkpoint: Annotated[
        Path, typer.Argument(help="A checkpoint, or a node's checkpoint folder (its newest).")
    ],
    out_dir: Annotated[Path, typer.Argument(help="New (or empty) folder to write.")],
    cache_dir: Annotated[
        Path | None,
        typer.Option(help="Data cache, for the tokenizer (default: $SWARMGRAD_HOME/cache)."),
    ] = None,
) -> None:
    """Write a checkpoint's model as a Hugging Face directory (config.json, model.safetensors,
    tokenizer) that transformers loads with from_pretrained."""
    from swarmgrad.node.training.export import export as write

    _logging(False)
    try:
        exported = write(checkpoint, out_dir, cache_dir=cache_dir or node_config.home() / "cache")
    except SetupError as error:
        raise _fail(EXIT_CONFIG, str(error)) from None
    typer.echo(f"exported {exported} to {out_dir}")


@app.command("prepare-data")
def prepare_data(
    vocab_size: Annotated[int, typer.Option(help="BPE vocabulary size.")] = 2048,
    cache_dir: Annotated[
        Path | None, typer.Option(help="Cache folder (default: $SWARMGRAD_HOME/cache).")
    ] = None,
) -> None:
    """Fetch and tokenize the demo corpus once (set-up runs this), so nodes start fast."""
    from swarmgrad.node.training.data import load_demo

    _logging(False)
    try:
        folder = cache_dir or node_config.home() / "cache"
        corpus = load_demo(folder, vocab_size=vocab_size)
    except SetupError as error:
        raise _fail(EXIT_CONFIG, str(error)) from None
    typer.echo(f"demo corpus ready: {len(corpus.tokens):,} tokens in {folder}")


run_commands.register(app)  # run-key, publish, runs, join


def main() -> None:
    app()


if __name__ == "__main__":
    main()
