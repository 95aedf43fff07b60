"""The discrete-event model's input: one modelled swarm (``ModelConfig``)."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import simpy

from swarmgrad.node.runspec import RunSpec
from swarmgrad.simulations.churn import ChurnEvent
from swarmgrad.simulations.profiles import PeerProfile, SimulationError

Events = Generator[simpy.Event, Any, Any]
#: A link with no cap in the profile (loopback, or a datacentre): 10 Gbit/s.
UNCAPPED_BYTES_PER_SECOND = 1.25e9


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """One modelled swarm: ``nodes`` peers from the start (``profiles`` has one per slot, the
    churn schedule's newcomers included), trained to ``rounds`` epochs."""

    spec: RunSpec
    nodes: int
    rounds: int
    profiles: tuple[PeerProfile, ...]
    #: One inner step at slowdown 1 on a whole core (measure it: ``calibrate.step_seconds``).
    step_seconds: float
    events: tuple[ChurnEvent, ...] = ()
    seed: int = 0
    #: A DHT write becoming visible to readers, or one read.
    dht_seconds: float = 0.05
    #: Per round, besides matchmaking and the transfers: the outer step, bookkeeping.
    round_overhead_seconds: float = 0.0
    #: Values a peer encodes or decodes per second (None: free).
    codec_values_per_second: float | None = None
    #: Stop (and say so) if the swarm is not done by this simulated time.
    max_simulated_seconds: float = 30 * 24 * 3600.0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.rounds < 1:
            raise SimulationError("nodes and rounds must be at least 1")
        if len(self.profiles) < max([self.nodes - 1, *(e.node for e in self.events)]) + 1:
            raise SimulationError("one profile per node slot is needed")
        if not self.step_seconds > 0 or self.dht_seconds < 0 or self.round_overhead_seconds < 0:
            raise SimulationError("step_seconds must be positive, the overheads >= 0")
        if self.spec.algorithm.name != "diloco":
            # Sync averages every step's gradients and its state holds the optimizer's moments:
            # the model's rounds (H inner steps, then one exchange of theta) are DiLoCo's.
            raise SimulationError(
                f"the discrete-event model runs DiLoCo only, not algorithm.name = "
                f'{self.spec.algorithm.name!r}: model the run with algorithm.name = "diloco" '
                f"or simulate it with real processes (--engine processes)"
            )
