"""``swarmgrad status``: a run's peers as the DHT has them (and, for a pipeline, its stages)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from swarmgrad.node import config as node_config
from swarmgrad.node import tasks
from swarmgrad.node.cli_common import (
    EXIT_CONFIG,
    EXIT_NETWORK,
)
from swarmgrad.node.cli_common import fail as _fail
from swarmgrad.node.cli_common import setup_logging as _logging
from swarmgrad.node.discovery.base import DiscoveryError
from swarmgrad.node.runspec import RunSpecError


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
