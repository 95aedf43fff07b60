"""What both training algorithms share: a replica of the run's state that publishes itself,
catches up from peers when it falls behind, averages through the swarm, and reports each round.

:class:`Replica` is the base of :class:`~swarmgrad.node.training.diloco.DiLoCo` and
:class:`~swarmgrad.node.training.sync.SyncDataParallel` (``api.py`` says how to use them).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from swarmgrad.node.averaging.rounds import Averaged, Outcome
from swarmgrad.node.kinds import RoundOutcome
from swarmgrad.node.state.sync import carries_progress
from swarmgrad.node.swarm import Swarm
from swarmgrad.protocol import state

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundReport:
    """What one round did, for displays, logs and tests."""

    epoch: int  # the epoch after the round
    outcome: RoundOutcome
    group_size: int
    seconds: float
    missing_values: int = 0
    detail: str = ""
    allreduce_seconds: float = 0.0  # the all-reduce alone (no matchmaking), when there was one
    outer_seconds: float = 0.0  # applying the round's result (DiLoCo's outer step)
    #: A resync: whether the replica kept its unaveraged progress (``algorithm.carry_epochs``).
    carried: bool = False
    #: A round: the resync just before it, whose kept progress the round sent.
    after_resync: RoundReport | None = None
    #: A round averaged (in whole or part): the samples this replica's contribution weighed.
    sent_samples: int = 0

    @property
    def summary(self) -> str:
        """The round as a log line names it: "averaged (group of 4)", "resynced", ..."""
        if self.outcome is RoundOutcome.NO_GROUP:
            return "no group, trained on alone"
        if self.outcome in (RoundOutcome.RESYNCED, RoundOutcome.ALONE):
            return str(self.outcome)
        return f"{self.outcome} (group of {self.group_size})"


#: The outcomes in which this replica's contribution went into its group's result.
_SENT = (RoundOutcome.AVERAGED, RoundOutcome.PARTIAL)


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingRound:
    """A round started on the node's loop and not yet waited for."""

    epoch: int
    weight: float
    compensated: torch.Tensor  # what was sent: the vector plus the residual
    future: concurrent.futures.Future[Averaged]
    offset: int = 0  # where the vector starts in the whole (a fragment's range)
    started: float = field(default_factory=time.monotonic)


class Replica:
    """The part both algorithms share: feedback, resync, publishing, reports."""

    #: Whether the algorithm can keep its unaveraged progress over a resync (:meth:`_progress`).
    can_carry = False

    def __init__(self, swarm: Swarm, model: nn.Module) -> None:
        self.swarm = swarm
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters: nothing to average")
        first, device = named[0][0], named[0][1].device
        elsewhere = next(((n, p.device) for n, p in named if p.device != device), None)
        if elsewhere is not None:  # one flat vector a round: one device
            raise ValueError(
                f"the model's parameters must be on one device: {first} is on {device}, "
                f"{elsewhere[0]} on {elsewhere[1]}"
            )
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.numel = sum(p.numel() for p in self.params)
        #: Where the replica's vectors live: the model's device (rounds encode and decode there).
        self.device = self.params[0].device
        self.epoch = 0
        self.samples = 0  # since the last round: this replica's weight in it
        self._residual = torch.zeros(self.numel, device=self.device)
        #: Error feedback of this node's results as a part's owner (codecs that ask for it:
        #: ``compression/traits.py``), over the whole vector; owners reduce on the CPU.
        self._owner_residual = torch.zeros(self.numel) if swarm.owner_feedback else None
        #: The announced throughput is this process's: the samples it trained (the lifetime
        #: total less what it restored) over the seconds since this replica was made.
        self._started = time.monotonic()
        self._samples_total = 0
        self._samples_restored = 0
        #: Told the epoch of each round this replica starts, before its values leave (the
        #: trainer notes it beside the checkpoints: ``Checkpointer.note_round``).
        self.round_starting: Callable[[int], None] | None = None

    # -- what a subclass provides ---------------------------------------------------------------

    def state_vector(self) -> torch.Tensor:
        raise NotImplementedError

    def load_state_vector(self, values: torch.Tensor) -> None:
        raise NotImplementedError

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _load_state_tensors(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        raise NotImplementedError

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Everything needed to continue exactly from here: tensors (the replicated state as
        ``model.<parameter name>`` and the rest) and JSON-able counters, on the CPU."""
        tensors = self._state_tensors() | {"residual": self._residual}
        if self._owner_residual is not None:
            tensors["owner_residual"] = self._owner_residual.clone()
        tensors = {name: t.cpu() for name, t in tensors.items()}
        meta = {"epoch": self.epoch, "samples": self.samples, "samples_total": self._samples_total}
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`; ValueError if it is not this model's state."""
        residual, owner = tensors.get("residual"), tensors.get("owner_residual")
        if residual is None or residual.shape != (self.numel,):
            raise ValueError("the state's residual does not match the model")
        if owner is not None and owner.shape != (self.numel,):
            raise ValueError("the state's owner residual does not match the model")
        self.epoch, self.samples = int(meta["epoch"]), int(meta["samples"])
        trained_here = self._samples_total - self._samples_restored
        self._samples_total = int(meta["samples_total"])
        self._samples_restored = self._samples_total - trained_here
        self._load_state_tensors(tensors, meta)  # after the counts: a subclass may add to them
        self._residual = residual.to(self.device, torch.float32, copy=True)
        if self._owner_residual is not None:  # a checkpoint of another codec has none: zeros
            if owner is None:
                self._owner_residual.zero_()
            else:
                self._owner_residual.copy_(owner)
        self.publish()

    def _named(self, prefix: str, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        tensors, offset = {}, 0
        for name, p in zip(self.names, self.params, strict=True):
            tensors[f"{prefix}.{name}"] = vector[offset : offset + p.numel()].view(p.shape).clone()
            offset += p.numel()
        return tensors

    def _unnamed(self, prefix: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = []
        for name, p in zip(self.names, self.params, strict=True):
            t = tensors.get(f"{prefix}.{name}")
            if t is None or t.shape != p.shape:
                raise ValueError(f"{prefix}.{name} is missing from the state or has another shape")
            parts.append(t.reshape(-1).float())
        return torch.cat(parts).to(self.device)

    def catch_up(self) -> RoundReport | None:
        """Download the swarm's state now if this replica is behind it or diverged (a node that
        joins, or resumes an old checkpoint, need not train a round it would throw away)."""
        return self._resync_if_needed()

    def settle(self, stop: threading.Event, *, seconds: float) -> RoundReport | None:
        """At the run's last epoch: make sure this replica holds the state most peers hold.

        No later round will tell peers that split the last one (a record that reached some
        members' last read and not others': two groups, two states) that they differ, so wait
        (up to ``seconds``) until every other peer's record is at this epoch or past it, then
        take the majority's state if this one is not it. Only peers one epoch behind can still
        finish the last round: peers further behind (gone, or joining late) and peers this node
        no longer averages with are not waited for."""
        deadline = time.monotonic() + seconds
        while not stop.is_set():
            peers = self.swarm.call(self.swarm.refresh_peers())
            finishing = [
                p
                for p in peers
                if p.peer_id != self.swarm.peer_id
                and p.checksum
                and p.epoch == self.epoch - 1
                and not self.swarm.excludes(p.peer_id)
            ]
            if not finishing or time.monotonic() >= deadline:
                return self._resync_if_needed()
            stop.wait(0.5)
        return None

    # -- shared ---------------------------------------------------------------------------------

    def publish(self) -> None:
        values = self.state_vector().cpu()  # what donors serve: host memory
        self.swarm.publish(state.Snapshot.of(self.epoch, values), throughput=self.throughput)

    @property
    def throughput(self) -> float:
        """Samples per second this process trained: what peers size their shares by."""
        elapsed = max(time.monotonic() - self._started, 1e-9)
        return (self._samples_total - self._samples_restored) / elapsed

    def _resync_if_needed(self, *, carry: bool = False) -> RoundReport | None:
        """Download the swarm's state if this replica is behind or diverged. The progress made
        since this replica's own global parameters (and its samples) is kept, moved onto the
        downloaded ones, if ``carry`` (overlapped rounds: a round's work was done from a start
        one round stale anyway) or if the run's ``algorithm.carry_epochs`` allows it; else it
        is dropped."""
        started = time.monotonic()
        snapshot = self.swarm.snapshot
        assert snapshot is not None  # published since construction
        donors = self.swarm.call(self.swarm.find_donors(self.epoch, snapshot.checksum))
        if not donors:
            return None
        limit = self.swarm.spec.algorithm.carry_epochs
        carry = carry or (self.can_carry and carries_progress(self.epoch, donors[0].epoch, limit))
        downloaded = self.swarm.call(self.swarm.download_state(donors, snapshot.values.numel()))
        if downloaded is None:
            return None  # counted by the swarm; try again next round
        was, trained = self.epoch, self.samples
        progress = self._progress() if carry else None
        self.load_state_vector(downloaded.values)
        if progress is not None:
            self._carry(progress)
        else:
            self.samples = 0
        self._resynced(carried=progress is not None)
        log.info(
            "resynced from %d donor(s): epoch %d -> %d, %s %d local samples",
            len(donors),
            was,
            downloaded.epoch,
            "carried" if carry else "dropped",
            self.samples if carry else trained,
        )
        self.epoch = downloaded.epoch
        self._residual.zero_()
        if self._owner_residual is not None:
            self._owner_residual.zero_()
        self.publish()
        return RoundReport(
            epoch=self.epoch,
            outcome=RoundOutcome.RESYNCED,
            group_size=0,
            seconds=time.monotonic() - started,
            detail=f"from {', '.join(d.peer_id for d in donors)}",
            carried=progress is not None,
        )

    def _progress(self) -> torch.Tensor:
        """The local parameters' progress since the replica's global ones (for a carry)."""
        raise NotImplementedError(f"{type(self).__name__} does not carry progress over a resync")

    def _carry(self, progress: torch.Tensor) -> None:
        """Put ``progress`` back onto the (just loaded) global parameters."""
        raise NotImplementedError(f"{type(self).__name__} does not carry progress over a resync")

    def _resynced(self, *, carried: bool) -> None:
        """After a resync, the subclass's own counts (``carried``: the progress was kept)."""

    def _average(self, vector: torch.Tensor) -> Averaged:
        """One round of ``vector`` plus the error-feedback residual. The residual moves on only
        if the round applied what was sent (a round that fails, or a stop mid-round, leaves the
        state as it was before): it becomes what the codec lost of what was sent (and, whatever
        the codec, values a round could not average are carried by the caller)."""
        return self._finish_average(self._start_average(vector, weight=self.samples))

    def _start_average(
        self, vector: torch.Tensor, *, weight: float, offset: int = 0
    ) -> PendingRound:
        """Start :meth:`_average`'s round on the node's loop; :meth:`_finish_average` waits.
        ``vector`` may be a range of the whole from ``offset`` (a fragment): the residual of
        that range goes with it."""
        end = offset + vector.numel()
        compensated = vector + self._residual[offset:end]
        owner = None if self._owner_residual is None else self._owner_residual[offset:end]
        future = self.swarm.submit(
            self.swarm.average(
                compensated,
                epoch=self.epoch,
                weight=weight,
                keep_sent=not self.swarm.codec_is_lossless,
                owner_residual=owner,
            )
        )
        return PendingRound(
            epoch=self.epoch, weight=weight, compensated=compensated, future=future, offset=offset
        )

    def _finish_average(self, pending: PendingRound) -> Averaged:
        """Wait for a started round (``concurrent.futures.CancelledError`` once the node is
        stopping); move the residuals (of its range) on if it averaged: the member's, and
        the owner's over this node's part (the round worked on a copy of it)."""
        averaged = pending.future.result()
        if averaged.outcome is Outcome.AVERAGED:
            assert averaged.sent is not None
            start, sent = pending.offset, averaged.sent.to(self.device)
            self._residual[start : start + sent.numel()] = pending.compensated - sent
            moved = averaged.result.owner_residual if averaged.result is not None else None
            if moved is not None and self._owner_residual is not None:
                at, values = start + moved[0], moved[1]
                self._owner_residual[at : at + values.numel()] = values
        return averaged

    def _report(
        self, averaged: Averaged, started: float, *, weight: float, outer_seconds: float = 0.0
    ) -> RoundReport:
        result = averaged.result
        missing = sum(end - start for start, end in result.missing) if result else 0
        outcome = averaged.outcome
        if result is not None and not result.complete:
            outcome = RoundOutcome.PARTIAL
        return RoundReport(
            epoch=self.epoch,
            outcome=outcome,
            group_size=len(averaged.group.members) if averaged.group else 1,
            seconds=time.monotonic() - started,
            missing_values=missing,
            detail=averaged.error,
            allreduce_seconds=averaged.seconds,
            outer_seconds=outer_seconds,
            sent_samples=int(weight) if outcome in _SENT else 0,
        )
