"""``swarmgrad status``: a run's peers as the DHT has them (and, for a pipeline, its stages), once
or, with ``--watch``, refreshed through one DHT reader until Ctrl-C."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from swarmgrad.node import config as node_config
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
from swarmgrad.node.discovery.base import DiscoveryError
from swarmgrad.node.runspec import RunSpecError
from swarmgrad.node.ticket import TicketError, read_ticket

if TYPE_CHECKING:
    from rich.console import RenderableType

    from swarmgrad.node.runspec import RunSpec
    from swarmgrad.node.status import RunPeers

#: The shortest --watch period: each refresh reads every peer record of the run from the DHT.
MIN_WATCH_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class RunTarget:
    """Whose peers to read, and through which DHT."""

    run_id: str
    spec: RunSpec | None
    bootstrap: tuple[str, ...]
    backend: str
    secret: str
    #: A local node's peers page: read there, not from the DHT.
    node: str = ""


def status(
    spec: Annotated[
        str | None,
        typer.Argument(
            help="The run spec (its run id, spec and bootstrap), or the run's ticket "
            "(sgrun1..., or a file holding it): then the peers of every spec in use.",
            show_default=False,
        ),
    ] = None,
    run: Annotated[
        str | None, typer.Option(help="Run id, without a spec: peers of every spec in use.")
    ] = None,
    bootstrap: Bootstrap = None,
    bootstrap_file: BootstrapFile = None,
    discovery: LayeredBackend = None,
    dht_secret: LayeredSecret = None,
    as_json: Annotated[
        bool,
        typer.Option("--json", metavar="", help="Print JSON (with --watch: one line a refresh)."),
    ] = False,
    timeout: Annotated[
        float, typer.Option(help="Give up on the DHT (with --watch: on a refresh) after this.")
    ] = 30.0,
    node: NodeAddress = None,
    watch: Annotated[
        float | None,
        typer.Option(
            help="Refresh every this many seconds through one DHT reader, until Ctrl-C.",
            min=MIN_WATCH_SECONDS,
            show_default=False,
        ),
    ] = None,
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
    _logging(False, quiet=True)  # the table is the output; retries are warnings
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    from swarmgrad.node.status import ScoresError, read_scores, read_traffic

    def files() -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The status files, read afresh (the node writing them keeps them current)."""
        return (
            read_scores(scores) if scores is not None else None,
            read_traffic(traffic) if traffic is not None else None,
        )

    try:
        scored, seen = files()
    except ScoresError as error:
        raise _fail(EXIT_CONFIG, str(error)) from None
    if (scored is not None or seen is not None) and spec is None and run is None:
        if as_json:
            typer.echo(json.dumps({"scores": scored, "traffic": seen}, indent=1))
        else:
            _print(_files_view(scored, seen))
        return
    if node is not None:
        target = node_target(node, timeout)
    else:
        target = run_target(spec, run, bootstrap, bootstrap_file, discovery, dht_secret)

    def view(found: RunPeers) -> tuple[dict[str, Any], list[RenderableType]]:
        try:
            now_scored, now_seen = files()
        except ScoresError as error:  # mid-rewrite or gone: say so, keep reading the DHT
            now_scored, now_seen = None, None
            typer.echo(f"warning: {error}", err=True)
        return _report(target, found, now_scored, now_seen)

    if watch is not None:
        _watch(target, every=watch, timeout=timeout, view=view, as_json=as_json)
        return
    found = _read_once(target, timeout)
    document, renderables = view(found)
    if as_json:
        typer.echo(json.dumps(document, indent=1))
    else:
        _print(renderables)


def run_target(
    argument: str | None,
    run: str | None,
    bootstrap: list[str] | None,
    bootstrap_file: Path | None,
    backend: str | None,
    secret: str | None,
) -> RunTarget:
    from swarmgrad.node.runspec import RunSpec

    try:
        ticket = read_ticket(argument) if argument is not None else None
        loaded = RunSpec.load(Path(argument)) if argument is not None and not ticket else None
        if (argument is None) == (run is None):
            raise node_config.ConfigError("give a run spec, a ticket or --run ID")
        maddrs = node_config.bootstrap_addresses(
            (*ticket.bootstrap,) if ticket else loaded.network.bootstrap if loaded else (),
            bootstrap or (),
            bootstrap_file=bootstrap_file,
        )
        if not maddrs:
            raise node_config.ConfigError("no bootstrap multiaddr: give --bootstrap")
    except (RunSpecError, TicketError, node_config.ConfigError) as error:
        raise _fail(EXIT_CONFIG, str(error)) from None
    return RunTarget(
        run_id=ticket.run_id if ticket else loaded.run.id if loaded else str(run),
        spec=loaded,
        bootstrap=tuple(maddrs),
        backend=backend
        or (ticket.discovery if ticket else loaded.node.discovery if loaded else "hivemind"),
        secret=secret if secret is not None else loaded.node.dht_secret if loaded else "",
    )


def node_target(address: str, timeout: float) -> RunTarget:
    """A local node's view of its run (its run id read from its page at once)."""
    from swarmgrad.node.status import node_page_url, read_node_page

    try:
        url = node_page_url(address)
        run_id, _ = read_node_page(url, timeout)
    except ValueError as error:
        raise _fail(EXIT_CONFIG, str(error)) from None
    except DiscoveryError as error:
        raise _fail(EXIT_NETWORK, f"could not read the run's peers: {error}") from None
    return RunTarget(run_id=run_id, spec=None, bootstrap=(), backend="", secret="", node=url)


def reader(target: RunTarget, timeout: float) -> Any:
    from swarmgrad.node.status import node_reader, peer_reader

    if target.node:
        return node_reader(target.node, timeout)
    return peer_reader(
        target.bootstrap,
        run_id=target.run_id,
        spec=target.spec,
        timeout_seconds=timeout,
        backend=target.backend,
        network_secret=target.secret,
    )


def _read_once(target: RunTarget, timeout: float) -> RunPeers:
    async def read() -> RunPeers:
        async with asyncio.timeout(timeout), reader(target, timeout) as peers:
            result: RunPeers = await peers()
            return result

    try:
        return tasks.run(lambda stop: tasks.unless_stopped(stop, read()))
    except tasks.Stopped:
        raise typer.Exit(130) from None
    except (ValueError, DiscoveryError, TimeoutError) as error:
        raise _network_failure(error, timeout) from None


def _network_failure(error: Exception, timeout: float) -> typer.Exit:
    if isinstance(error, DiscoveryError):
        return _fail(EXIT_NETWORK, f"could not read the run's peers: {error}")
    if isinstance(error, TimeoutError):
        return _fail(
            EXIT_NETWORK, f"could not read the run's peers: no answer from the DHT in {timeout:g} s"
        )
    return _fail(EXIT_CONFIG, str(error))


def _watch(
    target: RunTarget,
    *,
    every: float,
    timeout: float,
    view: Callable[[RunPeers], tuple[dict[str, Any], list[RenderableType]]],
    as_json: bool,
) -> None:
    """Read and show the run's peers every ``every`` seconds through one reader. A refresh the
    DHT does not answer in ``timeout`` is said and tried again; Ctrl-C ends it (exit 0)."""
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    console = Console()
    terminal = console.is_terminal and not as_json
    live = Live(console=console, auto_refresh=False) if terminal else None

    def show(document: dict[str, Any] | None, renderables: list[RenderableType], note: str) -> None:
        if as_json:
            if document is not None:
                typer.echo(json.dumps(document, separators=(",", ":")))
            else:
                typer.echo(note, err=True)
        elif live is not None:
            shown = [Text(r) if isinstance(r, str) else r for r in renderables]
            live.update(Group(*shown, Text(note, style="dim")), refresh=True)
        else:  # piped: one report after another
            _print([*renderables, note, ""])

    async def loop(stop: asyncio.Event) -> None:
        async with reader(target, timeout) as peers:
            shown: list[RenderableType] = []
            while not stop.is_set():
                clock = time.strftime("%H:%M:%S")
                try:
                    async with asyncio.timeout(timeout):
                        document, shown = view(await peers())
                    show(document, shown, f"read at {clock}, every {every:g} s; Ctrl-C to stop")
                except (TimeoutError, DiscoveryError) as error:
                    reason = error if str(error) else f"no answer in {timeout:g} s"
                    show(None, shown, f"{clock}: the DHT did not answer ({reason}); trying again")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(every):
                        await stop.wait()

    try:
        with live if live is not None else contextlib.nullcontext():
            tasks.run(lambda stop: tasks.unless_stopped(stop, loop(stop)))
    except tasks.Stopped:
        pass  # Ctrl-C is how a watch ends
    except (ValueError, DiscoveryError, TimeoutError) as error:
        raise _network_failure(error, timeout) from None


def _report(
    target: RunTarget,
    found: RunPeers,
    scored: dict[str, Any] | None,
    seen: dict[str, Any] | None,
) -> tuple[dict[str, Any], list[RenderableType]]:
    """What ``status`` shows: the JSON document and the tables."""
    from rich.table import Table

    from swarmgrad.node.status import stage_summary, stages_table

    spec = target.spec
    pipeline = spec.pipeline if spec is not None and spec.pipeline.stages > 1 else None
    rows = found.rows
    stages = (
        stage_summary(rows, pipeline.spans(spec.model.n_layers))
        if spec is not None and pipeline is not None
        else None
    )
    document = {
        "run": target.run_id,
        "peers": rows,
        "not_on_allowlist": found.not_on_allowlist,
        "warnings": found.warnings,
        "stages": stages,
        "scores": scored,
        "traffic": seen,
    }
    shown: list[RenderableType] = [f"warning: {w}" for w in found.warnings]
    table = Table(title=f"run {target.run_id}: {len(rows)} peer(s)")
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
    shown.append(table)
    if found.not_on_allowlist:
        shown.append(f"not on the allowlist: {found.not_on_allowlist} (peer records left out)")
    if stages is not None:
        shown.append(stages_table(stages))
    return document, shown + _files_view(scored, seen)


def _files_view(scored: dict[str, Any] | None, seen: dict[str, Any] | None) -> list[Any]:
    from swarmgrad.node.status import scores_table, traffic_table

    return [
        *([scores_table(scored)] if scored is not None else []),
        *([traffic_table(seen)] if seen is not None else []),
    ]


def _print(renderables: list[Any]) -> None:
    """Tables through rich, lines as they are (no markup, no wrapping)."""
    from rich.console import Console

    console = Console()
    for renderable in renderables:
        if isinstance(renderable, str):
            typer.echo(renderable)
        else:
            console.print(renderable)
