"""A pipeline trainer (``swarmgrad node run.toml --role trainer``): it owns the data and the
labels and no parameters, and routes every microbatch through one replica of each stage.

One step: the step's batch (``data.batch_size`` sequences) is cut into ``pipeline.microbatches``
microbatches, all in flight at once. Each goes forward through stages 0..S-2 (Forward), takes
its loss and backward in one hop on the last stage (ForwardLoss, the loss weighted by the
microbatch's share of the batch), and its gradient goes back through stages S-2..0 (Backward).
The step ends when every microbatch's backward has reached stage 0: the stages step their inner
optimizers by accumulated samples, so a step's microbatches never mix parameter versions when
each stage has one replica (then a pipeline trains exactly like the whole model in one process).

Tensors pass through the trainer as they arrive (a stage's encoded outputs become the next
stage's inputs, bytes untouched). The trainer keeps what it sent each stage until that stage's
backward succeeds, for failover:

- Forward fails on a replica (UNAVAILABLE, DRAINING, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED):
  the same inputs go to another replica of that stage; upstream work is not redone.
- Backward fails on the replica that ran the forward: another replica recomputes the forward
  from the resent inputs (stateless backward); NEED_INPUTS (a restarted replica, an evicted
  input) or STALE_VERSION: the same replica gets the inputs resent.
- No live replica for a stage: the trainer waits for one (watching the stage's DHT records) up
  to ``pipeline.wait_seconds``, then fails the step with :class:`StageUnavailable`, which says which
  stage; the next step tries again. It never hangs: every call has a deadline.

Routing is ``routing.py`` (:class:`Router`); the calls, retries and failover of one step are
``client.py`` (:class:`PipelineClient`); this module is the trainer's run loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from swarmgrad.node.config import NodeConfig
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.discovery.start import start_discovery
from swarmgrad.node.files import write_json
from swarmgrad.node.identity import Identity
from swarmgrad.node.pipeline.client import FaultyReplica, PipelineClient, StageUnavailable
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.training.data import load_corpus
from swarmgrad.node.transport.transport import Transport
from swarmgrad.protocol.errors import SwarmgradError
from swarmgrad.protocol.server import ServerLimits

log = logging.getLogger(__name__)


class _StageView(Protocol):
    async def find(self) -> list[PeerRecord]: ...


async def stages_round(views: Sequence[_StageView]) -> int:
    """The round every stage has reached (the lowest stage's highest epoch among its serving
    replicas), from each stage's records: a restarted trainer asks for the round after it, not
    for rounds the stages answer "done" to at once (0 when a stage cannot be read)."""
    reached = []
    for stage, view in enumerate(views):
        try:
            records = await view.find()
        except SwarmgradError:
            return 0
        epochs = [r.epoch for r in records if r.stage == stage and r.state == "serving"]
        reached.append(max(epochs, default=0))
    return min(reached, default=0)


async def train_pipeline(config: NodeConfig, stop: asyncio.Event) -> int:
    """Train through the run's stages until stopped (or ``config.max_steps``)."""
    spec = config.spec
    identity = Identity.load_or_create(config.identity_path)
    discovery = await start_discovery(
        config.swarm.discovery_config(), identity, run_id=spec.run.id, spec_hash=spec.hash
    )
    views = [
        discovery.for_run(stage_spec.run.id, stage_spec.hash)
        for stage_spec in (spec.stage_spec(k) for k in range(spec.pipeline.stages))
    ]
    spans = spec.pipeline.spans(spec.model.n_layers)

    async def refresh(stage: int) -> list[tuple[str, str]]:
        try:
            records: list[PeerRecord] = await views[stage].find()
        except SwarmgradError as error:
            log.warning("could not read stage %d's records: %s", stage, error)
            return []
        # Replicas serving this stage's span; not those joining (catching up with their group)
        # or draining (leaving), which would only answer DRAINING.
        return [
            (r.peer_id, r.endpoint)
            for r in records
            if r.stage == stage
            and (r.span_start, r.span_end) == spans[stage]
            and r.state == "serving"
        ]

    limits = ServerLimits(max_message_bytes=max(16 << 20, 4 * _activation_bytes(spec)))
    transport = Transport(config.swarm.transport(limits))
    corpus = await asyncio.to_thread(
        load_corpus, spec.data, vocab_size=spec.model.vocab_size, cache_dir=config.cache_dir
    )
    batches = corpus.batches(
        seq_len=spec.model.seq_len,
        batch_size=spec.data.batch_size,
        seed=spec.data.seed,
        peer_id=identity.peer_id,
    )
    try:
        async with transport:
            client = PipelineClient(spec, identity, transport, refresh=refresh)
            log.info(
                "trainer %s: %d stages, %d microbatches of %d per step",
                identity.peer_id,
                spec.pipeline.stages,
                spec.pipeline.microbatches,
                spec.data.batch_size // spec.pipeline.microbatches,
            )
            first_round = await stages_round(views)
            if first_round:
                log.info("the stages are at round %d: this trainer's rounds go on from there",
                         first_round)  # fmt: skip
            first_step = first_round * spec.algorithm.inner_steps
            return await _train(
                config, client, iter(batches), stop, identity.peer_id, first_step=first_step
            )
    finally:
        await discovery.close()


@dataclass(slots=True)
class TrainerStatus:
    peer_id: str
    step: int = 0
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    failed_steps: int = 0
    last_error: str = ""
    rounds: list[dict[str, Any]] = field(default_factory=list)


async def _train(
    config: NodeConfig,
    client: PipelineClient,
    batches: Any,
    stop: asyncio.Event,
    peer_id: str,
    *,
    first_step: int = 0,
) -> int:
    status = TrainerStatus(peer_id, step=first_step)
    inputs, targets = next(batches)
    while not stop.is_set() and (config.max_steps is None or status.step < config.max_steps):
        started = time.monotonic()
        try:
            loss = await client.step(status.step, inputs, targets)
        except (StageUnavailable, FaultyReplica) as error:
            status.failed_steps += 1
            client.counters[error.stage].lost_samples += len(inputs)
            status.last_error = str(error)
            log.warning("step %d: %s; trying again", status.step, error)
            _write_status(config.status_file, status, client)
            continue  # the same batch, the same step: what stages accumulated of it counts once
        status.step_seconds.append(time.monotonic() - started)
        status.losses.append(loss)
        status.step += 1
        status.last_error = ""
        log.info("step %d loss %.4f (%.2f s)", status.step, loss, status.step_seconds[-1])
        inner_steps = config.spec.algorithm.inner_steps
        if status.step % inner_steps == 0:  # the round barrier: every stage syncs
            started = time.monotonic()
            outcomes = await client.sync(status.step, status.step // inner_steps)
            seconds = time.monotonic() - started
            status.rounds.append({"step": status.step, "seconds": seconds, "outcomes": outcomes})
            log.info("round %d: %s (%.1f s)", status.step // inner_steps, outcomes, seconds)
        _write_status(config.status_file, status, client)
        inputs, targets = next(batches)
    _write_status(config.status_file, status, client)
    return 0


def _write_status(path: Path | None, status: TrainerStatus, client: PipelineClient) -> None:
    if path is None:
        return
    body = {
        "peer_id": status.peer_id,
        "role": "trainer",
        "step": status.step,
        "losses": status.losses,
        "step_seconds": status.step_seconds,
        "failed_steps": status.failed_steps,
        "last_error": status.last_error,
        "rounds": status.rounds,
        "samples": client.samples,
        "stages": [
            counters.as_dict(client.samples)
            | {
                "replicas": {
                    r.peer_id: {
                        "samples": r.samples,
                        "calls": r.calls,
                        "failures": r.failures,
                        "seconds_per_sample": r.seconds_per_sample,
                    }
                    for r in client.router.replicas[k].values()
                }
            }
            for k, counters in enumerate(client.counters)
        ],
    }
    with contextlib.suppress(OSError):
        write_json(path, body)


def _activation_bytes(spec: RunSpec) -> int:
    return 4 * spec.data.batch_size * spec.model.seq_len * spec.model.d_model
