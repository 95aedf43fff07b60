"""The ``swarmgrad`` command: node, bootstrap, status (``cli_status.py``), simulate
(``cli_simulate.py``), export, prepare-data; and run-key, publish, runs, join
(``run_commands.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
import typer.rich_utils

from swarmgrad.node import config as node_config
from swarmgrad.node import run_commands, tasks
from swarmgrad.node.cli_common import (
    EXIT_CONFIG,
    EXIT_NETWORK,
    EXIT_SPEC_MISMATCH,
    Backend,
    Display,
)
from swarmgrad.node.cli_common import fail as _fail
from swarmgrad.node.cli_common import setup_logging as _logging
from swarmgrad.node.cli_dashboard import dashboard
from swarmgrad.node.cli_doctor import doctor
from swarmgrad.node.cli_settings import with_settings
from swarmgrad.node.cli_simulate import simulate
from swarmgrad.node.cli_status import status
from swarmgrad.node.config import ConfigError
from swarmgrad.node.discovery.base import DiscoveryError
from swarmgrad.node.discovery.directory import SpecMismatch
from swarmgrad.protocol.errors import PeerUnavailable, SetupError

# Defaults one way in every --help: "[x]", as the options whose default comes from the spec or
# the environment write theirs (typer's own would be "[default: x]").
typer.rich_utils.DEFAULT_STRING = "[{}]"

app = typer.Typer(
    help="Train one model on many volunteer machines: run a node, a bootstrap, or a local swarm.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.command()
@with_settings(after="checkpoint_dir")
def node(
    spec: Annotated[Path, typer.Argument(help="The run spec (TOML) shared by the run's peers.")],
    bootstrap: Annotated[
        list[str] | None,
        typer.Option(
            rich_help_panel="Network",
            help="Multiaddr of a peer to join through (repeatable); adds to the spec's.",
        ),
    ] = None,
    bootstrap_file: Annotated[
        Path | None,
        typer.Option(
            rich_help_panel="Network",
            help="Read multiaddrs from a bootstrap's --maddrs-file (JSON).",
        ),
    ] = None,
    identity: Annotated[
        Path | None,
        typer.Option(
            rich_help_panel="Files",
            help="Ed25519 key file (default: $SWARMGRAD_HOME/identity.key).",
        ),
    ] = None,
    cache_dir: Annotated[
        Path | None,
        typer.Option(rich_help_panel="Files", help="Data cache (default: $SWARMGRAD_HOME/cache)."),
    ] = None,
    checkpoint_dir: Annotated[
        Path | None,
        typer.Option(
            rich_help_panel="Files",
            help="Checkpoints (default: $SWARMGRAD_HOME/checkpoints/<run id>).",
        ),
    ] = None,
    max_epochs: Annotated[
        int | None,
        typer.Option(
            rich_help_panel="Training", help="Stop training once the model reaches this epoch."
        ),
    ] = None,
    linger: Annotated[
        bool,
        typer.Option(
            "--linger",
            metavar="",
            rich_help_panel="Training",
            help="After --max-epochs, keep serving state to peers until stopped.",
        ),
    ] = False,
    slowdown: Annotated[
        float,
        typer.Option(
            rich_help_panel="Simulation",
            help="Simulate slower compute: each step takes this many times longer.",
        ),
    ] = 1.0,
    bandwidth: Annotated[
        float,
        typer.Option(
            rich_help_panel="Simulation",
            help="Relative upload capacity: the share of each vector owned.",
        ),
    ] = 1.0,
    upload_limit: Annotated[
        float | None,
        typer.Option(
            rich_help_panel="Simulation",
            help="Cap averaging uploads at this many bytes/s (simulation).",
        ),
    ] = None,
    status_file: Annotated[
        Path | None,
        typer.Option(rich_help_panel="Files", help="Write a JSON summary here after every round."),
    ] = None,
    display: Annotated[
        Display,
        typer.Option(
            rich_help_panel="Training",
            help="Progress: a live panel, log lines or none; auto: live on a terminal.",
        ),
    ] = "auto",
    eval_windows: Annotated[
        int,
        typer.Option(
            rich_help_panel="Training",
            help="Held-out windows evaluated after each round: more give a steadier "
            "validation loss and take longer.",
        ),
    ] = 32,
    stage: Annotated[
        str | None,
        typer.Option(
            rich_help_panel="Pipeline",
            help="A pipeline run: serve this stage's layers (0..stages-1), or 'auto' (the "
            "stage with the least capacity).",
        ),
    ] = None,
    role: Annotated[
        str | None,
        typer.Option(
            rich_help_panel="Pipeline",
            help="A pipeline run: 'trainer' owns the data and routes microbatches.",
        ),
    ] = None,
    max_steps: Annotated[
        int | None,
        typer.Option(
            rich_help_panel="Pipeline", help="A pipeline trainer: stop after this many steps."
        ),
    ] = None,
    settings: dict[str, Any] | None = None,  # the [node] settings' options (cli_settings.py)
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose", "-v", metavar="", help="Debug logging.", rich_help_panel="Training"
        ),
    ] = False,
) -> None:
    """Train with the run's peers: join, average every round, leave gracefully on Ctrl-C.

    A pipeline run (\\[pipeline] stages > 1) has two kinds of node: stage servers (--stage K)
    hold one span of the model's layers, trainers (--role trainer) own the data.

    Settings in \\[brackets] can also come from the run spec's \\[node] table and from
    SWARMGRAD_<SETTING> variables; the command line wins, then the environment, then the spec.
    """
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
            settings=settings or {},
            max_epochs=max_epochs,
            linger=linger,
            slowdown=slowdown,
            status_file=status_file,
            display=display,
            eval_windows=eval_windows,
            role=role or ("stage" if stage is not None else "node"),
            stage=None if stage is None or stage == "auto" else _stage_index(stage),
            max_steps=max_steps,
        )
        config = node_config.node_config(spec_path=spec, cli=command_line)
    except SetupError as error:
        raise _fail(EXIT_CONFIG, str(error)) from None
    from swarmgrad.node import main  # torch and the rest: after the configuration is known good

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
        Backend,
        typer.Option(help="DHT backend: hivemind or libp2p (the run's nodes use the same)."),
    ] = "hivemind",
    dht_secret: Annotated[
        str, typer.Option(help="libp2p: a private run's DHT key (its nodes give the same).")
    ] = "",
    identity: Annotated[
        Path | None,
        typer.Option(
            help="Key file of its peer id, made at the first start: the multiaddr stays the "
            "same across restarts (default: $SWARMGRAD_HOME/bootstrap.key)."
        ),
    ] = None,
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
                identity_path=identity or node_config.home() / "bootstrap.key",
            )
        )
    except (ValueError, SetupError) as error:  # a bad address, a port in use, a bad key
        raise _fail(EXIT_CONFIG, str(error)) from None
    except DiscoveryError as error:
        raise _fail(EXIT_NETWORK, str(error)) from None
    raise typer.Exit(code)


app.command()(status)
app.command()(dashboard)
app.command()(doctor)
app.command()(simulate)


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
