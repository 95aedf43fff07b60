"""The node's configuration: the one place that reads files and environment variables.

A node is configured by its run spec (a TOML file: what the run is, shared by every peer) and by
options of its own (how this machine takes part: ports, identity, caches, display, and the knobs
``swarmgrad simulate`` turns). Environment variables: ``SWARMGRAD_HOME`` (default
``~/.swarmgrad``) holds the node's identity key and the data cache. Any other ``SWARMGRAD_*``
variable is an error rather than silently ignored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from swarmgrad.node.runspec import RunSpec, RunSpecError
from swarmgrad.node.swarm import SwarmConfig

KNOWN_ENVIRONMENT = frozenset({"SWARMGRAD_HOME"})
DISPLAYS = ("auto", "live", "log", "none")
DEVICES = ("auto", "cpu", "cuda")


class ConfigError(ValueError):
    """A bad option or environment variable; the message names it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    spec: RunSpec
    swarm: SwarmConfig
    identity_path: Path
    cache_dir: Path
    device: str = "auto"
    #: Stop after the replica reaches this epoch (None: run until stopped).
    max_epochs: int | None = None
    #: Simulated slow compute: each training step takes this many times as long.
    slowdown: float = 1.0
    #: Where to keep the node's summary (JSON, rewritten after every round).
    status_file: Path | None = None
    display: str = "auto"
    #: Torch intra-op threads (None: torch's default).
    threads: int | None = None
    eval_windows: int = 32

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.display not in DISPLAYS:
            raise ConfigError(f"--display must be one of {', '.join(DISPLAYS)}")
        if self.max_epochs is not None and self.max_epochs < 1:
            raise ConfigError("--max-epochs must be at least 1")
        if not self.slowdown >= 1.0:
            raise ConfigError(
                f"--slowdown must be >= 1 (a factor on step time), got {self.slowdown}"
            )
        if self.threads is not None and self.threads < 1:
            raise ConfigError("--threads must be at least 1")
        if self.eval_windows < 1:
            raise ConfigError("--eval-windows must be at least 1")


def home(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    unknown = sorted(
        k for k in environ if k.startswith("SWARMGRAD_") and k not in KNOWN_ENVIRONMENT
    )
    if unknown:
        raise ConfigError(
            f"unknown environment variable(s) {', '.join(unknown)}; swarmgrad reads only "
            f"{', '.join(sorted(KNOWN_ENVIRONMENT))}"
        )
    return Path(environ.get("SWARMGRAD_HOME") or Path.home() / ".swarmgrad").expanduser()


def load_spec(path: Path, *, bootstrap: Sequence[str] = ()) -> RunSpec:
    """The run spec in ``path``; ``bootstrap`` multiaddrs are added to its ``[network]`` ones."""
    spec = RunSpec.load(path)
    if bootstrap:
        merged = tuple(dict.fromkeys((*spec.network.bootstrap, *bootstrap)))
        spec = RunSpec(
            run=spec.run,
            model=spec.model,
            data=spec.data,
            algorithm=spec.algorithm,
            averaging=spec.averaging,
            network=type(spec.network)(bootstrap=merged),
        )
    return spec


def node_config(
    *,
    spec_path: Path,
    bootstrap: Sequence[str] = (),
    identity_path: Path | None = None,
    cache_dir: Path | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    bandwidth: float = 1.0,
    upload_bytes_per_second: float | None = None,
    environ: Mapping[str, str] | None = None,
    **options: object,
) -> NodeConfig:
    """Build and check a node's configuration from command-line options and the environment."""
    base = home(environ)
    try:
        spec = load_spec(spec_path, bootstrap=bootstrap)
        swarm = SwarmConfig(
            host=host,
            port=port,
            bootstrap=spec.network.bootstrap,
            bandwidth=bandwidth,
            upload_bytes_per_second=upload_bytes_per_second,
        )
    except RunSpecError:
        raise
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return NodeConfig(
        spec=spec,
        swarm=swarm,
        identity_path=identity_path or base / "identity.key",
        cache_dir=cache_dir or base / "cache",
        **options,  # type: ignore[arg-type]
    )
