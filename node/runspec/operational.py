"""The operational sections, outside the spec's hash: ``[network]``, ``[tracking]``, ``[node]``
(a node's defaults; ``SWARMGRAD_*`` variables and options override them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from swarmgrad.node.discovery.base import BACKENDS
from swarmgrad.node.runspec.errors import RunSpecError, positive

DEVICES = ("auto", "cpu", "cuda")
SWITCH = ("off", "on")


@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkSection:
    """Where to find the swarm. Operational: not part of the spec hash."""

    bootstrap: tuple[str, ...] = ()


#: Experiment trackers a node can report its rounds to (each needs its package installed).
TRACKERS = ("mlflow", "wandb", "trackio")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackingSection:
    """Where each node reports its rounds (loss, tokens/s, bytes, utilization). Operational:
    not part of the spec hash. Off (no backends) by default."""

    backends: tuple[str, ...] = ()  # any of mlflow, wandb, trackio
    #: MLflow's tracking URI; "": a file store in the node's checkpoint folder (mlruns/).
    uri: str = ""
    project: str = ""  # the experiment / project name; "": the run id

    def __post_init__(self) -> None:
        unknown = sorted(set(self.backends) - set(TRACKERS))
        if unknown:
            raise RunSpecError(
                f"tracking.backends: unknown {', '.join(unknown)} (known: {', '.join(TRACKERS)})"
            )


def _setting(default: Any, panel: str, help: str, choices: tuple[str, ...] = ()) -> Any:
    """A ``[node]`` setting: its default, and what the ``node`` command's option says of it (its
    help panel, its help, its choices): the options are made from these (``cli_settings.py``)."""
    return field(default=default, metadata={"panel": panel, "help": help, "choices": choices})


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSection:
    """Defaults for this run's nodes, which each node may override (``SWARMGRAD_*`` variables,
    then command-line options). Operational: not part of the spec hash."""

    host: str = _setting("127.0.0.1", "Network", "Address to serve gRPC and the DHT on")
    port: int = _setting(0, "Network", "gRPC port (0: any free port)")
    public_host: str = _setting(
        "", "Network", "Address peers dial, if not --host (a container's name)"
    )
    device: str = _setting("auto", "Device", "The device to train on", DEVICES)
    threads: int = _setting(0, "Device", "Torch CPU threads (0: torch's default)")
    compile: str = _setting(
        "off", "Device", "torch.compile the training step (faster on GPUs, slow start)", SWITCH
    )
    peak_tflops: int = _setting(
        0,
        "Device",
        "The device's dense bf16 peak for MFU, in whole TFLOP/s (0: known GPUs' figure)",
    )
    metrics_address: str = _setting(
        "auto",
        "Network",
        "Serve Prometheus metrics on host:port, 'auto' (127.0.0.1:9464, else a free port) or 'off'",
    )
    checkpoint_every_rounds: int = _setting(
        10, "Files", "Write a checkpoint every this many rounds"
    )
    checkpoint_every_seconds: int = _setting(
        600,
        "Files",
        "Also write one mid-round once this many seconds of training are in no round or "
        "checkpoint yet: a crash loses at most that much (0: off)",
    )
    keep_checkpoints: int = _setting(3, "Files", "Keep this many newest checkpoints")
    discovery: str = _setting(
        "hivemind", "Network", "DHT backend (libp2p: pure Python, anywhere)", BACKENDS
    )
    dht_secret: str = _setting(
        "", "Network", "libp2p: a private run's DHT key; nodes without it cannot connect"
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise RunSpecError(f"node.port must be in [0, 65535], got {self.port}")
        if self.host in ("0.0.0.0", "::") and not self.public_host:
            raise RunSpecError(
                f"node.host {self.host} listens everywhere: set node.public_host to the address "
                f"peers should dial"
            )
        if self.device not in DEVICES:
            raise RunSpecError(
                f"node.device must be one of {', '.join(DEVICES)}, got {self.device!r}"
            )
        if self.discovery not in BACKENDS:
            raise RunSpecError(
                f"node.discovery must be one of {', '.join(BACKENDS)}, got {self.discovery!r}"
            )
        if self.dht_secret and self.discovery != "libp2p":
            raise RunSpecError('node.dht_secret needs node.discovery = "libp2p"')
        if self.compile not in SWITCH:
            raise RunSpecError(f"node.compile must be off or on, got {self.compile!r}")
        if self.peak_tflops < 0:
            raise RunSpecError(f"node.peak_tflops must be >= 0, got {self.peak_tflops}")
        if self.threads < 0:
            raise RunSpecError(f"node.threads must be 0 (torch's default) or more: {self.threads}")
        if self.metrics_address not in ("off", "auto"):
            host, sep, port = self.metrics_address.rpartition(":")
            if not sep or not host or not port.isdigit() or int(port) > 65535:
                raise RunSpecError(
                    "node.metrics_address must be host:port, 'auto' or 'off', got "
                    f"{self.metrics_address!r}"
                )
        if self.checkpoint_every_seconds < 0:
            raise RunSpecError(
                "node.checkpoint_every_seconds must be 0 (off) or more, got "
                f"{self.checkpoint_every_seconds}"
            )
        positive(
            "node",
            checkpoint_every_rounds=self.checkpoint_every_rounds,
            keep_checkpoints=self.keep_checkpoints,
        )
