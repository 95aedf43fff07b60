"""``swarmgrad doctor``: this machine's checks for running a node (``node/doctor.py``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from swarmgrad.node import config as node_config
from swarmgrad.node.cli_common import EXIT_CONFIG
from swarmgrad.node.cli_common import fail as _fail
from swarmgrad.node.cli_common import setup_logging as _logging
from swarmgrad.node.runspec import RunSpec, RunSpecError


def doctor(
    spec: Annotated[
        Path | None,
        typer.Argument(help="A run spec: also check memory, disk and the run's DHT for it."),
    ] = None,
    bootstrap: Annotated[
        list[str] | None, typer.Option(help="Multiaddr to reach the run through (repeatable).")
    ] = None,
    device: Annotated[
        str, typer.Option(help="The device the node would use: auto, cpu, cuda.")
    ] = "auto",
    port: Annotated[int, typer.Option(help="The gRPC port the node would listen on.")] = 0,
    metrics_address: Annotated[
        str, typer.Option(help="The node's metrics address: host:port, auto or off.")
    ] = "auto",
    timeout: Annotated[float, typer.Option(help="Give the run's DHT this many seconds.")] = 30.0,
) -> None:
    """Check this machine for running a node: Python, torch and the device, ports, and with a
    run spec its memory, disk and the run's DHT. One line a check; exit 1 if any fails."""
    from swarmgrad.node import doctor as checks

    _logging(False, quiet=True)
    logging.getLogger("swarmgrad").setLevel(logging.ERROR)  # the findings say what went wrong
    try:
        loaded = RunSpec.load(spec) if spec is not None else None
        maddrs = node_config.bootstrap_addresses(
            loaded.network.bootstrap if loaded is not None else (), bootstrap or ()
        )
    except (RunSpecError, node_config.ConfigError) as error:
        raise _fail(EXIT_CONFIG, str(error)) from None
    host = loaded.node.host if loaded is not None else "127.0.0.1"
    findings = [checks.python(), checks.device(device), checks.port(host, port, "grpc", "--port")]
    if metrics_address not in ("auto", "off"):
        metrics_host, _, metrics_port = metrics_address.rpartition(":")
        findings.append(
            checks.port(metrics_host, int(metrics_port), "metrics", "--metrics-address")
        )
    if loaded is not None:
        findings += [
            checks.memory(loaded),
            checks.disk(loaded, node_config.home() / "checkpoints"),
            checks.run(loaded, maddrs, timeout_seconds=timeout),
        ]
    for finding in findings:
        typer.echo(finding.line())
    failed = [f.name for f in findings if not f.ok]
    if failed:
        typer.echo(f"{len(failed)} problem(s): {', '.join(failed)}")
        raise typer.Exit(1)
    typer.echo("all checks passed")
