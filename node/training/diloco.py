"""DiLoCo: the replica a trainer drives (:class:`DiLoCo`): H inner steps, then a round that
averages the group's pseudo-gradients, then the outer step (``outer.py``:
:class:`OuterOptimizer`, the same bits on every replica).

Ranges a round could not average (a dead owner's part, ``RoundResult.missing``) get no update:
each member's own delta there is carried into the next round's pseudo-gradient, so no training
is lost and no replica moves alone. (Douillard et al., "DiLoCo", 2023.)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch import nn

from swarmgrad.node.averaging.rounds import Outcome
from swarmgrad.node.swarm import Swarm
from swarmgrad.node.training.in_flight import Restored
from swarmgrad.node.training.model import flatten, unflatten
from swarmgrad.node.training.outer import OuterOptimizer
from swarmgrad.node.training.replica import PendingRound, Replica, RoundReport


class DiLoCo(Replica):
    """DiLoCo's outer loop around a model trained by any inner optimizer (Douillard et al. 2023).

    Every ``inner_steps`` calls of :meth:`step`, the pseudo-gradient (global minus local
    parameters) is averaged with a group, weighted by samples; every member applies the same
    Nesterov outer step and continues from the new global parameters. A replica that finds no
    group keeps training and tries again after the next ``inner_steps``.

    With ``overlap`` (Streaming DiLoCo's overlapped communication, with a delay of one round),
    a round's all-reduce runs on the node's loop while the next round's inner steps proceed. At
    the next boundary the replica waits for it (usually done by then), applies the outer step to
    the global parameters exactly as without overlap (so replicas stay bit-identical), and
    carries the progress made meanwhile onto them: local = new global + (local - local at the
    round's start). Then it starts the round of that progress. A round that fails changes
    nothing: its progress stays in the local parameters and goes with the next round's.

    With ``fragments`` = K > 1 (Streaming DiLoCo's fragments), the flat parameter vector is cut
    into K equal ranges, and every ``inner_steps / K`` steps one of them, in turn (fragment
    ``epoch % K``), has its round: its pseudo-gradient alone is averaged and its range alone
    takes the outer step. Each range still syncs every ``inner_steps``, but a round carries
    1/K of the bytes, spreading the traffic evenly. The epoch counts fragment rounds.
    Overlap applies per fragment round alike.
    """

    can_carry = True

    def __init__(
        self,
        swarm: Swarm,
        model: nn.Module,
        *,
        inner_steps: int,
        outer_lr: float,
        outer_momentum: float,
        overlap: bool = False,
        max_epochs: int | None = None,
        fragments: int = 1,
    ) -> None:
        super().__init__(swarm, model)
        if inner_steps < 1:
            raise ValueError("inner_steps must be at least 1")
        if fragments < 1 or inner_steps % fragments:
            raise ValueError(f"fragments ({fragments}) must divide inner_steps ({inner_steps})")
        self.inner_steps = inner_steps
        self.fragments = fragments
        #: A round every this many steps (a fragment's, with fragments).
        self.sync_every = inner_steps // fragments
        self.bounds = [
            (self.numel * j // fragments, self.numel * (j + 1) // fragments)
            for j in range(fragments)
        ]
        #: fragments: samples since each fragment's last round (its weight in the next).
        self._fragment_samples = [0] * fragments
        self._in_flight_fragment: int | None = None
        self.overlap = overlap
        #: overlap: no round is started once the replica has reached this epoch (the run's end).
        self.max_epochs = max_epochs
        self.outer = OuterOptimizer(flatten(self.params), lr=outer_lr, momentum=outer_momentum)
        self._steps = 0
        #: overlap: the round in flight, and the local parameters when it started.
        self._in_flight: PendingRound | None = None
        self._boundary: torch.Tensor | None = None
        #: overlap: the round in flight at the checkpoint this replica resumed from, until it is
        #: known to have landed (the swarm is past it) or not (this replica lands its epoch).
        self._restored: Restored | None = None
        self.publish()

    def state_vector(self) -> torch.Tensor:
        return torch.cat([self.outer.theta, self.outer.momentum_buffer])

    def load_state_vector(self, values: torch.Tensor) -> None:
        theta, momentum = values[: self.numel], values[self.numel :]
        self.outer.load_state_dict(
            {"theta": theta, "momentum_buffer": momentum, "carry": torch.zeros_like(theta)}
        )
        unflatten(self.outer.theta, self.params)

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        outer = self.outer.state_dict()
        return (
            self._named("model", outer["theta"])  # the swarm's parameters
            | self._named("local", flatten(self.params))  # this replica's, mid-round
            | {"outer.momentum_buffer": outer["momentum_buffer"], "outer.carry": outer["carry"]}
        )

    def _load_state_tensors(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.outer.load_state_dict(
            {
                "theta": self._unnamed("model", tensors),
                "momentum_buffer": tensors["outer.momentum_buffer"],
                "carry": tensors["outer.carry"],
            }
        )
        unflatten(self._unnamed("local", tensors), self.params)
        self._steps = int(meta["steps"])
        counts = meta.get("fragment_samples") or [0] * self.fragments
        self._fragment_samples = [int(c) for c in counts][: self.fragments]
        self._fragment_samples += [0] * (self.fragments - len(self._fragment_samples))
        self._restored = self._restore_in_flight(meta.get("in_flight"), tensors)

    def _restore_in_flight(
        self, record: object, tensors: dict[str, torch.Tensor]
    ) -> Restored | None:
        """The round in flight at the checkpoint, if any (``in_flight.py``). Its samples count
        again until it is known to have landed."""
        boundary = tensors.get("in_flight.boundary")
        restored = Restored.from_checkpoint(record, boundary, self.bounds, self.device)
        if restored is None:
            return None
        if restored.fragment is None:
            self.samples += restored.weight
        else:
            self._fragment_samples[restored.fragment] += restored.weight
        return restored

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """As the base's, with the round in flight, if any: its epoch, range and weight, and
        the local parameters of its range when it started (``in_flight.boundary``). A restart
        cannot collect it, so the replica that resumes does not know whether it landed: if the
        swarm is past it, it did (with this replica's progress up to the boundary in it, which
        is then not sent again); otherwise the next round sends that progress."""
        tensors, meta = super().state_dict()
        counts = list(self._fragment_samples)
        meta |= {"steps": self._steps, "fragment_samples": counts, "in_flight": None}
        in_flight = self._round_in_flight()
        if in_flight is None:
            return tensors, meta
        meta["in_flight"] = in_flight.record()
        tensors["in_flight.boundary"] = in_flight.boundary.cpu().clone()
        if in_flight is self._restored:
            # Its samples are back in the counts (see _restore_in_flight): out again, as saved.
            if in_flight.fragment is None:
                meta["samples"] -= in_flight.weight
            else:
                counts[in_flight.fragment] -= in_flight.weight
        return tensors, meta

    def _round_in_flight(self) -> Restored | None:
        """The round a checkpoint keeps: the one in flight, else one resumed in flight."""
        if self._in_flight is None or self._boundary is None:
            return self._restored
        return Restored(
            epoch=self._in_flight.epoch,
            fragment=self._in_flight_fragment,
            offset=self._in_flight.offset,
            weight=int(self._in_flight.weight),
            boundary=self._boundary,
        )

    @property
    def schedule_step(self) -> int:
        """The next inner step's place in the run, for the learning-rate schedule: the same on
        every member (epoch x inner_steps + steps into this round, counting a round in flight),
        resumed or resynced."""
        rounds = self.epoch + self._pending
        return rounds * self.sync_every + self._steps % self.sync_every

    @property
    def _pending(self) -> bool:
        """A round is in flight, or was at the checkpoint resumed and may have landed (blocking
        rounds of the whole vector have no round pending between steps, only training that
        may have gone out in one: :meth:`doubt_progress`)."""
        restored = self._restored is not None and (self.overlap or self.fragments > 1)
        return self._in_flight is not None or restored

    def doubt_progress(self) -> None:
        """The training this replica resumed (its local parameters' progress and its samples)
        may have gone out in a round started after its checkpoint was written (the node died
        in it, or stopped in it). Held as a round in flight: landed, and not sent again, if
        the swarm is past this epoch at the next resync; sent with the next round otherwise.
        Replicas of several fragments keep their counts (a fragment's round sends a range)."""
        if self.fragments > 1:
            return
        self._restored = Restored(
            epoch=self.epoch,
            fragment=None,
            offset=0,
            weight=self.samples,  # a round resumed in flight included (_restore_in_flight)
            boundary=flatten(self.params),
        )

    def count(self, samples: int) -> None:
        """Count one inner step of ``samples``, running no round (a pipeline stage's rounds
        come from its trainers' barrier: :meth:`outer_round` then)."""
        self._steps += 1
        self.samples += samples
        self._samples_total += samples
        if self.fragments > 1:
            self._fragment_samples = [c + samples for c in self._fragment_samples]

    def step(self, samples: int) -> RoundReport | None:
        """Count one inner step of ``samples``; run an outer round when one is due."""
        self.count(samples)
        if self._steps % self.sync_every:
            return None
        return self.boundary()

    def boundary(self) -> RoundReport | None:
        """A round boundary now, whatever the step count (a time window's end: ``window.py``):
        the round due, overlapped or fragmented as the replica is set up."""
        if self.fragments > 1 or self.overlap:
            return self.streaming_round()
        return self.outer_round()

    def streaming_round(self) -> RoundReport | None:
        """Overlap and/or fragments: land the round in flight (if any), then start the next (of
        the whole vector, or of fragment ``epoch % K``), and without overlap land it at once.
        The report of the round landed (None at an overlapped first boundary: nothing was in
        flight)."""
        started = time.monotonic()
        report = self._land(started) if self._in_flight is not None else None
        # Overlapped: the swarm landed a round without this replica (it joined, or fell behind);
        # its progress goes onto the swarm's state and into the round it starts now.
        resynced = self._resync_if_needed(carry=self.overlap)
        if resynced is not None:
            if not resynced.carried:
                return resynced
            report = resynced
        if self.max_epochs is not None and self.epoch >= self.max_epochs:
            return report  # the run's last round has landed
        self._start_round()
        if self.overlap:
            return report
        # Blocking: nothing moved meanwhile. A carried resync's progress goes in this round.
        return dataclasses.replace(self._land(started), after_resync=resynced)

    def _start_round(self) -> None:
        """Start the round due (of the whole vector, or of fragment ``epoch % K``) with the
        progress since its range's last round."""
        fragment = self.epoch % self.fragments if self.fragments > 1 else None
        start, end = self.bounds[fragment or 0]
        self._boundary = flatten(self.params)[start:end]
        delta = self.outer.pseudo_gradient(self._boundary, None if fragment is None else start)
        if fragment is None:
            weight = self.samples
        else:
            weight, self._fragment_samples[fragment] = self._fragment_samples[fragment], 0
        self.samples = 0  # they are in flight: a failed round gives them back
        if self.round_starting is not None:
            self.round_starting(self.epoch)
        self._in_flight = self._start_average(delta, weight=weight, offset=start)
        self._in_flight_fragment = fragment

    def _land(self, started: float) -> RoundReport:
        pending, boundary, fragment = self._in_flight, self._boundary, self._in_flight_fragment
        assert pending is not None
        assert boundary is not None
        # A stop while waiting leaves the round in flight, so the last checkpoint keeps it.
        averaged = self._finish_average(pending)  # usually done by now
        self._in_flight = self._boundary = self._in_flight_fragment = None
        outer_started = time.monotonic()
        if averaged.outcome is Outcome.AVERAGED:
            self._restored = None  # this replica's epoch had not landed: its round now has
            assert averaged.result is not None
            assert averaged.sent is not None
            start, end = pending.offset, pending.offset + boundary.numel()
            theta = self.outer.step(
                averaged.result.averaged,
                own=averaged.sent,
                missing=averaged.result.missing,
                offset=None if fragment is None else start,
            )
            local = flatten(self.params)
            # the progress made since the round started, not yet sent, onto the new global
            local[start:end] = theta[start:end] + (local[start:end] - boundary)
            unflatten(local, self.params)
            self.epoch += 1
            self.publish()
        elif fragment is None:
            self.samples += int(pending.weight)  # their progress goes with the next round
        else:
            self._fragment_samples[fragment] += int(pending.weight)
        return self._report(
            averaged,
            started,
            weight=pending.weight,
            outer_seconds=time.monotonic() - outer_started,
        )

    def _progress(self) -> torch.Tensor:
        local = flatten(self.params)
        progress = local - self.outer.theta
        restored = self._restored
        if restored is not None:
            # The swarm is past the round resumed in flight: it landed, with this replica's
            # progress up to its boundary (which must not be sent twice); what came after goes.
            start, end = restored.offset, restored.offset + restored.boundary.numel()
            progress[start:end] = local[start:end] - restored.boundary
        return progress

    def _carry(self, progress: torch.Tensor) -> None:
        unflatten(self.outer.theta + progress, self.params)

    def _resynced(self, *, carried: bool) -> None:
        restored, self._restored = self._restored, None
        if not carried:
            self._fragment_samples = [0] * self.fragments
        elif restored is not None:  # its samples landed with it
            if restored.fragment is None:
                self.samples = max(0, self.samples - restored.weight)
            else:
                counts = self._fragment_samples
                counts[restored.fragment] = max(0, counts[restored.fragment] - restored.weight)

    def drain(self) -> RoundReport | None:
        """Land the round in flight, if any, starting none."""
        if self._in_flight is None:
            return None
        return self._land(time.monotonic())

    @property
    def rounds_started(self) -> int:
        """Rounds landed, and the one in flight: a run of ``max_epochs`` rounds stops training
        once it has started its last (overlap), and :meth:`finish` lands it."""
        return self.epoch + self._pending

    def finish(self) -> list[RoundReport]:
        """The run's end: land every sample's progress in the global parameters. The round in
        flight lands; with K fragments, the K - 1 fragments synced before the last one then
        have their rounds at once (in their usual order, blocking), each sending the progress
        made since its own last round, which would otherwise never reach the swarm's model.
        The reports of the rounds landed."""
        reports = [report] if (report := self.drain()) is not None else []
        for _ in range(self.fragments - 1):
            started = time.monotonic()
            self._start_round()
            reports.append(self._land(started))
        return reports

    def outer_step_alone(self) -> None:
        """A round with a group of one (a pipeline stage served by one replica): this replica's
        own pseudo-gradient is the average; the outer step and the epoch as after any round."""
        delta = self.outer.pseudo_gradient(flatten(self.params))
        unflatten(self.outer.step(delta, own=delta), self.params)
        self.epoch += 1
        self.samples = 0
        self.publish()

    def outer_round(self) -> RoundReport:
        started = time.monotonic()
        resynced = self._resync_if_needed()
        if resynced is not None:
            if not resynced.carried:
                return resynced
            # The progress kept goes in the swarm's round of the epoch just downloaded (it is
            # forming now): the next round would find the swarm a round ahead again.
            if self.max_epochs is not None and self.epoch >= self.max_epochs:
                return resynced
        delta = self.outer.pseudo_gradient(flatten(self.params))
        weight = self.samples
        if self.round_starting is not None:
            self.round_starting(self.epoch)
        averaged = self._average(delta)
        if averaged.outcome is Outcome.AVERAGED:
            assert averaged.result is not None
            assert averaged.sent is not None
            theta = self.outer.step(
                averaged.result.averaged, own=averaged.sent, missing=averaged.result.missing
            )
            unflatten(theta, self.params)
            self._restored = None  # training resumed in doubt has now landed
            self.epoch += 1
            self.samples = 0
            self.publish()
        report = self._report(averaged, started, weight=weight)
        return dataclasses.replace(report, after_resync=resynced)
