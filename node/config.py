"""The node's configuration: the one place that reads files and environment variables.

A node is configured in three layers, each overriding the one before:

1. the run spec (TOML, shared by every peer): what the run is, plus a ``[node]`` table of defaults
   for its nodes (:class:`~swarmgrad.node.runspec.NodeSection`);
2. ``SWARMGRAD_*`` environment variables: ``SWARMGRAD_<SETTING>`` for each ``[node]`` setting
   (``SWARMGRAD_METRICS_ADDRESS=0.0.0.0:9464``), ``SWARMGRAD_HOME`` (default ``~/.swarmgrad``: the
   identity key, data cache and checkpoints) and ``SWARMGRAD_BOOTSTRAP`` (multiaddrs, separated by
   spaces or commas);
3. command-line options (``--metrics-address``, ...).

Bootstrap multiaddrs from every layer are used together. Unknown ``[node]`` keys and unknown
``SWARMGRAD_*`` variables are errors, and a bad value's error names the layer it came from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmgrad.node.files import atomic_write
from swarmgrad.node.runspec import NodeSection, RunSpec, RunSpecError
from swarmgrad.node.trust.allowlist import PEER_ID
from swarmgrad.protocol.errors import SetupError

if TYPE_CHECKING:
    from swarmgrad.node.swarm_config import SwarmConfig

#: Each [node] setting and its type's name ("int" or "str").
SETTINGS = {f.name: str(f.type) for f in dataclasses.fields(NodeSection)}
KNOWN_ENVIRONMENT = frozenset(
    {"SWARMGRAD_HOME", "SWARMGRAD_BOOTSTRAP", *(f"SWARMGRAD_{k.upper()}" for k in SETTINGS)}
)
DISPLAYS = ("auto", "live", "log", "none")
#: A node's part in its run (see NodeConfig.role).
ROLES = ("node", "stage", "trainer")


class ConfigError(SetupError, ValueError):
    """A bad option or environment variable; the message names it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    #: The run spec; its ``node`` section holds this node's settings, every layer applied.
    spec: RunSpec
    swarm: SwarmConfig
    identity_path: Path
    cache_dir: Path
    checkpoint_dir: Path
    #: Stop after the replica reaches this epoch (None: run until stopped).
    max_epochs: int | None = None
    #: After ``max_epochs``, stay in the swarm (serving state) until stopped.
    linger: bool = False
    #: Simulated slow compute: each training step takes this many times as long.
    slowdown: float = 1.0
    #: Where to keep the node's summary (JSON, rewritten after every round).
    status_file: Path | None = None
    display: str = "auto"
    eval_windows: int = 32
    #: A pipeline run's part: "stage" (serve ``stage``'s layers) or "trainer" (own the data);
    #: "node" holds the whole model (a run without [pipeline]).
    role: str = "node"
    stage: int | None = None
    #: A pipeline trainer stops after this many steps (None: when stopped).
    max_steps: int | None = None

    def __post_init__(self) -> None:
        self._check_role()
        if self.display not in DISPLAYS:
            raise ConfigError(f"--display must be one of {', '.join(DISPLAYS)}")
        if self.max_epochs is not None and self.max_epochs < 1:
            raise ConfigError("--max-epochs must be at least 1")
        if not self.slowdown >= 1.0:
            raise ConfigError(
                f"--slowdown must be >= 1 (a factor on step time), got {self.slowdown}"
            )
        if self.eval_windows < 1:
            raise ConfigError("--eval-windows must be at least 1")

    def _check_role(self) -> None:
        stages = self.spec.pipeline.stages
        if self.role not in ROLES:
            raise ConfigError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.stage is not None and self.role != "stage":
            raise ConfigError("--stage K makes this node a stage server (role stage)")
        if self.spec.pipeline.enabled and self.role == "node":
            raise ConfigError(
                f"run {self.spec.run.id!r} is a pipeline of {stages} stages: serve one with "
                f"--stage K (0..{stages - 1}), or train with --role trainer"
            )
        if not self.spec.pipeline.enabled and self.role != "node":
            raise ConfigError(
                f"--role {self.role} is for pipeline runs ([pipeline] stages > 1); run "
                f"{self.spec.run.id!r} has one stage"
            )
        if self.role == "stage" and self.stage is not None and not 0 <= self.stage < stages:
            raise ConfigError(f"--stage must be one of 0..{stages - 1} or auto, got {self.stage}")
        if self.max_steps is not None and (self.role != "trainer" or self.max_steps < 1):
            raise ConfigError("--max-steps (at least 1) is for pipeline trainers")

    @property
    def settings(self) -> NodeSection:
        return self.spec.node


def _environment(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    environ = os.environ if environ is None else environ
    unknown = sorted(
        k for k in environ if k.startswith("SWARMGRAD_") and k not in KNOWN_ENVIRONMENT
    )
    if unknown:
        raise ConfigError(
            f"unknown environment variable(s) {', '.join(unknown)}; swarmgrad reads only "
            f"{', '.join(sorted(KNOWN_ENVIRONMENT))}"
        )
    return environ


def home(environ: Mapping[str, str] | None = None) -> Path:
    environ = _environment(environ)
    return Path(environ.get("SWARMGRAD_HOME") or Path.home() / ".swarmgrad").expanduser()


def resolve_settings(
    base: NodeSection, environ: Mapping[str, str], options: Mapping[str, object | None]
) -> NodeSection:
    """``base`` (the spec's ``[node]``), overridden by ``SWARMGRAD_<SETTING>``, then by
    ``options`` (command-line values; None: not given)."""
    unknown = sorted(set(options) - set(SETTINGS))
    if unknown:
        raise ConfigError(f"unknown node setting(s) {', '.join(unknown)}")
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name, kind in SETTINGS.items():
        variable = f"SWARMGRAD_{name.upper()}"
        if variable in environ:
            raw = environ[variable].strip()
            if kind == "int":
                if not re.fullmatch(r"[+-]?\d+", raw):
                    raise ConfigError(f"{variable} must be an integer, got {raw!r}")
                values[name] = int(raw)
            else:
                values[name] = raw
            origin[name] = variable
        if options.get(name) is not None:
            values[name] = options[name]
            origin[name] = "--" + name.replace("_", "-")
    try:
        return dataclasses.replace(base, **values)
    except RunSpecError as error:
        message = str(error)
        for name, source in origin.items():
            message = message.replace(f"node.{name}", source)
        raise ConfigError(message) from None


def read_bootstrap_file(path: Path) -> list[str]:
    """The multiaddrs a bootstrap node wrote with ``--maddrs-file``."""
    try:
        maddrs = json.loads(path.read_text())["maddrs"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"--bootstrap-file {path}: no multiaddrs to read ({error})") from None
    if not isinstance(maddrs, list) or not maddrs or not all(isinstance(m, str) for m in maddrs):
        raise ConfigError(f'--bootstrap-file {path}: expected {{"maddrs": [...]}}')
    return maddrs


def bootstrap_addresses(
    from_spec: Sequence[str],
    from_options: Sequence[str],
    *,
    bootstrap_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[str, ...]:
    """Bootstrap multiaddrs from every layer (spec, ``SWARMGRAD_BOOTSTRAP``, options, a
    bootstrap's multiaddr file), each once, in that order."""
    environ = _environment(environ)
    from_environment = re.split(r"[\s,]+", environ.get("SWARMGRAD_BOOTSTRAP", "").strip())
    from_file = read_bootstrap_file(bootstrap_file) if bootstrap_file is not None else []
    every = (*from_spec, *from_environment, *from_options, *from_file)
    for maddr in every:
        if maddr and not _MULTIADDR.fullmatch(maddr):
            raise ConfigError(
                f"bootstrap address {maddr!r} is not a peer's multiaddr: expected one like "
                f"/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW... (what `swarmgrad bootstrap` prints)"
            )
    return tuple(dict.fromkeys(m for m in every if m))


#: A DHT peer's multiaddr as bootstraps print them: an address, a transport, the peer id.
_MULTIADDR = re.compile(
    r"/(?:ip4|ip6|dns|dns4|dns6)/[^/\s]+/(?:tcp|udp)/\d{1,5}(?:/[a-z0-9-]+)*"
    r"/p2p/[1-9A-HJ-NP-Za-km-z]{1,128}"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandLine:
    """What a node's command line gives, above the spec and the environment."""

    bootstrap: Sequence[str] = ()
    bootstrap_file: Path | None = None
    identity_path: Path | None = None
    cache_dir: Path | None = None
    checkpoint_dir: Path | None = None
    bandwidth: float = 1.0
    upload_bytes_per_second: float | None = None
    #: [node] settings given as options (None: not given); see :func:`resolve_settings`.
    settings: Mapping[str, object | None] = dataclasses.field(default_factory=dict)
    max_epochs: int | None = None
    linger: bool = False
    slowdown: float = 1.0
    status_file: Path | None = None
    display: str = "auto"
    eval_windows: int = 32
    role: str = "node"
    stage: int | None = None
    max_steps: int | None = None


def node_config(
    *,
    spec_path: Path,
    cli: CommandLine | None = None,
    environ: Mapping[str, str] | None = None,
) -> NodeConfig:
    """Build and check a node's configuration: run spec < environment < ``cli`` (options)."""
    cli = cli or CommandLine()
    environ = _environment(environ)
    base = home(environ)
    spec = RunSpec.load(spec_path)
    node = resolve_settings(spec.node, environ, cli.settings)
    maddrs = bootstrap_addresses(
        spec.network.bootstrap, cli.bootstrap, bootstrap_file=cli.bootstrap_file, environ=environ
    )
    # The swarm's and the model's modules import torch (seconds): only once the spec, settings
    # and addresses are known good, and never for the commands that only read this module's
    # files and settings (status, run-key, --help).
    from swarmgrad.node.swarm_config import SwarmConfig
    from swarmgrad.node.training.model import InitWeightsError, init_weights

    if spec.model.init:  # a wrong file is a set-up error, said before the node joins anything
        try:
            init_weights(spec.model)
        except InitWeightsError as error:
            raise ConfigError(str(error)) from None
    network = dataclasses.replace(spec.network, bootstrap=maddrs)
    spec = dataclasses.replace(spec, node=node, network=network)
    checkpoint_dir = cli.checkpoint_dir or base / "checkpoints" / spec.run.id
    try:
        swarm = SwarmConfig(
            host=node.host,
            port=node.port,
            public_host=node.public_host,
            bootstrap=maddrs,
            discovery=node.discovery,
            dht_secret=node.dht_secret,
            bandwidth=cli.bandwidth,
            upload_bytes_per_second=cli.upload_bytes_per_second,
            bans_path=checkpoint_dir / "bans.json",
            run_key_id=known_run_key(spec.run.id, environ) or "",
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return NodeConfig(
        spec=spec,
        swarm=swarm,
        identity_path=cli.identity_path or base / "identity.key",
        cache_dir=cli.cache_dir or base / "cache",
        checkpoint_dir=checkpoint_dir,
        max_epochs=cli.max_epochs,
        linger=cli.linger,
        slowdown=cli.slowdown,
        status_file=cli.status_file,
        display=cli.display,
        eval_windows=cli.eval_windows,
        role=cli.role,
        stage=cli.stage,
        max_steps=cli.max_steps,
    )


def read_spec_text(path: Path) -> str:
    """A run spec file's text (``swarmgrad publish`` seals it as written)."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read run spec {path}: {error}") from None


def joined_runs(environ: Mapping[str, str] | None = None) -> Path:
    """Where ``swarmgrad join`` keeps the specs it fetched and the run keys it was given."""
    return home(environ) / "runs"


def known_run_key(run_id: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The run key fingerprint first given for ``run_id``, if any."""
    return _known_runs(joined_runs(environ) / "known.json").get(run_id)


def _known_runs(path: Path) -> dict[str, str]:
    """Run id -> run key fingerprint, as ``join`` recorded them (empty: no file yet)."""
    try:
        known = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path} is unreadable ({error}): fix or remove it") from None
    if not isinstance(known, dict):
        raise ConfigError(f"{path} is not a JSON object: fix or remove it")
    return {k: v for k, v in known.items() if isinstance(v, str)}


def remember_joined_run(
    run_id: str, run_key_id: str, spec_toml: str, environ: Mapping[str, str] | None = None
) -> Path:
    """Record ``run_key_id`` as ``run_id``'s key and save its spec; the spec's path."""
    folder = joined_runs(environ)
    path = folder / "known.json"
    known = _known_runs(path)
    known[run_id] = run_key_id
    atomic_write(path, json.dumps(known, indent=1, sort_keys=True).encode())
    spec_path = folder / f"{run_id}.toml"
    atomic_write(spec_path, spec_toml.encode())
    return spec_path


def read_allowlist(path: Path) -> list[str]:
    """The peer ids in an allowlist file: one per line, ``#`` starts a comment."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read allowlist {path}: {error}") from None
    peers = []
    for number, line in enumerate(text.splitlines(), 1):
        peer = line.split("#", 1)[0].strip()
        if not peer:
            continue
        if not PEER_ID.fullmatch(peer):
            raise ConfigError(f"{path}:{number}: {peer!r} is not a peer id (sg...)")
        peers.append(peer)
    return peers
