"""Open runs: a loss spot check of a peer's update, the contribution score statistics cannot give.

An owner's statistics (clip coefficient, cosine) say how a member's values sit among the others'
values, not whether they train the model. So each round an owner also measures, for
``trust.spot_checks`` members of its part picked at random (no member knows when), what their
values would do to the loss: the swarm's parameters of the round with that part moved by the
member's pseudo-gradient (``theta - x`` there, as if the member's local model took the part),
against the parameters as they are, on a few training windows drawn from (run, peer, round), so
anyone can draw the same windows and check the number. The loss it takes off (positive: the
update helps) goes into the trust ledger (:meth:`TrustLedger.spot`) as an EMA per peer: a score
in the metrics and ``swarmgrad status --scores``, never a ban (one part on a few windows is
noisy).

The probe has its own copy of the model, used from one worker thread at a time, so it never
touches the trainer's.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable

import numpy as np
import torch

from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.training.data import Corpus
from swarmgrad.node.training.model import build_model, flatten, unflatten

__all__ = ["LOSS_PROBE_WINDOWS", "LossProbe"]

#: Training windows each spot check evaluates on.
LOSS_PROBE_WINDOWS = 8


class LossProbe:
    """Spot checks for one trainer: ``theta`` gives the swarm's parameters of the round (flat, in
    the all-reduce's order), read on the loop while the round runs."""

    def __init__(
        self,
        spec: RunSpec,
        corpus: Corpus,
        theta: Callable[[], torch.Tensor],
        *,
        windows: int = LOSS_PROBE_WINDOWS,
    ) -> None:
        self.run_id = spec.run.id
        self.seq_len = spec.model.seq_len
        self.windows_per_check = windows
        self._train = torch.from_numpy(corpus.tokens[: corpus.split].astype(np.int64))
        if len(self._train) <= self.seq_len + 1:
            raise ValueError("the training split is shorter than a window")
        self._model = build_model(spec.model, seed=0)
        self._model.eval()
        self._params = list(self._model.parameters())
        self._size = flatten(self._params).numel()
        self._theta = theta
        self._lock = threading.Lock()

    def windows(self, peer_id: str, round_: int) -> torch.Tensor:
        """The windows a spot check of ``peer_id`` in ``round_`` evaluates on: drawn from the
        training split by a generator seeded with (run, peer, round)."""
        seed = hashlib.blake2b(f"{self.run_id}:{peer_id}:{round_}".encode(), digest_size=8)
        generator = torch.Generator().manual_seed(int.from_bytes(seed.digest(), "little") >> 1)
        high = len(self._train) - self.seq_len - 1
        starts = torch.randint(0, high, (self.windows_per_check,), generator=generator)
        return self._train[starts[:, None] + torch.arange(self.seq_len + 1)]

    def snapshot(self) -> Callable[[str, int, int, torch.Tensor], float]:
        theta = self._theta().detach().to("cpu", torch.float32, copy=True)
        if theta.numel() != self._size:
            raise ValueError(f"parameters of {theta.numel()} values, the model has {self._size}")

        def measure(peer_id: str, round_: int, start: int, values: torch.Tensor) -> float:
            return self.gain(theta, peer_id, round_, start, values)

        return measure

    def gain(
        self, theta: torch.Tensor, peer_id: str, round_: int, start: int, values: torch.Tensor
    ) -> float:
        """The loss ``values`` (a pseudo-gradient's range at ``start``) take off ``theta`` on
        the windows of (``peer_id``, ``round_``)."""
        end = start + values.numel()
        if not 0 <= start <= end <= theta.numel():
            raise ValueError(f"values [{start}, {end}) outside the {theta.numel()} parameters")
        windows = self.windows(peer_id, round_)
        moved = theta.clone()
        moved[start:end] -= values.to(torch.float32)
        with self._lock, torch.no_grad():
            before = self._loss(theta, windows)
            after = self._loss(moved, windows)
        return before - after

    def _loss(self, theta: torch.Tensor, windows: torch.Tensor) -> float:
        unflatten(theta, self._params)
        return float(self._model.loss(windows[:, :-1], windows[:, 1:]))
