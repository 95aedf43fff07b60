"""What the ``swarmgrad`` commands share: logging set-up, exit codes, and failing with a message."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer

from swarmgrad.node.discovery.base import BackendName

#: A bad configuration, a spec the run's peers do not train, an unreachable network.
EXIT_CONFIG, EXIT_SPEC_MISMATCH, EXIT_NETWORK = 2, 3, 4

#: Choice lists: a command's help shows them (``<hivemind|libp2p>``) and refuses other values by
#: name (``config.DISPLAYS`` holds the same list; a unit test checks). The ``[node]`` settings'
#: choices come from their fields (``cli_settings.py``).
Backend = BackendName
Display = Literal["auto", "live", "log", "none"]

#: Options the commands that read a run share (status, dashboard, runs, publish, join).
Bootstrap = Annotated[
    list[str] | None,
    typer.Option(help="Multiaddr of a peer to reach the DHT through (repeatable)."),
]
BootstrapFile = Annotated[
    Path | None, typer.Option(help="Read multiaddrs from a bootstrap's --maddrs-file.")
]
#: The DHT backend and key when a spec or a ticket may give them.
LayeredBackend = Annotated[
    Backend | None, typer.Option(help="DHT backend \\[the spec's or ticket's].")
]
LayeredSecret = Annotated[
    str | None, typer.Option(help="libp2p: a private run's DHT key \\[the spec's].")
]
NodeAddress = Annotated[
    str | None,
    typer.Option(
        help="A local node's metrics address (host:port, or the URL its log gives): its view "
        "of the run's peers, at once, without joining the DHT.",
        show_default=False,
    ),
]


def setup_logging(verbose: bool, *, quiet: bool = False) -> None:
    """Log lines on stderr; ``quiet`` (a command that prints a table): warnings and worse."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,  # `join` reads the DHT quietly first, then runs a node that logs
    )


def fail(code: int, message: str) -> typer.Exit:
    typer.echo(f"swarmgrad: {message}", err=True)
    return typer.Exit(code)
