"""A stage server: one replica of one pipeline stage (``swarmgrad node run.toml --stage K``).

It holds only its stage's layer span (:mod:`swarmgrad.node.pipeline.model`) and serves the
Stage service (:mod:`swarmgrad.protocol.stage`) to the run's trainers. Its compute runs on one
worker thread, in arrival order (the event loop only does I/O and codecs):

- Forward runs the span without autograd and keeps the microbatch's inputs (an LRU cache bounded
  in bytes) for its backward; ForwardLoss (the last stage) runs forward, loss and backward at once.
- Backward recomputes the forward from the kept inputs, or from inputs the trainer resends (after
  a replica died, or when this one evicted them: NEED_INPUTS), and accumulates the parameters'
  gradients. Backward is stateless in that sense: any replica of the stage can run it.
- A microbatch's gradient counts once: a retried backward of one already accumulated (its first
  reply was lost) returns the inputs' gradient without adding to the parameters' again.
- Gradients accumulate in fp64 (:class:`GradientSum`), so their sum does not depend on the
  order microbatches arrive in.
- Once ``data.batch_size`` samples have accumulated, the replica takes an inner AdamW step (its
  version). Its DiLoCo group (the stage's replicas, found under :meth:`RunSpec.stage_spec`)
  averages and takes the outer step when the trainers' round barrier says (Sync: every
  ``algorithm.inner_steps`` trainer steps, all replicas of all stages at once), as whole-model
  nodes do every ``inner_steps`` of their own steps.

The server announces itself in the stage group's DHT records (its endpoint, its throughput);
its status file says what it served. The compute itself is :class:`StageWorker` (``worker.py``);
this module serves it, and moves it between stages when rebalancing says so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from swarmgrad.node.config import NodeConfig
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.discovery.start import start_discovery
from swarmgrad.node.files import write_json
from swarmgrad.node.identity import Identity
from swarmgrad.node.metrics import serving
from swarmgrad.node.pipeline.balance import Move, Settling, choose_stage, plan_move
from swarmgrad.node.pipeline.balance import Replica as BalanceReplica
from swarmgrad.node.pipeline.model import build_stage, parameter_bytes, schema_of
from swarmgrad.node.pipeline.worker import StageWorker
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.state.checkpoint import Checkpointer
from swarmgrad.node.swarm import Swarm
from swarmgrad.node.training.device import pick_device
from swarmgrad.node.training.diloco import DiLoCo
from swarmgrad.protocol.errors import SwarmgradError
from swarmgrad.protocol.stage_service import StageServicer, add_to_server

log = logging.getLogger(__name__)

#: A replica re-announces its throughput when it changed by this share, or this often.
ANNOUNCE_CHANGE = 0.1
ANNOUNCE_SECONDS = 10.0


def status(worker: StageWorker, servicer: StageServicer, swarm: Swarm) -> dict[str, Any]:
    """The stage server's status file."""
    info = worker.info()
    return {
        "peer_id": worker.peer_id,
        "role": "stage",
        "stage": worker.index,
        "span": list(worker.module.span),
        "state": worker.state,
        "version": worker.version,
        "epoch": info.epoch,
        "endpoint": swarm.endpoint,
        "parameter_bytes": info.parameter_bytes,
        "samples_per_second": worker.samples_per_second,
        "queue_depth": worker.queue_depth,
        "stats": {
            "forwards": worker.stats.forwards,
            "backwards": worker.stats.backwards,
            "recomputed": worker.stats.recomputed,
            "duplicates": worker.stats.duplicates,
            "need_inputs": worker.stats.need_inputs,
            "samples": worker.stats.samples,
            "evicted": worker.stats.evicted,
            "rounds": dict(worker.stats.rounds),
            "barrier_timeouts": worker.barrier.timed_out,
        },
        "bytes_in": dict(servicer.bytes_in),
        "bytes_out": dict(servicer.bytes_out),
        "rejections": {f"{s}/{c}": n for (s, c), n in servicer.rejections.counts.items()},
        "checksum": worker.replica.outer.checksum() if worker.replica is not None else "",
        "checkpoint": worker.checkpoint,
        "resumed_from": worker.resumed_from,
    }


async def serve_stage(config: NodeConfig, stop: asyncio.Event) -> int:
    """Serve stage ``config.stage`` (None: ``auto``, the weakest) until stopped, moving to
    another stage when rebalancing says so (drain, leave, join the other stage's group)."""
    identity = Identity.load_or_create(config.identity_path)
    if config.settings.threads:
        torch.set_num_threads(config.settings.threads)
    index = config.stage if config.stage is not None else await _choose(config, identity)
    moves: list[dict[str, Any]] = []
    while True:
        move = await _serve(config, identity, index, stop, moves)
        if move is None:
            return 0
        moves.append({"from": move.source, "to": move.target, "at": time.time()})
        log.info("rebalancing: moving from stage %d to stage %d", move.source, move.target)
        index = move.target


async def _serve(
    config: NodeConfig,
    identity: Identity,
    index: int,
    stop: asyncio.Event,
    moves: list[dict[str, Any]],
) -> Move | None:
    """Serve stage ``index`` until ``stop`` (None) or a move (returned). A replica announces
    its throughput once it has measured it here (0 until then: no plan moves anyone)."""
    spec = config.spec
    module = build_stage(spec.model, spec.pipeline, index, seed=spec.data.seed)
    worker = StageWorker(
        module,
        spec,
        peer_id=identity.peer_id,
        slowdown=config.slowdown,
        device=pick_device(config.settings.device),
    )
    swarm = Swarm(
        spec.stage_spec(index),
        identity,
        config.swarm,
        describe=lambda: {
            "stage": index,
            "span_start": module.span[0],
            "span_end": module.span[1],
            "state": worker.state,
            "queue_depth": worker.queue_depth,
            "version": worker.version,
        },
    )
    servicer = StageServicer(
        schema_of(spec, index),
        worker,
        verifier=swarm.verifier,
        rejections=swarm.rejections,
        pace=swarm.transport.pace if swarm.transport.paced else None,
    )
    swarm.transport.register(lambda server: add_to_server(servicer, server))

    metrics_url = [""]

    def read_status() -> dict[str, Any]:
        return status(worker, servicer, swarm) | {"moves": moves, "metrics_url": metrics_url[0]}

    move: Move | None = None
    try:
        async with swarm, contextlib.AsyncExitStack() as stack:
            start, end = module.span
            log.info(
                "stage %d of %d (layers %d..%d, %.1f MB of parameters) on %s, peer %s",
                index,
                spec.pipeline.stages,
                start,
                end - 1,
                parameter_bytes(module) / 1e6,
                swarm.endpoint,
                identity.peer_id,
            )
            checkpoints = Checkpointer(
                config.checkpoint_dir / f"stage{index}",
                spec.stage_spec(index),
                keep=config.settings.keep_checkpoints,
            )
            stack.enter_context(checkpoints)  # after the swarm: its DHT forks a process
            swarm.metrics.read_stage(read_status)
            served = stack.enter_context(serving(swarm.metrics, config.settings.metrics_address))
            metrics_url[0] = served.url if served is not None else ""
            worker.checkpoints = checkpoints
            worker.checkpoint_every = config.settings.checkpoint_every_rounds
            replica = await asyncio.to_thread(worker.call, _attach, worker, swarm)
            worker.state = "serving"
            swarm.reannounce()
            announced = [0.0, time.monotonic()]  # throughput, when

            def publish() -> None:  # on the worker thread, after each inner step
                value, now = worker.samples_per_second, time.monotonic()
                last, when = announced
                if abs(value - last) > ANNOUNCE_CHANGE * last or now - when > ANNOUNCE_SECONDS:
                    announced[:] = [value, now]
                    swarm.announce_throughput(value)

            worker.on_step = publish
            move = await _until_stop_or_move(config, swarm, worker, index, stop, read_status)
            worker.state = "draining"
            swarm.reannounce()
            # Finish what is queued (new work is refused: DRAINING), then keep the state.
            await worker.drain(spec.pipeline.call_timeout_seconds)
            await asyncio.to_thread(worker.call, worker.save)
            log.info(
                "stage %d leaving at version %d (epoch %d)", index, worker.version, replica.epoch
            )
    finally:
        worker.close()
        if config.status_file is not None:
            with contextlib.suppress(OSError):
                _write(config.status_file, read_status())
    return move


async def _until_stop_or_move(
    config: NodeConfig,
    swarm: Swarm,
    worker: StageWorker,
    index: int,
    stop: asyncio.Event,
    read_status: Callable[[], dict[str, Any]],
) -> Move | None:
    """Rewrite the status file every second until ``stop``, or until rebalancing moves this
    replica (returned)."""
    checks = _rebalance(config, swarm, worker, index)
    rebalance = asyncio.ensure_future(checks) if config.spec.pipeline.rebalance_seconds else None
    try:
        while not stop.is_set():
            if config.status_file is not None:
                _write(config.status_file, read_status())
            if rebalance is not None and rebalance.done():
                return rebalance.result()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        return None
    finally:
        if rebalance is not None:
            rebalance.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await rebalance
        else:
            checks.close()


async def _rebalance(config: NodeConfig, swarm: Swarm, worker: StageWorker, index: int) -> Move:
    """Check the stages every ``pipeline.rebalance_seconds`` (jittered); the move this replica
    is to make, once two checks in a row plan it (from the same replicas: a plan is made only
    on a view that :class:`Settling` saw unchanged for several checks)."""
    spec, me = config.spec, worker.peer_id
    planned: Move | None = None
    settling = Settling()  # replicas on their way between stages are waited for
    while True:
        await asyncio.sleep(spec.pipeline.rebalance_seconds * random.uniform(0.75, 1.25))
        if swarm.reachability_summary()["reachability"] == "relayed":
            continue  # a relayed replica stays where it is (moving it costs the relay too)
        try:
            stages = await _stage_replicas(spec, swarm.records_of)
        except SwarmgradError as error:
            log.info("rebalancing: could not read the stages' records: %s", error)
            continue
        settled = settling.settled(stages)
        if not any(r.peer_id == me for r in stages[index]):
            continue  # our own record is not visible yet: the view is stale
        plan = plan_move(stages, hysteresis=spec.pipeline.hysteresis) if settled else None
        log.debug(
            "rebalancing: throughputs %s, plan %s, waiting for %s",
            _throughputs(stages),
            plan,
            sorted(settling.away),
        )
        if plan is not None and plan.peer_id == me and plan == planned:
            log.info("rebalancing: stages' throughputs %s", _throughputs(stages))
            return plan
        planned = plan


def _throughputs(stages: list[list[BalanceReplica]]) -> list[list[float]]:
    return [[round(r.throughput, 1) for r in stage] for stage in stages]


async def _stage_replicas(
    spec: RunSpec, records_of: Callable[[RunSpec], Awaitable[list[PeerRecord]]]
) -> list[list[BalanceReplica]]:
    found = await asyncio.gather(
        *(records_of(spec.stage_spec(k)) for k in range(spec.pipeline.stages))
    )
    return [  # a draining replica is leaving its stage: not its capacity any more
        [BalanceReplica(r.peer_id, r.throughput) for r in records if r.state != "draining"]
        for records in found
    ]


async def _choose(config: NodeConfig, identity: Identity) -> int:
    """``--stage auto``: the stage with the least announced capacity."""
    spec = config.spec
    discovery = await start_discovery(
        config.swarm.discovery_config(), identity, run_id=spec.run.id, spec_hash=spec.hash
    )
    try:

        async def records_of(stage_spec: RunSpec) -> list[PeerRecord]:
            return await discovery.for_run(stage_spec.run.id, stage_spec.hash).find()

        stages = await _stage_replicas(spec, records_of)
    finally:
        await discovery.close()
    index = choose_stage(stages)
    log.info("--stage auto: stage %d (replicas per stage %s)", index, [len(s) for s in stages])
    return index


class _StageReplica(DiLoCo):
    """A stage's DiLoCo replica. It announces its worker's capacity (what rebalancing
    compares) wherever it publishes, not a trainer's rate of samples (its share of the work):
    that number stood in its record from each round's end until the worker's next announce,
    and a check that read two replicas mid-swap planned a second move (CI)."""

    def __init__(self, worker: StageWorker, swarm: Swarm) -> None:
        self._worker = worker  # before DiLoCo's first publish
        algorithm = worker.algorithm
        super().__init__(
            swarm,
            worker.module,
            inner_steps=algorithm.inner_steps,
            outer_lr=algorithm.outer_lr,
            outer_momentum=algorithm.outer_momentum,
        )

    @property
    def throughput(self) -> float:
        return self._worker.samples_per_second


def _attach(worker: StageWorker, swarm: Swarm) -> DiLoCo:
    """On the worker thread: the stage group's DiLoCo replica, caught up with the group."""
    replica = _StageReplica(worker, swarm)
    restored = worker.checkpoints.latest() if worker.checkpoints is not None else None
    if restored is not None:
        worker.restore(restored, replica)
    with contextlib.suppress(concurrent.futures.CancelledError):
        replica.catch_up()  # the group has moved on past the checkpoint: download its state
    worker.replica = replica
    return replica


def _write(path: Path, status: dict[str, Any]) -> None:
    write_json(path, status)
