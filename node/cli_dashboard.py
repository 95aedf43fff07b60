"""``swarmgrad dashboard``: the run page, served until Ctrl-C."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated

import typer

from swarmgrad.node import tasks
from swarmgrad.node.cli_common import (
    EXIT_CONFIG,
    EXIT_NETWORK,
    Bootstrap,
    BootstrapFile,
    LayeredBackend,
    LayeredSecret,
    NodeAddress,
)
from swarmgrad.node.cli_common import fail as _fail
from swarmgrad.node.cli_common import setup_logging as _logging
from swarmgrad.node.cli_status import node_target, reader, run_target
from swarmgrad.node.discovery.base import DiscoveryError
from swarmgrad.node.preflight import in_use

log = logging.getLogger(__name__)


def dashboard(
    spec: Annotated[
        str | None,
        typer.Argument(
            help="The run's ticket (sgrun1..., or a file holding it) or its spec (or --node).",
            show_default=False,
        ),
    ] = None,
    run: Annotated[str | None, typer.Option(help="Run id, with --bootstrap.")] = None,
    bootstrap: Bootstrap = None,
    bootstrap_file: BootstrapFile = None,
    discovery: LayeredBackend = None,
    dht_secret: LayeredSecret = None,
    node: NodeAddress = None,
    status_file: Annotated[
        Path | None,
        typer.Option(
            help="A node's --status-file: adds its loss curve, rounds, trust scores and "
            "contribution (with --node: read from that node's metrics server if not given)."
        ),
    ] = None,
    host: Annotated[
        str, typer.Option(help="Serve the page on this address (0.0.0.0: to other machines).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Serve the page on this port (0: any free).")] = 8470,
    refresh: Annotated[
        float, typer.Option(help="Read the run from the DHT every this many seconds.", min=1.0)
    ] = 5.0,
    timeout: Annotated[
        float, typer.Option(help="Give up on the DHT (at start, and on a read) after this.")
    ] = 30.0,
) -> None:
    """Serve the run page: the run's peers (throughput, share, reachability, trust, bans) and,
    with --node or --status-file, a node's loss curve, rounds and contribution, refreshing
    live."""
    _logging(False)
    from swarmgrad.node.dashboard.server import (
        DashboardError,
        RunState,
        application,
        keep_reading,
        plotly_js,
        serving,
    )

    if node is not None:
        target = node_target(node, timeout)
    else:
        target = run_target(spec, run, bootstrap, bootstrap_file, discovery, dht_secret)
    try:
        plotly_js()
    except DashboardError as error:
        raise _fail(EXIT_CONFIG, str(error)) from None
    from swarmgrad.node.status import status_page_url

    state = RunState(
        run_id=target.run_id,
        status_file=status_file,
        status_url=status_page_url(target.node) if target.node else "",
    )

    if port and in_use(host, port):  # said before the DHT is joined, not after
        raise _fail(EXIT_CONFIG, f"cannot serve the run page on {host}:{port}: the port is in use")

    async def main(stop: asyncio.Event) -> None:
        # The reader first: joining the DHT (importing its backend, too) holds the event loop
        # for seconds, which a page already served would spend not answering.
        async with reader(target, timeout) as peers:
            app = application(state, refresh_seconds=refresh)
            async with serving(app, host, port) as url:
                typer.echo(f"run page at {url} (Ctrl-C to stop)")
                source = f"node {target.node}" if target.node else "the DHT"
                log.info("reading run %s from %s every %g s", target.run_id, source, refresh)
                await keep_reading(
                    state, peers, refresh_seconds=refresh, timeout_seconds=timeout, stop=stop
                )

    try:
        tasks.run(lambda stop: tasks.unless_stopped(stop, main(stop)))
    except tasks.Stopped:
        pass  # Ctrl-C is how the page stops
    except DashboardError as error:
        raise _fail(EXIT_CONFIG, str(error)) from None
    except (DiscoveryError, TimeoutError) as error:
        reason = str(error) or f"no answer from the DHT in {timeout:g} s"
        raise _fail(EXIT_NETWORK, f"could not read the run: {reason}") from None
