"""The operational sections, outside the spec's hash: ``[network]``, ``[tracking]``, ``[node]``
(a node's defaults; ``SWARMGRAD_*`` variables and options override them)."""

from __future__ import annotations

from dataclasses import dataclass

from swarmgrad.node.discovery.base import BACKENDS
from swarmgrad.node.runspec.errors import RunSpecError, positive

DEVICES = ("auto", "cpu", "cuda")


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


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSection:
    """Defaults for this run's nodes, which each node may override (``SWARMGRAD_*`` variables,
    then command-line options). Operational: not part of the spec hash."""

    host: str = "127.0.0.1"  # where to serve gRPC and the DHT
    port: int = 0  # gRPC port; 0: any free port
    public_host: str = ""  # the address peers dial, if not host (a container's name)
    device: str = "auto"  # auto, cpu or cuda
    threads: int = 0  # torch CPU threads; 0: torch's default
    compile: str = "off"  # on: torch.compile the model's training step (minutes of start-up)
    peak_tflops: int = 0  # the device's dense bf16 peak for MFU; 0: known GPUs' datasheet figure
    #: Prometheus endpoint: host:port, "auto" (127.0.0.1:9464, else a free port) or "off".
    metrics_address: str = "auto"
    checkpoint_every_rounds: int = 10
    keep_checkpoints: int = 3
    discovery: str = "hivemind"  # the DHT backend: hivemind or libp2p (pure Python)
    dht_secret: str = ""  # libp2p only: a private run's DHT key (never merges with others)

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
        if self.compile not in ("off", "on"):
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
        positive(
            "node",
            checkpoint_every_rounds=self.checkpoint_every_rounds,
            keep_checkpoints=self.keep_checkpoints,
        )
