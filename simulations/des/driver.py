"""``swarmgrad simulate --engine des``: the same run spec, profile and churn schedule as the real
processes, through the discrete-event model; the same summary.json."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from swarmgrad.node.files import jsonable
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.training.model import parameter_count
from swarmgrad.simulations.churn import ScheduleError, load_schedule
from swarmgrad.simulations.des import calibrate
from swarmgrad.simulations.des.model import ModelConfig, simulate
from swarmgrad.simulations.profiles import SimulationError, load_profile

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class DesConfig:
    nodes: int
    rounds: int
    out_dir: Path
    spec_path: Path | None = None  # None: the demo spec
    profile_path: Path | None = None
    churn_path: Path | None = None
    seed: int = 0
    #: One inner step at slowdown 1 (None: timed on this machine, as ``simulate``'s nodes run).
    step_seconds: float | None = None
    #: Values the run's codec encodes and decodes a second (None: measured on this machine; a
    #: model too large to measure here assumes its codec costs nothing).
    codec_values_per_second: float | None = None
    dht_seconds: float = 0.05

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.rounds < 1:
            raise SimulationError("--nodes and --rounds must be at least 1")
        for flag, value in (
            ("--step-seconds", self.step_seconds),
            ("--codec-rate", self.codec_values_per_second),
        ):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise SimulationError(f"{flag} must be a positive finite number, got {value}")


def load_spec(path: Path | None) -> RunSpec:
    from swarmgrad.simulations.swarm import DEMO_SPEC

    return RunSpec.load(path) if path is not None else RunSpec.from_toml(DEMO_SPEC)


def model_config(config: DesConfig) -> ModelConfig:
    """The model's inputs: the files read and checked, this machine's speeds measured."""
    try:
        events = load_schedule(config.churn_path, nodes=config.nodes) if config.churn_path else []
    except ScheduleError as error:
        raise SimulationError(str(error)) from None
    slots = max([config.nodes - 1, *(e.node for e in events)]) + 1
    spec = load_spec(config.spec_path)
    profiles = load_profile(config.profile_path, slots, seed=config.seed)
    step = config.step_seconds
    if step is None:
        step = calibrate.step_seconds(spec)
        log.info("one inner step takes %.4f s here (1 thread)", step)
    codec_rate = config.codec_values_per_second
    if codec_rate is None and parameter_count(spec.model) <= calibrate.MAX_MEASURED_PARAMETERS:
        codec_rate = calibrate.codec_values_per_second(spec)
        log.info("the codec does %.3g values/s here (pass --codec-rate to fix it)", codec_rate)
    return ModelConfig(
        spec=spec,
        nodes=config.nodes,
        rounds=config.rounds,
        profiles=tuple(profiles),
        step_seconds=step,
        events=tuple(events),
        seed=config.seed,
        dht_seconds=config.dht_seconds,
        codec_values_per_second=codec_rate,
    )


def run(config: DesConfig) -> dict[str, Any]:
    """Model the swarm; its summary, also written to ``out_dir/summary.json``."""
    model = model_config(config)
    summary = simulate(model)
    summary["profiles"] = [asdict(p) for p in model.profiles]
    summary["model"] = {
        "step_seconds": model.step_seconds,
        "codec_values_per_second": model.codec_values_per_second,
        "dht_seconds": model.dht_seconds,
        "seed": model.seed,
    }
    config.out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Any] = jsonable(summary)
    text = json.dumps(written, indent=1, default=str, allow_nan=False)
    (config.out_dir / "summary.json").write_text(text)
    return written
