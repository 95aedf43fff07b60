"""The run spec: what every node of one training run must agree on, read from TOML.

Its hash (SHA-256 of a canonical JSON rendering of every field but ``network`` and ``node``)
travels in every DHT key and RPC, so nodes with different specs never mix and say why when they
meet. Unknown sections and keys are errors, as are wrong types and out-of-range values; every
message names the offending ``section.key``.

Example (every section but ``[run]`` may be left out to take the defaults)::

    [run]
    id = "shakespeare-demo"

    [model]
    d_model = 128
    n_layers = 2
    # init = "warm.safetensors"   # optional: start from these weights, pinned by
    # init_sha256 = "9f86d0..."   # their SHA-256

    [algorithm]
    name = "diloco"
    inner_steps = 50

    [averaging]
    codec = "int8"
    group_size = 4

    [trust]     # who may take part, and how owners combine members' values
    mode = "open"

    [network]
    bootstrap = ["/ip4/203.0.113.5/tcp/31337/p2p/Qm..."]

    [node]      # defaults for each node; SWARMGRAD_* variables and options override them
    checkpoint_every_rounds = 5
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmgrad.node.averaging.matchmaking import MAX_MATCHMAKING_TIMEOUT_SECONDS
from swarmgrad.node.discovery.base import BACKENDS
from swarmgrad.protocol import PROTOCOL_VERSION
from swarmgrad.protocol.errors import SetupError

DEVICES = ("auto", "cpu", "cuda")
#: Sections that say how a node takes part, not what the run is: outside the hash.
OPERATIONAL = frozenset({"network", "node", "tracking"})


class RunSpecError(SetupError, ValueError):
    """The run spec is invalid; the message names the key and what is wrong with it."""


def _positive(section: str, **values: float) -> None:
    for key, value in values.items():
        if not value > 0 or not math.isfinite(value):
            raise RunSpecError(f"{section}.{key} must be positive, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSection:
    id: str
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if not self.id or len(self.id) > 64 or not all(c.isalnum() or c in "-_." for c in self.id):
            raise RunSpecError(
                f"run.id must be 1-64 letters, digits, '-', '_' or '.', got {self.id!r}"
            )
        if self.protocol_version != PROTOCOL_VERSION:
            raise RunSpecError(
                f"run.protocol_version {self.protocol_version} is not supported "
                f"(this swarmgrad speaks {PROTOCOL_VERSION})"
            )


#: Model kinds: the built-in GPT, or a transformers causal-LM architecture built from a config.
MODEL_KINDS = ("gpt", "hf")
#: transformers families a run may name in ``model.config.model_type`` (others are untested).
HF_MODEL_TYPES = ("llama", "qwen2", "gpt2", "mistral")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSection:
    """The model: the built-in GPT-style decoder (``kind = "gpt"``, sized by d_model, n_layers
    and n_heads), or a transformers architecture (``kind = "hf"``) from the ``[model.config]``
    table (its ``model_type`` and that family's config keys; vocab_size and seq_len come from
    this section)."""

    kind: str = "gpt"
    #: kind = "hf": the transformers config, e.g. {model_type = "llama", hidden_size = 256, ...}.
    config: dict[str, Any] = field(default_factory=dict)
    vocab_size: int = 2048
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 128
    #: Start from these weights (a safetensors file; a relative path is read from the spec
    #: file's folder) instead of the seeded random ones: a pretrained or warmed-up model.
    init: str = ""
    #: The SHA-256 (hex) of the ``init`` file, required with it: the hash covers this, not the
    #: path, so peers keep the file wherever they like but all start from the same weights.
    init_sha256: str = ""

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len")
        _positive("model", **{k: getattr(self, k) for k in sizes})
        if bool(self.init) != bool(self.init_sha256):
            raise RunSpecError(
                "model.init and model.init_sha256 go together: the file to start from and its "
                "SHA-256 (sha256sum FILE), so every peer starts from the same weights"
            )
        if self.init_sha256 and not (
            len(self.init_sha256) == 64 and all(c in "0123456789abcdef" for c in self.init_sha256)
        ):
            raise RunSpecError(
                f"model.init_sha256 must be 64 lowercase hex digits, got {self.init_sha256!r}"
            )
        if self.kind not in MODEL_KINDS:
            raise RunSpecError(
                f"model.kind must be one of {', '.join(MODEL_KINDS)}, got {self.kind!r}"
            )
        if self.kind == "gpt" and self.config:
            raise RunSpecError('[model.config] is for kind = "hf" (a transformers architecture)')
        if self.kind == "hf":
            model_type = self.config.get("model_type")
            if model_type not in HF_MODEL_TYPES:
                raise RunSpecError(
                    f"model.config.model_type must be one of {', '.join(HF_MODEL_TYPES)}, got "
                    f"{model_type!r}"
                )
            for key in ("vocab_size", "max_position_embeddings", "n_positions"):
                if key in self.config:
                    raise RunSpecError(
                        f"model.config.{key}: set model.vocab_size / model.seq_len instead "
                        f"(the data uses them too)"
                    )
        if self.d_model % self.n_heads:
            raise RunSpecError(
                f"model.d_model ({self.d_model}) must be a multiple of model.n_heads "
                f"({self.n_heads})"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSection:
    source: str = "demo"  # "demo": the bundled corpus; "files": the shards in ``paths``
    #: Shards: text, .jsonl/.json or .parquet files, or glob patterns (node/training/shards.py).
    paths: tuple[str, ...] = ()
    #: A tokenizer.json to use (else a byte-level BPE is trained on the shards).
    tokenizer: str = ""
    #: Its SHA-256: pins the tokenizer for every peer (the path is then not part of the hash).
    tokenizer_sha256: str = ""
    text_field: str = "text"  # the column holding each row's text in jsonl / parquet shards
    batch_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.source not in ("demo", "files"):
            raise RunSpecError(f"data.source must be 'demo' or 'files', got {self.source!r}")
        if self.source == "files" and not self.paths:
            raise RunSpecError("data.paths must list at least one file when data.source = 'files'")
        if (self.tokenizer or self.tokenizer_sha256) and self.source != "files":
            raise RunSpecError("data.tokenizer is for data.source = 'files'")
        if self.tokenizer_sha256 and not (
            self.tokenizer
            and len(self.tokenizer_sha256) == 64
            and all(c in "0123456789abcdef" for c in self.tokenizer_sha256)
        ):
            raise RunSpecError(
                "data.tokenizer_sha256 must be 64 lowercase hex digits, with data.tokenizer"
            )
        _positive("data", batch_size=self.batch_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class AlgorithmSection:
    name: str = "diloco"  # "diloco", or "sync" (per-step gradient averaging, the reference)
    inner_steps: int = 50
    inner_lr: float = 3e-4
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    target_batch_size: int = 256  # sync: samples per global step
    # The inner learning rate's schedule, by inner optimizer step over the whole run (diloco:
    # epoch x inner_steps + steps into the round; sync: the global step): a linear warm-up over
    # warmup_steps, then, if decay_steps > 0, a cosine decay that reaches min_lr_ratio x
    # inner_lr at step decay_steps and stays there. All 0: a constant inner_lr.
    warmup_steps: int = 0
    decay_steps: int = 0
    min_lr_ratio: float = 0.1
    #: diloco: overlap each round's all-reduce with the next round's inner steps (its outer
    #: update lands one round late, the local progress made meanwhile carried onto it).
    overlap: bool = False
    #: diloco: sync the model in this many fragments, one every inner_steps / fragments steps.
    fragments: int = 1

    def __post_init__(self) -> None:
        if self.overlap and self.name != "diloco":
            raise RunSpecError("algorithm.overlap is for algorithm.name = 'diloco'")
        if self.fragments != 1 and self.name != "diloco":
            raise RunSpecError("algorithm.fragments is for algorithm.name = 'diloco'")
        if self.fragments < 1 or self.inner_steps % self.fragments:
            raise RunSpecError(
                f"algorithm.fragments ({self.fragments}) must be at least 1 and divide "
                f"algorithm.inner_steps ({self.inner_steps})"
            )
        if self.name not in ("diloco", "sync"):
            raise RunSpecError(f"algorithm.name must be 'diloco' or 'sync', got {self.name!r}")
        _positive(
            "algorithm",
            inner_steps=self.inner_steps,
            inner_lr=self.inner_lr,
            outer_lr=self.outer_lr,
            target_batch_size=self.target_batch_size,
        )
        if not 0 <= self.outer_momentum < 1:
            raise RunSpecError(
                f"algorithm.outer_momentum must be in [0, 1), got {self.outer_momentum!r}"
            )
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise RunSpecError("algorithm.warmup_steps and algorithm.decay_steps must be >= 0")
        if self.decay_steps and self.decay_steps <= self.warmup_steps:
            raise RunSpecError(
                f"algorithm.decay_steps ({self.decay_steps}) must exceed algorithm.warmup_steps "
                f"({self.warmup_steps}): the decay follows the warm-up (0 turns it off)"
            )
        if not 0 < self.min_lr_ratio <= 1:
            raise RunSpecError(
                f"algorithm.min_lr_ratio must be in (0, 1], got {self.min_lr_ratio!r}"
            )

    def lr_at(self, step: int) -> float:
        """The inner learning rate for inner optimizer step ``step`` (0-based, whole run)."""
        if step < self.warmup_steps:
            return self.inner_lr * (step + 1) / self.warmup_steps
        if not self.decay_steps:
            return self.inner_lr
        done = min(1.0, (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
        floor = self.inner_lr * self.min_lr_ratio
        return floor + (self.inner_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * done))


# What importing ``swarmgrad.compression`` registers (a unit test keeps the two equal).
BUILTIN_CODECS = frozenset({"none", "fp16", "bf16", "int8", "int4", "topk", "powersgd"})


@dataclass(frozen=True, slots=True, kw_only=True)
class AveragingSection:
    codec: str = "int8"
    group_size: int = 4
    chunk_values: int = 1 << 20
    matchmaking_timeout_seconds: float = 15.0
    round_timeout_seconds: float = 60.0
    sender_timeout_seconds: float = 10.0
    reducer_timeout_seconds: float = 20.0

    def __post_init__(self) -> None:
        if self.codec not in BUILTIN_CODECS:
            # Only a codec registered from Python (which imported torch already) needs the
            # registry: the commands that read a spec and train nothing stay free of torch.
            from swarmgrad.compression import codec_names

            if self.codec not in codec_names():
                known = ", ".join(codec_names())
                raise RunSpecError(
                    f"averaging.codec {self.codec!r} is unknown; choose one of {known}"
                )
        if self.group_size < 2:
            raise RunSpecError(f"averaging.group_size must be at least 2, got {self.group_size}")
        _positive(
            "averaging",
            chunk_values=self.chunk_values,
            matchmaking_timeout_seconds=self.matchmaking_timeout_seconds,
            round_timeout_seconds=self.round_timeout_seconds,
            sender_timeout_seconds=self.sender_timeout_seconds,
            reducer_timeout_seconds=self.reducer_timeout_seconds,
        )
        if self.matchmaking_timeout_seconds > MAX_MATCHMAKING_TIMEOUT_SECONDS:
            raise RunSpecError(
                f"averaging.matchmaking_timeout_seconds must be at most "
                f"{MAX_MATCHMAKING_TIMEOUT_SECONDS:g} (readiness records must fit the DHT's "
                f"lifetime cap), got {self.matchmaking_timeout_seconds:g}"
            )
        if not self.sender_timeout_seconds < self.reducer_timeout_seconds:
            raise RunSpecError(
                "averaging.reducer_timeout_seconds must exceed averaging.sender_timeout_seconds"
            )
        if not self.reducer_timeout_seconds <= self.round_timeout_seconds:
            raise RunSpecError(
                "averaging.round_timeout_seconds must be at least averaging.reducer_timeout_seconds"
            )


#: What may cross a pipeline boundary: fp32 ("none"), bf16, or blockwise 8-bit absmax (int8).
PIPELINE_CODECS = ("none", "bf16", "int8")


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSection:
    """Pipeline stages across peers (``node/pipeline/``): the model's layers cut into ``stages``
    spans, each served by stage replicas; trainers own the data and no parameters. One stage
    (the default) is a plain run: every node holds the whole model."""

    stages: int = 1
    #: The first layer of each stage after the first (S - 1 increasing layer indices); empty:
    #: an even split (the first stages take one layer more when it does not divide).
    boundaries: tuple[int, ...] = ()
    #: Microbatches per trainer step (``data.batch_size`` is the step's samples).
    microbatches: int = 4
    #: Codec of the activations sent forward, and of their gradients sent back. fp16 is refused
    #: for gradients: most activation-gradient values lie below its smallest normal number.
    activations: str = "bf16"
    gradients: str = "int8"
    #: A trainer waits this long for a stage with no live replica, then fails the step.
    wait_seconds: float = 30.0
    #: Deadline of one call to a stage replica.
    call_timeout_seconds: float = 20.0
    #: Stage servers check the stages' balance about this often (0: never move).
    rebalance_seconds: float = 60.0
    #: A replica moves only if the weakest stage's capacity grows past 1 / hysteresis.
    hysteresis: float = 0.75

    def __post_init__(self) -> None:
        _positive(
            "pipeline",
            stages=self.stages,
            microbatches=self.microbatches,
            wait_seconds=self.wait_seconds,
            call_timeout_seconds=self.call_timeout_seconds,
        )
        if self.rebalance_seconds < 0 or not 0 < self.hysteresis < 1:
            raise RunSpecError(
                "pipeline.rebalance_seconds must be >= 0 (0: never) and pipeline.hysteresis "
                "in (0, 1)"
            )
        if self.gradients == "fp16":
            raise RunSpecError(
                "pipeline.gradients = 'fp16' is refused: activation gradients underflow fp16 "
                "(most lie below its smallest normal number); use int8, bf16 or none (fp32)"
            )
        for key in ("activations", "gradients"):
            if getattr(self, key) not in PIPELINE_CODECS:
                raise RunSpecError(
                    f"pipeline.{key} must be one of {', '.join(PIPELINE_CODECS)}, got "
                    f"{getattr(self, key)!r}"
                )
        if self.boundaries and len(self.boundaries) != self.stages - 1:
            raise RunSpecError(
                f"pipeline.boundaries needs {self.stages - 1} layer indices (where stages 2.."
                f"{self.stages} start), got {len(self.boundaries)}"
            )
        if any(b <= a for a, b in zip((0, *self.boundaries), self.boundaries, strict=False)):
            raise RunSpecError(
                f"pipeline.boundaries must increase from above 0, got {list(self.boundaries)}"
            )

    @property
    def enabled(self) -> bool:
        return self.stages > 1

    def spans(self, n_layers: int) -> list[tuple[int, int]]:
        """Each stage's layers ``[start, end)``."""
        if self.boundaries:
            starts = [0, *self.boundaries]
        else:
            base, extra = divmod(n_layers, self.stages)
            starts = [k * base + min(k, extra) for k in range(self.stages)]
        return list(zip(starts, [*starts[1:], n_layers], strict=True))


TRUST_MODES = ("trusted", "private", "open")
#: Open runs' group size when the spec gives none: an owner's part then has 7 other members,
#: and two colluders stay a minority of them.
OPEN_GROUP_SIZE = 8
#: The smallest group whose parts' statistics judge members (``node/trust/observations.py``
#: ``MIN_JUDGED_MEMBERS`` other members, the owner's own values being out of its part).
OPEN_JUDGED_GROUP_SIZE = 6
AGGREGATORS = ("mean", "centered_clip", "median", "trimmed_mean")
#: Codecs an open run refuses: low-rank factors and per-member top-k indices cannot be screened
#: or robustly aggregated coordinate by coordinate.
NOT_IN_OPEN_RUNS = frozenset({"powersgd", "topk"})


@dataclass(frozen=True, slots=True, kw_only=True)
class TrustSection:
    """How far peers are trusted.

    ``trusted`` (the default): every peer is honest; owners take the weighted mean. ``open``:
    anyone may join and some may be malicious; owners weigh every member alike, aggregate
    robustly (CenteredClip by default), return results in fp16, score members and stop
    averaging with those whose updates are flagged (node/trust/ledger.py). ``private``: only
    the peers on the allowlist that ``run_key`` signs (``swarmgrad publish --allowlist``) take
    part; everyone else is refused at matchmaking and at every RPC (node/trust/allowlist.py).
    """

    mode: str = "trusted"
    #: "": the mode's own (mean when trusted or private, centered_clip when open).
    aggregator: str = ""
    #: The fingerprint (sg...) of the run key that signs a private run's allowlist.
    run_key: str = ""
    #: Open runs: members of its part each owner spot-checks a round, by the loss their values
    #: take off on windows drawn from (run, peer, round) (node/training/spot_check.py).
    spot_checks: int = 1

    def __post_init__(self) -> None:
        if self.mode not in TRUST_MODES:
            raise RunSpecError(
                f"trust.mode must be one of {', '.join(TRUST_MODES)}, got {self.mode!r}"
            )
        if self.aggregator and self.aggregator not in AGGREGATORS:
            raise RunSpecError(
                f"trust.aggregator must be one of {', '.join(AGGREGATORS)}, got {self.aggregator!r}"
            )
        if self.mode == "private" and not (
            self.run_key.startswith("sg") and 20 <= len(self.run_key) <= 64
        ):
            raise RunSpecError(
                'trust.mode = "private" needs trust.run_key: the fingerprint (sg...) of the run '
                "key that signs the allowlist (swarmgrad run-key FILE prints it)"
            )
        if not 0 <= self.spot_checks <= 64:
            raise RunSpecError(f"trust.spot_checks must be in [0, 64], got {self.spot_checks}")
        if self.mode == "open" and self.aggregator == "mean":
            raise RunSpecError(
                'trust.aggregator = "mean" in an open run: one malicious peer could move the '
                'average anywhere; use "centered_clip" or "median"'
            )

    @property
    def open(self) -> bool:
        return self.mode == "open"

    @property
    def private(self) -> bool:
        return self.mode == "private"

    @property
    def effective_aggregator(self) -> str:
        return self.aggregator or ("centered_clip" if self.open else "mean")


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
    metrics_address: str = "127.0.0.1:9464"  # Prometheus endpoint, host:port, or "off"
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
        if self.metrics_address != "off":
            host, sep, port = self.metrics_address.rpartition(":")
            if not sep or not host or not port.isdigit() or int(port) > 65535:
                raise RunSpecError(
                    f"node.metrics_address must be host:port or 'off', got {self.metrics_address!r}"
                )
        _positive(
            "node",
            checkpoint_every_rounds=self.checkpoint_every_rounds,
            keep_checkpoints=self.keep_checkpoints,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSpec:
    run: RunSection
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    averaging: AveragingSection = field(default_factory=AveragingSection)
    trust: TrustSection = field(default_factory=TrustSection)
    network: NetworkSection = field(default_factory=NetworkSection)
    node: NodeSection = field(default_factory=NodeSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)

    def __post_init__(self) -> None:
        if self.pipeline.enabled:
            self._check_pipeline()
        if self.trust.open and self.averaging.codec in NOT_IN_OPEN_RUNS:
            raise RunSpecError(
                f"averaging.codec {self.averaging.codec!r} is refused when trust.mode = "
                f'"open": its values cannot be checked or robustly aggregated per coordinate; '
                f"use int8, int4, fp16, bf16 or none"
            )

    def warnings(self) -> list[str]:
        """What a user must know about whom this run trusts, and how far (printed by the node
        at start, ``status`` and ``publish``)."""
        out = []
        group = self.averaging.group_size
        if self.trust.open and group < OPEN_JUDGED_GROUP_SIZE:
            out.append(
                f"run {self.run.id!r} is open with averaging.group_size = {group}: an owner's "
                f"part then has at most {group - 1} other members, too few for their "
                f"statistics to flag anyone (two colluders can be most of them), so only "
                f"zero, NaN and replayed updates are banned and noise is merely clipped; "
                f"use {OPEN_GROUP_SIZE} (the default of open runs) or more"
            )
        if self.pipeline.enabled and not self.trust.private:
            out.append(
                f"run {self.run.id!r} uses pipeline stages and is not a private run: stage "
                "replicas are trusted, and wrong activations or gradients from one go "
                "unnoticed. Let only machines you trust serve its stages (docs/pipeline.md)."
            )
        return out

    def _check_pipeline(self) -> None:
        pipeline, model = self.pipeline, self.model
        if model.kind != "gpt":
            raise RunSpecError('[pipeline] stages > 1 needs model.kind = "gpt" (for now)')
        if model.init:
            raise RunSpecError("[pipeline] stages > 1 starts from seeded weights (no model.init)")
        if pipeline.stages > model.n_layers:
            raise RunSpecError(
                f"pipeline.stages ({pipeline.stages}) must be at most model.n_layers "
                f"({model.n_layers}): every stage holds at least one layer"
            )
        if pipeline.boundaries and pipeline.boundaries[-1] >= model.n_layers:
            raise RunSpecError(
                f"pipeline.boundaries must be below model.n_layers ({model.n_layers}), got "
                f"{list(pipeline.boundaries)}"
            )
        if self.data.batch_size % pipeline.microbatches:
            raise RunSpecError(
                f"data.batch_size ({self.data.batch_size}) must be a multiple of "
                f"pipeline.microbatches ({pipeline.microbatches})"
            )
        if self.algorithm.name != "diloco" or self.trust.mode != "trusted":
            raise RunSpecError(
                "[pipeline] stages > 1 runs algorithm.name = 'diloco' in trusted runs (for now)"
            )

    def stage_spec(self, index: int) -> RunSpec:
        """The spec stage ``index``'s replicas share as one DiLoCo group: this one with its run
        id suffixed ``.stage<index>``, so the stage has its own DHT keys, rounds and state."""
        if not 0 <= index < self.pipeline.stages:
            raise RunSpecError(f"stage {index} is not one of 0..{self.pipeline.stages - 1}")
        run = dataclasses.replace(self.run, id=f"{self.run.id}.stage{index}")
        return dataclasses.replace(self, run=run)

    def document(self) -> bytes:
        """JSON of everything but ``network`` and ``node``, local paths included: what a
        checkpoint keeps (``from_dict`` reads it back; its hash is this spec's)."""
        return json.dumps(self._sections(), sort_keys=True, separators=(",", ":")).encode()

    def _sections(self) -> dict[str, Any]:
        return {
            f.name: dataclasses.asdict(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name not in OPERATIONAL
        }

    def canonical(self) -> bytes:
        """Canonical JSON of everything but ``network`` and ``node``: what the hash covers."""
        sections = self._sections()
        del sections["model"]["init"]  # where a peer keeps the file; init_sha256 pins what it is
        if self.model.kind == "gpt":  # runs from before model.kind keep their hash
            del sections["model"]["kind"], sections["model"]["config"]
        else:  # the GPT's own sizes do not apply
            for key in ("d_model", "n_layers", "n_heads"):
                del sections["model"][key]
        data = sections["data"]
        if data["tokenizer_sha256"]:  # pinned by its hash: where a peer keeps it is its own
            del data["tokenizer"]
        for key, default in (("tokenizer", ""), ("tokenizer_sha256", ""), ("text_field", "text")):
            if data.get(key) == default:  # runs from before these keys keep their hash
                data.pop(key)
        if not sections["algorithm"]["overlap"]:  # runs from before overlap keep their hash
            del sections["algorithm"]["overlap"]
        if sections["algorithm"]["fragments"] == 1:  # ... and from before fragments
            del sections["algorithm"]["fragments"]
        if self.trust == TrustSection():  # runs from before [trust] keep their hash
            del sections["trust"]
        if not self.pipeline.enabled:  # ... and from before [pipeline]
            del sections["pipeline"]
        return json.dumps(sections, sort_keys=True, separators=(",", ":")).encode()

    @property
    def hash(self) -> bytes:
        """SHA-256 of :meth:`canonical`."""
        return hashlib.sha256(self.canonical()).digest()

    def differences(self, other_canonical: bytes, *, limit: int = 5) -> list[str]:
        """``section.key: here X, there Y`` for each field where another spec differs from this."""
        try:
            theirs = json.loads(other_canonical)
        except (ValueError, RecursionError):  # any peer may file a spec: "[[[[..." included
            return ["the other spec is not readable"]
        if not isinstance(theirs, dict):
            return ["the other spec is not readable"]
        mine = json.loads(self.canonical())
        found = []
        for section in sorted(set(mine) | set(theirs)):
            a, b = mine.get(section, {}), theirs.get(section, {})
            if not isinstance(a, dict) or not isinstance(b, dict):
                found.append(f"[{section}] differs")
                continue
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    found.append(f"{section}.{key}: here {a.get(key)!r}, there {b.get(key)!r}")
        return found[:limit]

    @property
    def short_hash(self) -> str:
        return self.hash.hex()[:12]

    @classmethod
    def from_toml(cls, text: str) -> RunSpec:
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise RunSpecError(f"not valid TOML: {error}") from None
        except RecursionError:  # tomllib recurses per nested array: a published spec is a peer's
            raise RunSpecError("not valid TOML: nested too deeply") from None
        return cls.from_dict(raw)

    @classmethod
    def load(cls, path: Path) -> RunSpec:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise RunSpecError(f"cannot read run spec {path}: {error.strerror}") from None
        except UnicodeDecodeError:
            raise RunSpecError(f"run spec {path} is not UTF-8 text (TOML must be)") from None
        try:
            spec = cls.from_toml(text)
        except RunSpecError as error:
            raise RunSpecError(f"{path}: {error}") from None
        if spec.model.init and not Path(spec.model.init).is_absolute():
            init = str(path.absolute().parent / spec.model.init)
            spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, init=init))
        return spec

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunSpec:
        sections = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(sections))
        if unknown:
            raise RunSpecError(
                f"unknown section(s) {', '.join(unknown)}; known: {', '.join(sections)}"
            )
        if "run" not in raw:
            raise RunSpecError("the [run] section (with at least id = ...) is required")
        hints = typing.get_type_hints(cls)
        built = {name: _build(name, hints[name], value) for name, value in raw.items()}
        trust, averaging = raw.get("trust", {}), raw.get("averaging", {})
        if trust.get("mode") == "open" and "group_size" not in averaging:
            built["averaging"] = dataclasses.replace(
                built.get("averaging", AveragingSection()), group_size=OPEN_GROUP_SIZE
            )
        return cls(**built)


def _build(section: str, kind: type[Any], raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise RunSpecError(f"[{section}] must be a table")
    fields = {f.name: f for f in dataclasses.fields(kind)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise RunSpecError(
            f"unknown key(s) {', '.join(f'{section}.{k}' for k in unknown)}; "
            f"known: {', '.join(fields)}"
        )
    hints = typing.get_type_hints(kind)
    values = {key: _check(f"{section}.{key}", hints[key], value) for key, value in raw.items()}
    try:
        return kind(**values)
    except TypeError as error:  # a required key is missing
        raise RunSpecError(f"[{section}]: {error}") from None


def _check(name: str, kind: Any, value: Any) -> Any:
    """``value`` as ``kind`` (int, float, str, tuple[str, ...], or a table of TOML scalars and
    lists of them), or a RunSpecError."""
    if typing.get_origin(kind) is dict:
        if not isinstance(value, dict):
            raise RunSpecError(f"{name} must be a table, got {value!r}")
        for key, item in value.items():
            items = item if isinstance(item, list) else [item]
            if not all(isinstance(i, bool | int | float | str) for i in items):
                raise RunSpecError(f"{name}.{key} must be a number, string, boolean or list")
        return dict(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise RunSpecError(f"{name} must be true or false, got {value!r}")
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        if not isinstance(value, list) or not all(
            isinstance(v, item) and not isinstance(v, bool) for v in value
        ):
            what = "integers" if item is int else "strings"
            raise RunSpecError(f"{name} must be a list of {what}, got {value!r}")
        return tuple(value)
    if (
        isinstance(kind, type)
        and not isinstance(kind, types.GenericAlias)
        and (isinstance(value, bool) or not isinstance(value, kind))
    ):
        raise RunSpecError(f"{name} must be {kind.__name__}, got {value!r}")
    return value
