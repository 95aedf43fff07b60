"""A fake group for tests of DiLoCo replicas in one process: ``Hub`` averages a round once every
member has started it (or fails it on purpose), and ``replicas`` builds replicas of one small
model whose swarm is that hub."""

from __future__ import annotations

import concurrent.futures
import threading
from types import SimpleNamespace
from typing import Any

import torch

from swarmgrad.node.averaging.plan import RoundResult
from swarmgrad.node.averaging.rounds import Averaged, Outcome
from swarmgrad.node.runspec.algorithm import AlgorithmSection
from swarmgrad.node.training.diloco import DiLoCo

H = 3


class Hub:
    """A group of every replica: a round's future resolves when all members started it."""

    def __init__(self, members: int, failing: tuple[int, ...] = ()) -> None:
        self.members, self.failing = members, set(failing)
        self.lock = threading.Lock()
        self.joined: dict[int, list[tuple[str, torch.Tensor, float, Any, Any]]] = {}

    def join(
        self, peer: str, epoch: int, vector: torch.Tensor, weight: float, owner: Any = None
    ) -> Any:
        with self.lock:  # blocking replicas join from their own threads
            return self._join(peer, epoch, vector, weight, owner)

    def _join(self, peer: str, epoch: int, vector: torch.Tensor, weight: float, owner: Any) -> Any:
        """``owner``: the replica's feedback as an owner; the round hands back its first half
        moved on by one (what a real round returns for the part a node owns)."""
        future: concurrent.futures.Future[Averaged] = concurrent.futures.Future()
        entries = self.joined.setdefault(epoch, [])
        moved = None if owner is None else (0, owner[: owner.numel() // 2] + 1)
        entries.append((peer, vector.clone(), weight, future, moved))
        if len(entries) == self.members:  # a retry of this epoch is a new round
            del self.joined[epoch]
            failing = epoch in self.failing
            self.failing.discard(epoch)
            total = sum(w for _, _, w, _, _ in entries)
            mean = sum(v * (w / total) for _, v, w, _, _ in entries)
            for _, vector_sent, _, f, moved in entries:
                if failing:
                    f.set_result(Averaged(outcome=Outcome.ABORTED, error="failed on purpose"))
                    continue
                result = RoundResult(
                    averaged=mean.clone(),
                    contributors=tuple(n for n, *_ in entries),
                    partial=(),
                    missing=(),
                    failures={},
                    owner_residual=moved,
                )
                group = SimpleNamespace(members=entries)
                f.set_result(
                    Averaged(outcome=Outcome.AVERAGED, result=result, group=group, sent=vector_sent)
                )
        return future


def fake_swarm(hub: Hub, name: str, *, owner_feedback: bool = False) -> Any:
    swarm = SimpleNamespace(
        peer_id=name,
        codec_is_lossless=True,
        owner_feedback=owner_feedback,
        snapshot=None,
        spec=SimpleNamespace(algorithm=AlgorithmSection()),
    )
    swarm.publish = lambda snapshot, throughput: setattr(swarm, "snapshot", snapshot)
    swarm.average = lambda vector, *, epoch, weight, keep_sent, owner_residual: hub.join(
        name, epoch, vector, weight, owner_residual
    )
    swarm.submit = lambda started: started  # the "coroutine" is already the future
    swarm.call = lambda value: value
    swarm.find_donors = lambda epoch, checksum: []
    return swarm


def replicas(
    hub: Hub,
    count: int,
    *,
    overlap: bool = True,
    fragments: int = 1,
    inner_steps: int = H,
    owner_feedback: bool = False,
) -> list[tuple[torch.nn.Linear, DiLoCo]]:
    made = []
    for i in range(count):
        model = torch.nn.Linear(4, 2)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.arange(p.numel(), dtype=torch.float32).view_as(p) / 10)
        replica = DiLoCo(
            fake_swarm(hub, f"peer-{i}", owner_feedback=owner_feedback),
            model,
            inner_steps=inner_steps,
            outer_lr=1.0,
            outer_momentum=0.0,
            overlap=overlap,
            fragments=fragments,
        )
        made.append((model, replica))
    return made
