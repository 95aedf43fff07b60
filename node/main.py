"""The node process: one event loop, its children in a TaskGroup, graceful on the first signal.

The loop is started by :func:`swarmgrad.node.tasks.run` (the only ``asyncio.run`` in the node).
The first SIGINT/SIGTERM asks the trainer to stop after its current step and lets go of any
round it waits on; leaving then runs in order (withdraw the peer record, stop the gRPC server
with a grace period, stop the DHT). A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import faulthandler
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from swarmgrad.node import preflight
from swarmgrad.node.config import NodeConfig
from swarmgrad.node.discovery.start import DiscoveryConfig, start_discovery
from swarmgrad.node.display import Display
from swarmgrad.node.files import jsonable, write_json
from swarmgrad.node.identity import Identity
from swarmgrad.node.metrics import MetricsServer, serving
from swarmgrad.node.pipeline.server import serve_stage
from swarmgrad.node.pipeline.trainer import train_pipeline
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.state.checkpoint import Checkpointer
from swarmgrad.node.status import PEERS_PAGE, STATUS_PAGE, peers_page
from swarmgrad.node.swarm import Swarm
from swarmgrad.node.tracking import Tracker
from swarmgrad.node.training.progress import Progress
from swarmgrad.node.training.trainer import Trainer

log = logging.getLogger(__name__)
#: A node not in its swarm after this long writes every thread's stack to stderr (its log), once:
#: a start has stalled (in CI: nothing logged after the peer id for 180 s), and the next one
#: says where. The DHT's own start gives up after 60 s, so a slow start rarely comes this far.
START_STALL_SECONDS = 90.0


def write_status(path: Path, status: dict[str, Any]) -> None:
    """Replace ``path`` atomically, so a reader never sees half a file (strict JSON: null where
    a number is not known)."""
    write_json(path, status)


async def run(config: NodeConfig, stop: asyncio.Event) -> int:
    """The node's part in its run: the whole model, a pipeline stage, or a pipeline trainer."""
    preflight.check(
        config.spec,
        host=config.swarm.host,
        port=config.swarm.port,
        metrics_address=config.settings.metrics_address,
        device=config.settings.device,
        checkpoint_dir=config.checkpoint_dir,
    )  # before the network: a taken port, no CUDA, a missing shard: exit 2, no trace in the DHT
    if config.role == "stage":
        return await serve_stage(config, stop)
    if config.role == "trainer":
        return await train_pipeline(config, stop)
    return await node(config, stop)


async def node(config: NodeConfig, stop: asyncio.Event) -> int:
    settings = config.settings
    identity = Identity.load_or_create(config.identity_path)
    log.info("peer id %s (key %s)", identity.peer_id, config.identity_path)
    for warning in config.spec.warnings():
        log.warning("%s", warning)
    # The checkpoint lock and the metrics socket come after the Swarm: its DHT forks a process,
    # which would inherit them (and hold them past a kill -9 of this one).
    async with _joined(Swarm(config.spec, identity, config.swarm)) as swarm:
        log.info(
            "joined run %s (spec %s); gRPC %s; DHT (%s) %s",
            config.spec.run.id,
            config.spec.short_hash,
            swarm.endpoint,
            config.swarm.discovery,
            " ".join(swarm.visible_maddrs()),
        )
        swarm.metrics.pages[PEERS_PAGE] = lambda: peers_page(config.spec, swarm.peers)
        with (
            Checkpointer(
                config.checkpoint_dir, config.spec, keep=settings.keep_checkpoints
            ) as checkpoints,
            serving(swarm.metrics, settings.metrics_address) as server,
        ):
            return await _train(config, swarm, checkpoints, server, stop)


@contextlib.contextmanager
def _stall_report() -> Iterator[None]:
    """Write every thread's stack to stderr if the block is still running after
    :data:`START_STALL_SECONDS`."""
    faulthandler.dump_traceback_later(START_STALL_SECONDS)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@contextlib.asynccontextmanager
async def _joined(swarm: Swarm) -> AsyncIterator[Swarm]:
    """``async with swarm``, its start under :func:`_stall_report` (and only its start)."""
    with _stall_report():
        await swarm.__aenter__()
    try:
        yield swarm
    finally:
        await swarm.__aexit__(None, None, None)


async def _train(
    config: NodeConfig,
    swarm: Swarm,
    checkpoints: Checkpointer,
    server: MetricsServer | None,
    stop: asyncio.Event,
) -> int:
    # The status after each round: in --status-file, and on the metrics server's STATUS_PAGE
    # (the run page's curves, for a node started without a status file).
    latest: dict[str, Any] = {"error": "no round yet"}
    swarm.metrics.pages[STATUS_PAGE] = lambda: latest  # a snapshot, served from its thread

    def on_progress(progress: Progress) -> None:
        nonlocal latest
        latest = jsonable(  # new containers: the metrics thread never sees one change
            progress.as_dict()
            | {
                "endpoint": swarm.endpoint,
                "metrics_url": server.url if server is not None else "",
                "counts": swarm.counts,
                "failures": swarm.failures,
                "owner_checks": swarm.owner_checks,
                "ban_records": swarm.board.counts if swarm.board is not None else {},
            }
            | swarm.reachability_summary()
        )
        if config.status_file is not None:
            write_status(config.status_file, latest)

    with contextlib.ExitStack() as cleanup:
        tracker = None
        if config.spec.tracking.backends:
            tracker = await asyncio.to_thread(  # imports and files: off the loop
                Tracker,
                config.spec.tracking,
                run_id=config.spec.run.id,
                peer_id=swarm.peer_id,
                folder=config.checkpoint_dir,
                params=tracked_params(config.spec, swarm.peer_id),
            )
            cleanup.callback(tracker.close)
        trainer = Trainer(
            config, swarm, checkpoints=checkpoints, on_progress=on_progress, tracker=tracker
        )
        return await _run_trainer(config, swarm, trainer, stop)


def tracked_params(spec: RunSpec, peer_id: str) -> dict[str, object]:
    """What a tracker run records about the node's run."""
    model = spec.model
    return {
        "run_id": spec.run.id,
        "spec_hash": spec.short_hash,
        "peer_id": peer_id,
        "algorithm": spec.algorithm.name,
        "overlap": spec.algorithm.overlap,
        "inner_steps": spec.algorithm.inner_steps,
        "codec": spec.averaging.codec,
        "group_size": spec.averaging.group_size,
        "model_kind": model.kind,
        "model": model.config.get("model_type", "gpt")
        if model.kind == "hf"
        else f"d{model.d_model}x{model.n_layers}",
        "batch_size": spec.data.batch_size,
        "seq_len": model.seq_len,
    }


async def _run_trainer(
    config: NodeConfig, swarm: Swarm, trainer: Trainer, stop: asyncio.Event
) -> int:
    trainer_stop = threading.Event()
    display = Display(config.display, endpoint=swarm.endpoint, run=config.spec.run.id)

    def train() -> None:
        # CancelledError: let go by a stop while it waited on a round.
        with contextlib.suppress(concurrent.futures.CancelledError):
            trainer.train(trainer_stop)

    async with asyncio.TaskGroup() as tasks:
        training = tasks.create_task(asyncio.to_thread(train), name="trainer")
        tasks.create_task(display.run(trainer.progress, training), name="display")
        stopping = tasks.create_task(stop.wait(), name="signals")
        await asyncio.wait([training, stopping], return_when=asyncio.FIRST_COMPLETED)
        if config.linger and not stop.is_set():  # done training: serve peers until stopped
            log.info("reached epoch %d; serving state until stopped", trainer.progress.epoch)
            await stopping
        if stop.is_set():
            trainer_stop.set()
            swarm.release_waiters()
        stopping.cancel()
    progress = trainer.progress
    log.info(
        "stopped at epoch %d: val loss %.3f (from %.3f), %d samples",
        progress.epoch,
        progress.val_loss,
        progress.initial_val_loss,
        progress.samples,
    )
    return 0


async def bootstrap(
    *,
    host: str,
    port: int,
    initial_peers: list[str],
    maddrs_file: Path | None,
    stop: asyncio.Event,
    backend: str = "hivemind",
    network_secret: str = "",
    identity_path: Path | None = None,
) -> int:
    """A DHT-only node that others join through; prints the multiaddrs to give them.

    Its peer id is ``identity_path``'s key (made there at the first start), so the multiaddrs
    it hands out hold across restarts; without one, a throwaway key. It holds no run's records
    of its own (any run may bootstrap through it): its run and spec are placeholders.
    """
    identity = Identity.load_or_create(identity_path) if identity_path else Identity.generate()
    dht = await start_discovery(
        DiscoveryConfig(
            backend=backend,
            initial_peers=tuple(initial_peers),
            host=host,
            port=port,
            network_secret=network_secret,
            keep_peer_id=True,
        ),
        identity,
        run_id="bootstrap",
        spec_hash=bytes(32),
    )
    try:
        maddrs = dht.visible_maddrs()
        print("bootstrap node up; join with:", flush=True)
        for maddr in maddrs:
            print(f"  --bootstrap {maddr}", flush=True)
        if maddrs_file is not None:
            write_status(maddrs_file, {"maddrs": maddrs})
        await stop.wait()
    finally:
        await dht.close()
    return 0
