"""``swarmgrad run-key``, ``publish``, ``runs`` and ``join``: publishing a run, and joining one by
its id (``node/published.py`` says what is signed and checked)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from swarmgrad.node import config as node_config
from swarmgrad.node import published, tasks
from swarmgrad.node.cli_common import (
    EXIT_CONFIG,
    EXIT_NETWORK,
    Backend,
    Bootstrap,
    BootstrapFile,
    fail,
    setup_logging,
)
from swarmgrad.node.discovery.base import Discovery, DiscoveryError
from swarmgrad.node.discovery.start import start_reader
from swarmgrad.node.identity import Identity
from swarmgrad.node.ticket import Ticket, read_ticket
from swarmgrad.protocol.errors import SetupError

T = TypeVar("T")
BackendOption = Annotated[Backend, typer.Option(help="The DHT backend.")]
Secret = Annotated[str, typer.Option(help="libp2p: a private DHT's key.")]
Timeout = Annotated[float, typer.Option(help="Give up reading the DHT after this many seconds.")]


def _addresses(bootstrap: list[str] | None, bootstrap_file: Path | None) -> tuple[str, ...]:
    maddrs = node_config.bootstrap_addresses((), bootstrap or (), bootstrap_file=bootstrap_file)
    if not maddrs:
        raise node_config.ConfigError("no bootstrap multiaddr: give --bootstrap")
    return maddrs


def _read_dht(
    read: Callable[[Discovery], Awaitable[T]],
    maddrs: Sequence[str],
    *,
    backend: str,
    secret: str,
    timeout: float,
) -> T:
    """``read`` on a short-lived DHT reader, all of it within ``timeout`` seconds."""

    async def run() -> T:
        async with asyncio.timeout(timeout):
            dht = await start_reader(
                maddrs, backend=backend, network_secret=secret, timeout_seconds=timeout
            )
            try:
                return await read(dht)
            finally:
                await dht.close()

    try:
        return tasks.run(lambda stop: tasks.unless_stopped(stop, run()))
    except tasks.Stopped:  # a Ctrl-C: nothing was written, nothing to say
        raise typer.Exit(130) from None
    except TimeoutError:  # says nothing by itself
        raise DiscoveryError(
            f"the DHT gave no answer within {timeout:g} s (--timeout; bootstrap: "
            f"{', '.join(maddrs)})"
        ) from None


def run_key(
    path: Annotated[Path, typer.Argument(help="Where to keep the run key (created if absent).")],
) -> None:
    """Create (or show) a run key: the organizer's Ed25519 key that signs a published run."""
    try:
        existed = path.exists()
        key = Identity.load_or_create(path)
    except SetupError as error:
        raise fail(EXIT_CONFIG, str(error)) from None
    typer.echo(f"{'run key' if existed else 'new run key'} {path}")
    typer.echo(f"fingerprint (give it to volunteers with the run id): {key.peer_id}")


def publish(
    spec: Annotated[Path, typer.Argument(help="The run spec to publish.")],
    run_key: Annotated[Path, typer.Option(help="The run key (swarmgrad run-key) that signs it.")],
    allowlist: Annotated[
        Path | None,
        typer.Option(help="Private runs: peer ids allowed in, one a line; edits apply live."),
    ] = None,
    bootstrap: Bootstrap = None,
    bootstrap_file: BootstrapFile = None,
    discovery: BackendOption = "hivemind",
    dht_secret: Secret = "",
    timeout: Timeout = 30.0,
    ticket_file: Annotated[
        Path | None,
        typer.Option(help="Also write the run's ticket (what volunteers join with) here."),
    ] = None,
) -> None:
    """Publish a run in the DHT, signed by its run key, and keep it there until stopped; print
    its ticket: the one string a volunteer joins with (swarmgrad join TICKET)."""
    from swarmgrad.node.runspec import RunSpec

    setup_logging(False)
    try:
        text = node_config.read_spec_text(spec)
        loaded = RunSpec.from_toml(text)
        key = Identity.load(run_key)
        maddrs = _addresses(bootstrap, bootstrap_file)
        if loaded.trust.private and allowlist is None:
            raise node_config.ConfigError("a private run's spec: give --allowlist FILE")
        if loaded.trust.private and loaded.trust.run_key != key.peer_id:
            raise node_config.ConfigError(
                f"the spec's trust.run_key is {loaded.trust.run_key}, this run key is {key.peer_id}"
            )
        if allowlist is not None:
            node_config.read_allowlist(allowlist)  # a bad file fails now, not in the loop
        # This machine's nodes of the run then heed only the specs this key publishes: a
        # look-alike announced under the run id cannot keep them out (the organizer's seeds).
        known = node_config.known_run_key(loaded.run.id)
        node_config.remember_joined_run(loaded.run.id, key.peer_id, text)
    except SetupError as error:
        raise fail(EXIT_CONFIG, str(error)) from None
    if known is not None and known != key.peer_id:
        typer.echo(f"run {loaded.run.id}: this machine's run key was {known}; now {key.peer_id}")
    ticket = Ticket(
        run_id=loaded.run.id,
        run_key=key.public_key,
        spec_hash=loaded.hash.hex(),
        bootstrap=maddrs,
        discovery=discovery,
    ).encode(key)
    if ticket_file is not None:
        ticket_file.write_text(ticket + "\n")

    def read_allowlist() -> list[str]:
        assert allowlist is not None
        return node_config.read_allowlist(allowlist)

    async def serve(stop: asyncio.Event) -> int:
        dht = await start_reader(
            maddrs, backend=discovery, network_secret=dht_secret, timeout_seconds=timeout
        )
        try:
            typer.echo(
                f"publishing run {loaded.run.id} (spec {loaded.short_hash}); volunteers join with:"
            )
            typer.echo(f"  swarmgrad join {ticket}")
            await published.publish(
                dht, key, text, stop=stop, allowlist=read_allowlist if allowlist else None
            )
        finally:
            await dht.close()
        return 0

    try:
        code = tasks.run(serve)
    except (DiscoveryError, TimeoutError) as error:
        raise fail(EXIT_NETWORK, f"could not publish: {error}") from None
    raise typer.Exit(code)


def runs(
    bootstrap: Bootstrap = None,
    bootstrap_file: BootstrapFile = None,
    discovery: BackendOption = "hivemind",
    dht_secret: Secret = "",
    as_json: Annotated[
        bool, typer.Option("--json", metavar="", help="Print JSON, not a table.")
    ] = False,
    timeout: Timeout = 30.0,
) -> None:
    """List the runs published in the DHT: id, run key, spec, peers, epoch; and every spec that
    claims a published run's id, with the run key that published it (or none)."""
    import json

    from rich.console import Console
    from rich.table import Table

    setup_logging(False, quiet=True)  # the table is the output; retries are warnings
    try:
        maddrs = _addresses(bootstrap, bootstrap_file)
    except SetupError as error:
        raise fail(EXIT_CONFIG, str(error)) from None

    try:
        rows = _read_dht(
            published.run_rows, maddrs, backend=discovery, secret=dht_secret, timeout=timeout
        )
    except (DiscoveryError, TimeoutError) as error:
        raise fail(EXIT_NETWORK, f"could not read the published runs: {error}") from None
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    table = Table(title=f"{len({row['run_id'] for row in rows})} published run(s)")
    keys = ("run_id", "run_key_id", "spec_hash", "model", "algorithm", "codec", "trust", "peers")
    for column in (*keys, "epoch"):
        # Folded, never cut: two claims on a run id may differ only in their keys' last letters.
        folded = column in ("run_id", "run_key_id", "model")
        table.add_column(column.replace("_id", "").replace("_", " "), overflow="fold",
                         no_wrap=not folded)  # fmt: skip
    for row in rows:
        cells = row | {"run_key_id": row["run_key_id"] or "none", "peers": _peers_cell(row)}
        table.add_row(*(str(cells[k]) for k in (*keys, "epoch")))
    console = Console()
    if not console.is_terminal:  # a pipe or a file: each row on one line, keys whole
        console = Console(width=max(console.width, 200))
    console.print(table)
    for line in _claims(rows):
        typer.echo(line)


def _peers_cell(row: dict[str, Any]) -> str:
    strangers = row["not_on_allowlist"]
    return f"{row['peers']} (not on the allowlist: {strangers})" if strangers else str(row["peers"])


def _claims(rows: list[dict[str, Any]]) -> list[str]:
    """Plain lines (a table may fold) for each run id with several claims: each spec and the
    full fingerprint of the run key that published it, or none."""
    lines = []
    for run_id in dict.fromkeys(row["run_id"] for row in rows):
        claims = [row for row in rows if row["run_id"] == run_id]
        if claims[0]["claims"] < 2:
            continue
        lines.append(f"{claims[0]['claims']} claims on run id {run_id!r}, by spec and run key:")
        for row in claims:
            by = row["run_key_id"]
            signer = (
                f"signed by run key {by}" if by else "signed by no run key (announced by nodes)"
            )
            lines.append(f"  spec {row['spec_sha256']}  {signer}")
        if claims[0]["claims"] > len(claims):
            lines.append(f"  and {claims[0]['claims'] - len(claims)} more signed by no run key")
        lines.append(
            "  Join with the run key fingerprint its organizer gave you (--run-key-id): a node "
            "of the run ignores specs that key did not publish."
        )
    return lines


def join(
    ctx: typer.Context,
    run_id: Annotated[
        str,
        typer.Argument(
            help="The run's ticket (sgrun1..., from its organizer, or a file holding it), "
            "or its id."
        ),
    ],
    run_key_id: Annotated[
        str | None,
        typer.Option(help="The run key's fingerprint (sg...), from its organizer; remembered."),
    ] = None,
    bootstrap: Bootstrap = None,
    bootstrap_file: BootstrapFile = None,
    discovery: BackendOption = "hivemind",
    dht_secret: Secret = "",
    timeout: Timeout = 30.0,
) -> None:
    """Fetch a published run's signed spec, check it, show it, and start a node in it.

    With a ticket nothing else is needed; with a run id, give --run-key-id and --bootstrap.
    Options after the ticket (or run id) that ``join`` does not know go to ``swarmgrad node``.
    """
    setup_logging(False, quiet=True)  # the run is read quietly; the node it starts logs in full
    try:
        ticket = read_ticket(run_id)
        if ticket is not None:
            if run_key_id is not None and run_key_id != ticket.run_key_id:
                raise node_config.ConfigError(
                    f"--run-key-id {run_key_id} is not the ticket's run key {ticket.run_key_id}"
                )
            run_id, run_key_id = ticket.run_id, ticket.run_key_id
            source = ctx.get_parameter_source("discovery")
            if source is None or source.name == "DEFAULT":  # not given: the ticket's
                discovery = ticket.discovery
        extra = node_config.bootstrap_addresses((), bootstrap or (), bootstrap_file=bootstrap_file)
        maddrs = (*ticket.bootstrap, *extra) if ticket else _addresses(bootstrap, bootstrap_file)
        known = node_config.known_run_key(run_id)
    except SetupError as error:
        raise fail(EXIT_CONFIG, str(error)) from None
    if run_key_id is None and known is None:
        raise fail(EXIT_CONFIG, f"first join of {run_id!r}: give --run-key-id (from its organizer)")
    if run_key_id is not None and known is not None and run_key_id != known:
        raise fail(
            EXIT_CONFIG,
            f"run {run_id!r} was joined under run key {known}, not {run_key_id}: if its organizer "
            f"really changed keys, remove it from {node_config.joined_runs() / 'known.json'}",
        )
    expected = run_key_id or str(known)

    async def fetch(dht: Discovery) -> published.Listing:
        return await published.fetch(dht, run_id, expected)

    try:
        listing = _read_dht(fetch, maddrs, backend=discovery, secret=dht_secret, timeout=timeout)
    except published.RunNotFound as error:
        raise fail(EXIT_CONFIG, str(error)) from None
    except (DiscoveryError, TimeoutError) as error:
        raise fail(EXIT_NETWORK, f"could not read the published runs: {error}") from None
    spec = listing.spec
    if ticket is not None and spec.hash.hex() != ticket.spec_hash:
        raise fail(
            EXIT_CONFIG,
            f"run {run_id} is published with spec {spec.short_hash}, the ticket names spec "
            f"{ticket.spec_hash[:12]}: the organizer changed the run; ask for its new ticket",
        )
    typer.echo(
        f"run {spec.run.id}, spec {spec.short_hash}, signed by {listing.run_key_id}: "
        f"model d{spec.model.d_model} x {spec.model.n_layers} layers, {spec.algorithm.name}, "
        f"codec {spec.averaging.codec}, trust {spec.trust.mode}"
    )
    path = node_config.remember_joined_run(run_id, listing.run_key_id, listing.run.spec_toml)
    typer.echo(f"spec saved to {path}; starting the node")
    from swarmgrad.node.cli import app

    args = ["node", str(path), *(a for m in maddrs for a in ("--bootstrap", m))]
    args += ["--discovery", discovery, *(["--dht-secret", dht_secret] if dht_secret else [])]
    command = typer.main.get_command(app)
    command.main(args=[*args, *ctx.args], prog_name="swarmgrad", standalone_mode=True)


def register(app: typer.Typer) -> None:
    app.command("run-key")(run_key)
    app.command()(publish)
    app.command()(runs)
    app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(join)
