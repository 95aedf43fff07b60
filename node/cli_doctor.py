"""``swarmgrad doctor``: this machine's checks for running a node (``node/doctor.py``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Literal

import typer

from swarmgrad.node import config as node_config
from swarmgrad.node.cli_common import EXIT_CONFIG
from swarmgrad.node.cli_common import fail as _fail
from swarmgrad.node.cli_common import setup_logging as _logging
from swarmgrad.node.identity import Identity
from swarmgrad.node.runspec import RunSpec, RunSpecError
from swarmgrad.node.ticket import TicketError, read_ticket


def doctor(
    spec: Annotated[
        Path | None,
        typer.Argument(help="A run spec: also check memory, disk and the run's DHT for it."),
    ] = None,
    run: Annotated[
        str | None,
        typer.Option(
            help="The run's ticket (sgrun1..., or a file holding it): check the run it names "
            "(its DHT, its published spec's memory and disk, this clock against its peers').",
            show_default=False,
        ),
    ] = None,
    bootstrap: Annotated[
        list[str] | None, typer.Option(help="Multiaddr to reach the run through (repeatable).")
    ] = None,
    device: Annotated[
        Literal["auto", "cpu", "cuda"], typer.Option(help="The device the node would use.")
    ] = "auto",
    host: Annotated[
        str | None,
        typer.Option(
            help="The address the node would listen on \\[the spec's, or 127.0.0.1].",
            show_default=False,
        ),
    ] = None,
    port: Annotated[int, typer.Option(help="The gRPC port the node would listen on.")] = 0,
    metrics_address: Annotated[
        str, typer.Option(help="The node's metrics address: host:port, auto or off.")
    ] = "auto",
    timeout: Annotated[float, typer.Option(help="Give the run's DHT this many seconds.")] = 30.0,
) -> None:
    """Check this machine for running a node: Python, torch and the device, ports, and with a
    run spec or ticket its memory, disk, the run's DHT and this clock against the run's peers'.
    One line a check; exit 1 if any fails."""
    from swarmgrad.node import doctor as checks

    _logging(False, quiet=True)
    logging.getLogger("swarmgrad").setLevel(logging.ERROR)  # the findings say what went wrong
    try:
        if spec is not None and run is not None:
            raise node_config.ConfigError("give a run spec or --run TICKET, not both")
        ticket = read_ticket(run) if run is not None else None
        if run is not None and ticket is None:
            raise node_config.ConfigError(f"--run takes the run's ticket (sgrun1...), not {run!r}")
        loaded = RunSpec.load(spec) if spec is not None else None
        maddrs = node_config.bootstrap_addresses(
            ticket.bootstrap if ticket else loaded.network.bootstrap if loaded else (),
            bootstrap or (),
        )
    except (RunSpecError, TicketError, node_config.ConfigError) as error:
        raise _fail(EXIT_CONFIG, str(error)) from None
    host = host or (loaded.node.host if loaded is not None else "127.0.0.1")
    findings = [checks.python(), checks.device(device), checks.port(host, port, "grpc", "--port")]
    if metrics_address not in ("auto", "off"):
        metrics_host, _, metrics_port = metrics_address.rpartition(":")
        findings.append(
            checks.port(metrics_host, int(metrics_port), "metrics", "--metrics-address")
        )
    if loaded is not None or ticket is not None:
        # As the node: its key if this machine has one (a private run serves only its own).
        key_file = node_config.home() / "identity.key"
        key = Identity.load(key_file) if key_file.is_file() else Identity.generate()
        read = checks.run(maddrs, spec=loaded, ticket=ticket, timeout_seconds=timeout,
                          dial_back=(key, host, port))  # fmt: skip
        known = read.spec or loaded  # a ticket's spec is read from the run's DHT
        if known is not None:
            findings += [
                checks.memory(known),
                checks.disk(known, node_config.home() / "checkpoints"),
            ]
        findings += [read.finding, checks.clock(read)] if read.finding.ok else [read.finding]
        findings += [read.reach] if read.reach is not None else []
    for finding in findings:
        typer.echo(finding.line())
    failed = [f.name for f in findings if not f.ok]
    if failed:
        typer.echo(f"{len(failed)} problem(s): {', '.join(failed)}")
        raise typer.Exit(1)
    typer.echo("all checks passed")
