"""A stage replica's compute: its layer span, the inputs it keeps for backwards, its gradient
sum and inner steps, all on one worker thread (``server.py`` serves it; what it does with a
microbatch is told there)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from swarmgrad.node.pipeline.barrier import RoundBarrier
from swarmgrad.node.pipeline.model import GradientSum, Stage, module_index, parameter_bytes
from swarmgrad.node.pipeline.throughput import Throughput
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.state.checkpoint import (
    Checkpoint,
    Checkpointer,
    CheckpointError,
    load_optimizer_state,
    optimizer_state,
)
from swarmgrad.node.training.diloco import DiLoCo
from swarmgrad.node.training.step import set_lr
from swarmgrad.protocol.errors import ProtocolViolation
from swarmgrad.protocol.stage import Computed, Microbatch
from swarmgrad.protocol.v1 import stage_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Inputs kept for backwards, at most (the oldest go first; a trainer resends what is gone).
CACHE_BYTES = 256 * 1024 * 1024
#: A backward from inputs kept at a forward this many inner steps old, or older, is refused
#: (STALE_VERSION): its gradient would belong to parameters long gone.
MAX_STALE_STEPS = 4
#: Microbatches remembered as accumulated (for de-duplication).
DEDUP_MEMORY = 4096


@dataclass(slots=True)
class WorkerStats:
    """What a stage replica did."""

    forwards: int = 0
    backwards: int = 0
    recomputed: int = 0  # backwards from inputs the trainer resent
    duplicates: int = 0  # backwards of microbatches already accumulated
    need_inputs: int = 0
    samples: int = 0  # accumulated into inner steps
    evicted: int = 0
    rounds: Counter[str] = field(default_factory=Counter)  # outer rounds by outcome


class StageWorker:
    """The replica's compute (a :class:`swarmgrad.protocol.stage.StageBackend`): its span, its
    inner optimizer, the inputs kept for backwards, one worker thread."""

    def __init__(
        self,
        module: Stage,
        spec: RunSpec,
        *,
        peer_id: str,
        slowdown: float = 1.0,
        cache_bytes: int = CACHE_BYTES,
        device: torch.device | None = None,
    ) -> None:
        # On a GPU the span computes in fp32 like on a CPU (replicas on either agree), and only
        # encoded payloads cross PCIe: inputs are decoded on the host and moved over, outputs
        # encoded where they are.
        self.device = device if device is not None else torch.device("cpu")
        module.to(self.device)
        self.module, self.spec, self.peer_id = module, spec, peer_id
        self.index = module_index(module, spec)
        self.algorithm = spec.algorithm
        self.batch_size = spec.data.batch_size
        self.slowdown = slowdown
        self.optimizer = torch.optim.AdamW(
            module.parameters(), lr=spec.algorithm.inner_lr, weight_decay=0.0
        )
        self.gradients = GradientSum(module)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stage")
        self._cache: OrderedDict[tuple[str, int, int], tuple[torch.Tensor, int]] = OrderedDict()
        self._cache_bytes, self._max_cache_bytes = 0, cache_bytes
        self._accumulated: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        #: Inner steps taken: the version each reply names.
        self.version = 0
        #: Samples accumulated towards the next inner step.
        self.pending_samples = 0
        self._queued: set[asyncio.Future[Any]] = set()
        self.throughput = Throughput()
        self.replica: DiLoCo | None = None
        self.state = "joining"
        self.stats = WorkerStats()
        self.barrier = RoundBarrier()
        self.checkpoints: Checkpointer | None = None
        self.checkpoint_every = 0  # rounds; 0: only when leaving
        self.checkpoint = ""  # the last one written
        self.resumed_from = ""
        self.on_step: Callable[[], None] = lambda: None

    # -- StageBackend -------------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        return self.state == "serving"

    def info(self) -> stage_pb2.StageInfo:
        start, end = self.module.span
        return stage_pb2.StageInfo(
            peer_id=self.peer_id,
            stage=self.index,
            layer_start=start,
            layer_end=end,
            version=self.version,
            epoch=self.replica.epoch if self.replica is not None else 0,
            state=self.state,
            samples_per_second=self.samples_per_second,
            queue_depth=self.queue_depth,
            parameter_bytes=parameter_bytes(self.module),
            activations=self.spec.pipeline.activations,
            gradients=self.spec.pipeline.gradients,
        )

    async def forward(self, mb: Microbatch, inputs: torch.Tensor) -> Computed:
        self.barrier.heard(mb.trainer)
        return await self._run(self._forward, mb, inputs)

    async def forward_loss(
        self, mb: Microbatch, inputs: torch.Tensor, labels: torch.Tensor, scale: float
    ) -> Computed:
        self.barrier.heard(mb.trainer)
        return await self._run(self._forward_loss, mb, inputs, labels, scale)

    async def backward(
        self, mb: Microbatch, version: int, grad_outputs: torch.Tensor, inputs: torch.Tensor | None
    ) -> Computed:
        self.barrier.heard(mb.trainer)
        return await self._run(self._backward, mb, version, grad_outputs, inputs)

    # -- the worker thread --------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        self._queued.add(future)
        try:
            return await future
        finally:
            self._queued.discard(future)

    @property
    def queue_depth(self) -> int:
        return len(self._queued)

    async def drain(self, timeout_seconds: float) -> None:
        """Until the work queued now is done (at most ``timeout_seconds``)."""
        if self._queued:
            await asyncio.wait(set(self._queued), timeout=timeout_seconds)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the worker thread (from another thread) and wait for it."""
        return self._executor.submit(fn, *args).result()

    def _forward(self, mb: Microbatch, inputs: torch.Tensor) -> Computed:
        started = time.monotonic()
        inputs = self._here(inputs)
        with torch.no_grad():
            outputs = self.module(inputs)
        self._keep(mb, inputs)
        self.stats.forwards += 1
        self._done()
        self._slow(started)
        seconds = time.monotonic() - started
        # Its compute, too: the backward recomputes it, and counting that alone put a non-last
        # stage's throughput a third above what it serves (a head stage's loss is one call).
        self.throughput.work(0, seconds)
        return Computed(outputs, self.version, seconds)

    def _forward_loss(
        self, mb: Microbatch, inputs: torch.Tensor, labels: torch.Tensor, scale: float
    ) -> Computed:
        started = time.monotonic()
        inputs, labels = self._here(inputs), self._here(labels)
        x = inputs if self.module.first else inputs.detach().requires_grad_()
        loss = self.module.loss(x, labels)
        grad, fresh = self._backpropagate(mb, loss * scale, x, None)
        version = self.version
        self._count(len(inputs) if fresh else 0, started)
        seconds = time.monotonic() - started
        return Computed(grad, version, seconds, self.pending_samples, float(loss.detach()))

    def _backward(
        self, mb: Microbatch, version: int, grad_outputs: torch.Tensor, inputs: torch.Tensor | None
    ) -> Computed:
        started = time.monotonic()
        kept = self._cache.pop(mb.key, None)
        if kept is not None:
            self._cache_bytes -= kept[0].nbytes
        if inputs is None:
            if kept is None:
                self.stats.need_inputs += 1
                raise ProtocolViolation(
                    ResultCode.NEED_INPUTS, f"microbatch {mb.key[1:]} is not held here: resend"
                )
            inputs, kept_version = kept
            if self.version - kept_version >= MAX_STALE_STEPS:
                raise ProtocolViolation(
                    ResultCode.STALE_VERSION,
                    f"the forward ran at step {kept_version}, this replica is at {self.version}",
                )
        else:
            self.stats.recomputed += 1
            inputs = self._here(inputs)
        grad_outputs = self._here(grad_outputs)
        if len(grad_outputs) != len(inputs):
            raise ProtocolViolation(
                ResultCode.BAD_SHAPE,
                f"gradients for {len(grad_outputs)} sequences, inputs of {len(inputs)}",
            )
        x = inputs if self.module.first else inputs.detach().requires_grad_()
        outputs = self.module(x)  # recomputed: the forward kept no activations
        grad, fresh = self._backpropagate(mb, outputs, x, grad_outputs)
        version = self.version
        self._count(len(inputs) if fresh else 0, started)
        return Computed(grad, version, time.monotonic() - started, self.pending_samples)

    def _backpropagate(
        self,
        mb: Microbatch,
        outputs: torch.Tensor,
        x: torch.Tensor,
        grad_outputs: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, bool]:
        """The inputs' gradient (None on stage 0), and whether the parameters' gradients were
        accumulated: once per microbatch, so a retry's are not."""
        self.stats.backwards += 1
        if mb.key in self._accumulated:
            self.stats.duplicates += 1
            if self.module.first:
                return None, False
            (grad,) = torch.autograd.grad(outputs, [x], grad_outputs)
            return grad, False
        outputs.backward(grad_outputs)  # type: ignore[no-untyped-call]
        self.gradients.collect()
        self._accumulated[mb.key] = None
        while len(self._accumulated) > DEDUP_MEMORY:
            self._accumulated.popitem(last=False)
        return (None if self.module.first else x.grad), True

    def _keep(self, mb: Microbatch, inputs: torch.Tensor) -> None:
        old = self._cache.pop(mb.key, None)
        if old is not None:
            self._cache_bytes -= old[0].nbytes
        self._cache[mb.key] = (inputs, self.version)
        self._cache_bytes += inputs.nbytes
        while self._cache_bytes > self._max_cache_bytes and self._cache:
            _, (dropped, _) = self._cache.popitem(last=False)
            self._cache_bytes -= dropped.nbytes
            self.stats.evicted += 1

    def _here(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=True)  # the tensor itself if already there

    def _done(self) -> None:
        """Wait for the GPU's queued work: what is measured is its compute, not its launch."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _slow(self, started: float) -> None:
        if self.slowdown > 1:  # a slower machine, simulated
            time.sleep((time.monotonic() - started) * (self.slowdown - 1))

    def _count(self, samples: int, started: float) -> None:
        """One microbatch's backward done: measure it, and step once a batch has accumulated.
        A retried microbatch counts no samples (its gradient was accumulated the first time):
        counted again, it stepped on part of a batch, or on a zero gradient that AdamW's
        momentum still moved the weights with."""
        self._done()
        self._slow(started)
        self.throughput.work(samples, time.monotonic() - started)
        self.pending_samples += samples
        if self.pending_samples >= self.batch_size:
            self._inner_step()

    def _inner_step(self) -> None:
        schedule = self.replica.schedule_step if self.replica is not None else self.version
        set_lr(self.optimizer, self.algorithm.lr_at(schedule))
        self.gradients.release()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        samples, self.pending_samples = self.pending_samples, 0
        self.stats.samples += samples
        self.throughput.step()
        self.version += 1
        if self.replica is not None:
            self.replica.count(samples)
        self.on_step()

    # -- checkpoints (on the worker thread) ----------------------------------------------------

    def save(self) -> None:
        """Write this replica's state: the stage group's DiLoCo state, the inner optimizer, the
        version. Gradients of a batch not yet stepped are not kept."""
        if self.checkpoints is None or self.replica is None:
            return
        tensors, replica_meta = self.replica.state_dict()
        optimizer_tensors, optimizer_meta = optimizer_state(self.optimizer)
        meta = {"replica": replica_meta, "optimizer": optimizer_meta, "version": self.version}
        try:
            path = self.checkpoints.save(
                epoch=self.replica.epoch,
                step=self.version,
                tensors=tensors | optimizer_tensors,
                meta=meta,
            )
        except CheckpointError as error:  # the stage serves on; the last checkpoint stands
            log.error("checkpoint failed, serving goes on: %s", error)
            return
        self.checkpoint = str(path)
        log.info("checkpoint %s", path.name)

    def restore(self, checkpoint: Checkpoint, replica: DiLoCo) -> None:
        meta, tensors = checkpoint.meta, checkpoint.tensors
        try:
            load_optimizer_state(self.optimizer, tensors, meta["optimizer"])
            replica.load_state_dict(tensors, meta["replica"])
            self.version = int(meta["version"])
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise CheckpointError(
                f"{checkpoint.path}: does not fit this stage ({error!r}); move it away to "
                f"start fresh"
            ) from None
        self.resumed_from = str(checkpoint.path)
        log.info(
            "resumed from %s (epoch %d, version %d)", checkpoint.path, replica.epoch, self.version
        )

    async def sync(self, round_: int, trainer: str) -> tuple[int, str]:
        # Once every active trainer asked (their microbatches of the round are in), the round
        # runs on the worker thread, once: later callers find the replica there already.
        await self.barrier.wait(round_, trainer)
        return await self._run(self._sync, round_)

    def _sync(self, round_: int) -> tuple[int, str]:
        """The stage group's outer round, unless this replica is at ``round_`` already: what
        has accumulated steps first (a partial batch's gradient is not left behind)."""
        replica = self.replica
        if replica is None:
            raise ProtocolViolation(ResultCode.DRAINING, "this replica is still joining")
        if replica.epoch >= round_:
            return replica.epoch, "done"
        if self.pending_samples:
            self._inner_step()
        peers = replica.swarm.call(replica.swarm.refresh_peers())
        if any(p.peer_id != self.peer_id for p in peers):
            report = replica.outer_round()
            outcome, group, seconds = report.outcome.value, report.group_size, report.seconds
            if report.after_resync is not None:  # counted as its own round, as the trainer does
                self.stats.rounds[report.after_resync.outcome.value] += 1
        else:  # the stage's only replica: a group of one, with no matchmaking to wait out
            replica.outer_step_alone()
            outcome, group, seconds = "alone", 1, 0.0
        self.stats.rounds[outcome] += 1
        if self.checkpoint_every and replica.epoch % self.checkpoint_every == 0:
            self.save()
        log.info(
            "stage %d epoch %d: %s (group of %d, %.1f s)",
            self.index,
            replica.epoch,
            outcome,
            group,
            seconds,
        )
        return replica.epoch, outcome

    @property
    def samples_per_second(self) -> float:
        """Samples over the compute seconds of their forwards and backwards, an EMA over inner
        steps since this replica joined its stage (0 until its second step): what it
        announces."""
        return self.throughput.samples_per_second

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
