"""What the ``swarmgrad`` commands share: logging set-up, exit codes, and failing with a message."""

from __future__ import annotations

import logging
import sys
from typing import Literal

import typer

from swarmgrad.node.discovery.base import BackendName

#: A bad configuration, a spec the run's peers do not train, an unreachable network.
EXIT_CONFIG, EXIT_SPEC_MISMATCH, EXIT_NETWORK = 2, 3, 4

#: Choice lists: a command's help shows them (``<hivemind|libp2p>``) and refuses other values by
#: name (``config.DISPLAYS`` holds the same list; a unit test checks). The ``[node]`` settings'
#: choices come from their fields (``cli_settings.py``).
Backend = BackendName
Display = Literal["auto", "live", "log", "none"]


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
