"""``swarmgrad simulate``'s options, written once: each field of :class:`SimulateOptions` is an
option of the command (its help, default and choices here; ``node/cli_simulate.py`` makes the
typer parameters from them), and the rules between options (which engine takes which) are
checked here, once, before an engine's own configuration (``swarm_config.SimulationConfig``,
``des.driver.DesConfig``, ``pipeline.PipelineSimulation``) checks its values.

Light on purpose: ``swarmgrad --help`` imports it, and the engines' modules import torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from swarmgrad.node.discovery.base import BackendName

Engine = Literal["processes", "des"]
Launcher = Literal["local", "ray"]

#: The engines' shared defaults (their configurations take them from here).
TIMEOUT_SECONDS = 600.0
DISCOVERY: BackendName = "hivemind"
FORK_NODES = True


class OptionsError(ValueError):
    """Options that do not go together (say which, by their flags)."""


def _option(help: str, *, name: str = "", flag: bool = False) -> Any:
    """A field's option: its help; ``name``: the option's name where it is not the field's
    (``spec`` for ``spec_path``: ``--spec``); ``flag``: a switch, shown without a type."""
    return {"help": help, "name": name, "flag": flag}


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulateOptions:
    """What ``swarmgrad simulate`` was asked for, in the order its help lists it."""

    nodes: int = field(default=4, metadata=_option("Number of node processes."))
    rounds: int = field(default=10, metadata=_option("Outer rounds (epochs) to train."))
    spec_path: Path | None = field(
        default=None,
        metadata=_option("Run spec (default: the demo spec, saved in --out).", name="spec"),
    )
    profile_path: Path | None = field(
        default=None,
        metadata=_option(
            "TOML, one \\[\\[peer]] table each (cycled over the nodes): slowdown, bandwidth, "
            "upload_bytes_per_second, download_bytes_per_second, latency_ms, jitter_ms, loss, nat, "
            "session_seconds, offline_seconds, attack.",
            name="profile",
        ),
    )
    out_dir: Path = field(
        default=Path("simulation"),
        metadata=_option("Folder for logs, status files and summary.json.", name="out"),
    )
    churn_path: Path | None = field(
        default=None,
        metadata=_option(
            "TOML, one \\[\\[event]] each: at_epoch, node, action (kill, stop, start, pause, "
            "resume, partition, heal; real processes partition only with --netem; --stages: "
            "kill, stop, start), and for a kill optionally during (round or state_download).",
            name="churn",
        ),
    )
    discovery: BackendName = field(
        default=DISCOVERY,
        metadata=_option("DHT backend of the bootstrap and the nodes: hivemind or libp2p."),
    )
    timeout_seconds: float = field(
        default=TIMEOUT_SECONDS,
        metadata=_option("Give up after this many seconds.", name="timeout"),
    )
    seed: int | None = field(
        default=None,
        metadata=_option(
            "Derive node i's key (and so its data stream) from this seed and i, so a rerun "
            "sees the same data, and draw the profiles' distributions with it. The keys are "
            "predictable: for experiments only."
        ),
    )
    engine: Engine = field(
        default="processes",
        metadata=_option(
            "processes: real node processes on loopback; des: the discrete-event model "
            "(thousands of peers in seconds, no training: times, bytes and rounds)."
        ),
    )
    netem: bool = field(
        default=False,
        metadata=_option(
            "processes: each node in its own network namespace, links shaped by tbf and "
            "nftables from its profile, partition/heal in the churn schedule (root).",
            flag=True,
        ),
    )
    launcher: Launcher = field(
        default="local",
        metadata=_option(
            "processes: local (children of this one) or ray (actors on a Ray cluster; "
            "the output folder on storage every machine sees)."
        ),
    )
    ray_address: str = field(
        default="",
        metadata=_option(
            "--launcher ray: the cluster to join (ray://... or host:port); empty: a local Ray head."
        ),
    )
    step_seconds: float | None = field(
        default=None,
        metadata=_option(
            "des: one inner step's seconds at slowdown 1 (default: timed here, 1 thread)."
        ),
    )
    codec_values_per_second: float | None = field(
        default=None,
        metadata=_option(
            "des: values/s the run's codec encodes and decodes (default: measured here); "
            "with --step-seconds and --seed, runs repeat exactly on any machine.",
            name="codec_rate",
        ),
    )
    stages: int = field(
        default=0,
        metadata=_option(
            "processes: a pipeline of this many stages: --nodes stage servers (node i "
            "serves stage i mod S) and --trainers trainers; rounds are round barriers."
        ),
    )
    trainers: int = field(default=1, metadata=_option("--stages: the pipeline's trainers."))
    fork_nodes: bool = field(
        default=FORK_NODES,
        metadata=_option(
            "processes: fork the local node processes from one process that imported "
            "the node's modules once (faster starts); --no-fork-nodes starts each from a "
            "fresh interpreter.",
            flag=True,
        ),
    )

    def __post_init__(self) -> None:
        if self.engine == "des" and (self.netem or self.launcher != "local" or self.ray_address):
            raise OptionsError("--engine des models the swarm: no --netem, --launcher or Ray")
        if self.engine == "processes" and (
            self.step_seconds is not None or self.codec_values_per_second is not None
        ):
            raise OptionsError("--step-seconds and --codec-rate are for --engine des")
        if self.stages and (self.engine != "processes" or self.netem or self.launcher != "local"):
            raise OptionsError("--stages runs local processes (no --engine des, --netem or ray)")

    @staticmethod
    def option_name(setting: dataclasses.Field[Any]) -> str:
        """The command's parameter for ``setting`` (typer makes ``--spec`` of ``spec``)."""
        return str(setting.metadata["name"] or setting.name)
