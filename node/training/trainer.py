"""The CLI's trainer: the run spec's model on its data, through the same API a researcher uses.

``Trainer.train`` runs in a worker thread (torch off the event loop) and reads top to bottom:
set up the device, data and model; resume from the newest valid checkpoint, then catch up with
the swarm; then step, and after each round evaluate, report, and every few rounds checkpoint
(and every few minutes, mid-round too: ``checkpoint_every_seconds``). It stops when asked
(``stop``), or when the replica reaches ``max_epochs``, and checkpoints then too.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable

import torch

from swarmgrad.node.config import NodeConfig
from swarmgrad.node.state.checkpoint import (
    Checkpoint,
    Checkpointer,
    CheckpointError,
    load_optimizer_state,
    optimizer_state,
)
from swarmgrad.node.swarm import Swarm
from swarmgrad.node.tracking import Tracker
from swarmgrad.node.training.api import DiLoCo, RoundReport, SyncDataParallel
from swarmgrad.node.training.data import TOKENIZER_TENSOR, Batches, load_corpus, tokenizer_tensor
from swarmgrad.node.training.device import (
    Prefetched,
    model_flops_utilization,
    peak_flops,
    pick_device,
)
from swarmgrad.node.training.model import build_model
from swarmgrad.node.training.progress import Progress
from swarmgrad.node.training.spot_check import LossProbe
from swarmgrad.node.training.step import InnerStep, evaluate, set_lr
from swarmgrad.node.training.window import RoundWindow, take_step

log = logging.getLogger(__name__)

#: The training loss stays on the device and is read (a host sync) once per this many steps,
#: and before every round's report.
LOSS_READ_STEPS = 16

#: At the last epoch, how long a node waits for its peers' records to reach it before it
#: checks that it holds the majority's state (Replica.settle).
SETTLE_SECONDS = 10.0


class Trainer:
    def __init__(
        self,
        config: NodeConfig,
        swarm: Swarm,
        *,
        checkpoints: Checkpointer | None = None,
        on_progress: Callable[[Progress], None] = lambda progress: None,
        tracker: Tracker | None = None,
    ) -> None:
        self.config, self.swarm, self.checkpoints = config, swarm, checkpoints
        self.tracker = tracker
        self.progress = Progress(peer_id=swarm.peer_id, algorithm=config.spec.algorithm.name)
        self.metrics = swarm.metrics
        self._on_progress = on_progress
        self._losses: list[torch.Tensor] = []  # steps' losses not yet read from the device
        self._peak = math.nan
        self._data_tokens = 0  # the training tokens the data cursor counts through
        self._tokenizer: torch.Tensor | None = None
        #: Rates are this process's own: the tokens it trained since it began stepping over the
        #: seconds since (a resumed run's totals count the earlier processes' work too).
        self._session_started = time.monotonic()
        self._session_tokens = 0
        #: Averaging bytes before this process (from the checkpoint): its swarm counts from zero.
        self._bytes_restored = {"sent": 0, "received": 0}
        #: A mid-round checkpoint holds training the next round will send: that round is noted
        #: beside the checkpoints as it starts (``Checkpointer.note_round``), and only then (a
        #: note is an fsync in the round's path).
        self._note_next_round = False

    def train(self, stop: threading.Event) -> Progress:
        spec, settings, progress = self.config.spec, self.config.settings, self.progress
        if settings.threads:
            torch.set_num_threads(settings.threads)
        device = pick_device(settings.device)
        progress.device = str(device)
        corpus = load_corpus(
            spec.data, vocab_size=spec.model.vocab_size, cache_dir=self.config.cache_dir
        )
        batches = corpus.batches(
            seq_len=spec.model.seq_len,
            batch_size=spec.data.batch_size,
            seed=spec.data.seed,
            peer_id=self.swarm.peer_id,
        )
        self._data_tokens = batches.train_tokens
        self._tokenizer = tokenizer_tensor(corpus.tokenizer)  # export writes the one trained with
        validation = corpus.validation(
            seq_len=spec.model.seq_len, num_windows=self.config.eval_windows
        )
        model = build_model(spec.model, seed=spec.data.seed).to(device)
        progress.parameters = sum(p.numel() for p in model.parameters())
        self._peak = peak_flops(device, settings.peak_tflops)
        algorithm = spec.algorithm
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=algorithm.inner_lr,
            weight_decay=0.0,
            fused=device.type == "cuda",  # one kernel for the whole step, no host syncs
        )
        inner_step = InnerStep(
            model,
            optimizer,
            device,
            compile=settings.compile == "on",
            optimizer_steps=algorithm.name == "diloco",
        )
        replica: DiLoCo | SyncDataParallel
        if algorithm.name == "diloco":
            replica = DiLoCo(
                self.swarm,
                model,
                inner_steps=algorithm.inner_steps,
                outer_lr=algorithm.outer_lr,
                outer_momentum=algorithm.outer_momentum,
                overlap=algorithm.overlap,
                max_epochs=self.config.max_epochs,
                fragments=algorithm.fragments,
            )
        else:
            replica = SyncDataParallel(
                self.swarm, model, optimizer, target_batch_size=algorithm.target_batch_size
            )
        if spec.trust.open and spec.trust.spot_checks and isinstance(replica, DiLoCo):
            diloco = replica
            self.swarm.use_loss_probe(LossProbe(spec, corpus, theta=lambda: diloco.outer.theta))
        progress.initial_val_loss = progress.val_loss = evaluate(model, validation, device)
        restored = self.checkpoints.latest() if self.checkpoints is not None else None
        if restored is not None:
            self._restore(restored, replica, optimizer, batches)
            progress.val_loss = evaluate(model, validation, device)
        if self.checkpoints is not None and isinstance(replica, DiLoCo):
            replica.round_starting = self._note_round
        feed = Prefetched(batches, device, cursor=batches.cursor)
        with contextlib.suppress(concurrent.futures.CancelledError):  # stopped while waiting
            caught_up = replica.catch_up()
            if caught_up is not None:
                self._record_round(caught_up, replica, evaluate(model, validation, device))
        saved_epoch, saved_at = replica.epoch, time.monotonic()
        every_seconds = self.config.settings.checkpoint_every_seconds
        window = RoundWindow(algorithm.round_seconds) if algorithm.round_seconds else None
        self._session_started, self._session_tokens = time.monotonic(), progress.tokens
        done = self._done(replica)
        while not stop.is_set() and not done:
            step_started = time.monotonic()
            progress.lr = algorithm.lr_at(replica.schedule_step)
            set_lr(optimizer, progress.lr)
            inputs, targets = next(feed)
            loss = inner_step(inputs, targets)
            if self.config.slowdown > 1:  # a slower machine, simulated
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                time.sleep((time.monotonic() - step_started) * (self.config.slowdown - 1))
            self._count_step(len(inputs), inputs.numel(), loss)  # reads losses at times
            # On a GPU the step runs ahead of the host: its time shows when the losses are read.
            step_seconds = time.monotonic() - step_started
            progress.compute_seconds += step_seconds
            try:
                report = take_step(replica, window, samples=len(inputs), step_seconds=step_seconds)
            except concurrent.futures.CancelledError:  # stopping while in a round
                if isinstance(replica, DiLoCo) and not replica.overlap:
                    # The round may land without it: the checkpoint written now holds training
                    # that may be in the swarm's state already. (Overlapped: the round in
                    # flight is in the checkpoint itself.)
                    self._note_next_round = True
                    self._note_round(replica.epoch)
                break
            if report is None:
                # Mid-round: the training since the last round (or checkpoint) is in no one's
                # model but this replica's; a checkpoint keeps it over a crash (a restart sends
                # it on), so a crash loses at most every_seconds of it.
                if every_seconds and time.monotonic() - saved_at >= every_seconds:
                    self._save(replica, optimizer, feed)
                    saved_at = time.monotonic()
                    self._note_next_round = True
                continue
            progress.communication_seconds += report.seconds
            val_loss = evaluate(model, validation, device)
            if report.after_resync is not None:  # its own line and count, before the round's
                self._record_round(report.after_resync, replica, val_loss)
            self._record_round(report, replica, val_loss)
            if replica.epoch >= saved_epoch + self.config.settings.checkpoint_every_rounds:
                self._save(replica, optimizer, feed)
                saved_epoch = replica.epoch
            saved_at = time.monotonic()  # a round sent the training so far: none is at risk
            done = self._done(replica)
        if done and not stop.is_set():
            with contextlib.suppress(concurrent.futures.CancelledError):
                if isinstance(replica, DiLoCo):  # the last round in flight, fragments' progress
                    for report in replica.finish():
                        self._record_round(report, replica, evaluate(model, validation, device))
                settled = replica.settle(stop, seconds=SETTLE_SECONDS)
                if settled is not None:
                    self._record_round(settled, replica, evaluate(model, validation, device))
        self._read_losses()
        self._save(replica, optimizer, feed)
        progress.finished = True
        self._on_progress(progress)
        return progress

    def _note_round(self, epoch: int) -> None:
        """A round of ``epoch`` starts (or stopped unfinished): noted if a mid-round checkpoint
        holds training it may send."""
        if self._note_next_round and self.checkpoints is not None:
            self.checkpoints.note_round(epoch=epoch, step=self.progress.steps)
            self._note_next_round = False

    def _done(self, replica: DiLoCo | SyncDataParallel) -> bool:
        """The run's rounds are all started (overlap: the last, in flight, lands after)."""
        if self.config.max_epochs is None:
            return False
        started = replica.rounds_started if isinstance(replica, DiLoCo) else replica.epoch
        return started >= self.config.max_epochs

    # -- checkpoints ----------------------------------------------------------------------------

    def _save(
        self, replica: DiLoCo | SyncDataParallel, optimizer: torch.optim.Optimizer, feed: Prefetched
    ) -> None:
        if self.checkpoints is None:
            return
        started = time.monotonic()
        progress = self.progress
        self._count_bytes()
        tensors, replica_meta = replica.state_dict()
        optimizer_tensors, optimizer_meta = optimizer_state(optimizer)
        tensors |= optimizer_tensors | {"rng.torch": torch.get_rng_state()}
        if self._tokenizer is not None:
            tensors[TOKENIZER_TENSOR] = self._tokenizer
        meta = {
            "replica": replica_meta,
            "optimizer": optimizer_meta,
            "data_cursor": feed.cursor,
            "data_tokens": self._data_tokens,
            "progress": progress.counters(),
        }
        try:
            path = self.checkpoints.save(
                epoch=replica.epoch, step=progress.steps, tensors=tensors, meta=meta
            )
        except CheckpointError as error:
            # Training goes on (the last checkpoint stands); the next save tries again.
            self.metrics.checkpoint_failures.inc()
            log.error("checkpoint failed, training goes on: %s", error)
            return
        progress.checkpoint = str(path)
        self.metrics.checkpoints.inc()
        self.metrics.checkpoint_duration.observe(time.monotonic() - started)
        log.info("checkpoint %s (%.2f s)", path.name, time.monotonic() - started)

    def _restore(
        self,
        checkpoint: Checkpoint,
        replica: DiLoCo | SyncDataParallel,
        optimizer: torch.optim.Optimizer,
        batches: Batches,
    ) -> None:
        meta, tensors, progress = checkpoint.meta, checkpoint.tensors, self.progress
        try:
            load_optimizer_state(optimizer, tensors, meta["optimizer"])
            replica.load_state_dict(tensors, meta["replica"])
            tokens = meta.get("data_tokens")  # absent from checkpoints before it was kept
            changed = batches.resume(
                int(meta["data_cursor"]), None if tokens is None else int(tokens)
            )
            if changed is not None:
                log.warning("%s: %s", checkpoint.path.name, changed)
            torch.set_rng_state(tensors["rng.torch"])
            counters = meta["progress"]
            progress.resume_counters(counters)
            # Absent from checkpoints before they were kept: those count from this process.
            self._bytes_restored = {
                "sent": int(counters.get("bytes_sent", 0)),
                "received": int(counters.get("bytes_received", 0)),
            }
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise CheckpointError(
                f"{checkpoint.path}: does not fit this node's model ({error!r}); move it away "
                f"to start fresh"
            ) from None
        progress.epoch = replica.epoch
        progress.resumed_from = str(checkpoint.path)
        self._count_bytes()
        self.metrics.epoch.set(replica.epoch)
        log.info(
            "resumed from %s (epoch %d), with %d samples trained since its last round",
            checkpoint.path,
            replica.epoch,
            replica.samples,
        )
        assert self.checkpoints is not None  # it was read from them
        if isinstance(replica, DiLoCo) and self.checkpoints.round_after(checkpoint):
            # It died (or stopped) in a round started after this checkpoint: that round may
            # hold this training already. Sent again only if the swarm is not past it.
            replica.doubt_progress()
            log.info("a round started after that checkpoint: its training counts as sent once "
                     "the swarm is past epoch %d", replica.epoch)  # fmt: skip

    def _count_step(self, samples: int, tokens: int, loss: torch.Tensor) -> None:
        """Count a step; its loss waits on the device until :meth:`_read_losses`."""
        progress = self.progress
        progress.steps += 1
        progress.samples += samples
        progress.tokens += tokens
        elapsed = max(time.monotonic() - self._session_started, 1e-9)
        progress.tokens_per_second = (progress.tokens - self._session_tokens) / elapsed
        progress.mfu = model_flops_utilization(
            progress.parameters, progress.tokens_per_second, self._peak
        )
        self._losses.append(loss)
        if len(self._losses) >= LOSS_READ_STEPS:
            self._read_losses()
        metrics = self.metrics
        metrics.inner_steps.inc()
        metrics.samples.inc(samples)
        metrics.tokens.inc(tokens)
        metrics.tokens_per_second.set(progress.tokens_per_second)
        metrics.mfu.set(progress.mfu)

    def _count_bytes(self) -> None:
        """The node's averaging bytes: before this process, and this process's swarm's."""
        traffic, restored = self.swarm.traffic, self._bytes_restored
        self.progress.bytes_sent = restored["sent"] + traffic["sent"]
        self.progress.bytes_received = restored["received"] + traffic["received"]

    def _read_losses(self) -> None:
        """Fold the steps' losses into the moving average: one host sync for all of them."""
        if not self._losses:
            return
        progress = self.progress
        for loss in torch.stack(self._losses).float().tolist():
            progress.loss = (
                loss if math.isnan(progress.loss) else 0.95 * progress.loss + 0.05 * loss
            )
        self._losses.clear()
        self.metrics.train_loss.set(progress.loss)

    def _record_round(
        self, report: RoundReport, replica: DiLoCo | SyncDataParallel, val_loss: float
    ) -> None:
        progress, swarm = self.progress, self.swarm
        self._read_losses()  # the training loss this report shows, as of now
        self._count_bytes()
        snapshot = swarm.snapshot
        checksum = snapshot.checksum if snapshot is not None else ""
        progress.take_round(report, val_loss=val_loss, peers=len(swarm.peers), checksum=checksum)
        if swarm.spec.trust.open:
            progress.trust = swarm.ledger.table()
        metrics = self.metrics
        metrics.rounds.labels(report.outcome.label).inc()
        metrics.round_duration.observe(report.seconds)
        metrics.epoch.set(report.epoch)
        metrics.validation_loss.set(val_loss)
        metrics.group_size.set(report.group_size)
        if self.tracker is not None:
            busy = progress.compute_seconds + progress.communication_seconds
            self.tracker.log_round(
                report.epoch,
                {
                    "val_loss": val_loss,
                    "train_loss": progress.loss,
                    "tokens_per_second": progress.tokens_per_second,
                    "mfu": progress.mfu,
                    "bytes_sent": progress.bytes_sent,
                    "bytes_received": progress.bytes_received,
                    "utilization": progress.compute_seconds / busy if busy else math.nan,
                    "round_seconds": report.seconds,
                    "group_size": report.group_size,
                },
            )
        log.info(
            "epoch %d: %s in %.2f s, val loss %.3f, %s",
            report.epoch,
            report.summary,
            report.seconds,
            val_loss,
            report.detail or "ok",
        )
        self._on_progress(progress)
