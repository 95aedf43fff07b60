"""Open-run rounds of in-process averagers for the tests: the run's config, honest updates, one
round of a group, and what an honest round returns."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import torch

from swarmgrad.node.averaging.allreduce import AllReduceConfig, RoundResult
from swarmgrad.node.averaging.averager import Averager
from swarmgrad.node.averaging.hooks import OwnerHooks
from swarmgrad.simulations.attacks import NaNPayloads
from tests.helpers import averagers, group_of, until

CHUNK = 4096
SIZE = 5 * 2 * CHUNK  # two chunks per owner's part


OPEN = AllReduceConfig(
    run_id="open-rounds",
    spec_hash=bytes(32),
    codec="int8",
    chunk_values=CHUNK,
    round_timeout_seconds=20.0,
    sender_timeout_seconds=5.0,
    reducer_timeout_seconds=10.0,
    aggregator="centered_clip",
    uniform_weights=True,
    result_codec="fp16",
    observe=True,
    # In one process, a check step's messages arrive in milliseconds: the tests whose members
    # go silent wait out each step, 2.5 s instead of a real run's 5 (CHECK_TIMEOUT_SECONDS).
    check_timeout_seconds=2.5,
)


def swarm(
    n: int, config: AllReduceConfig = OPEN, *, sockets: bool = False
) -> contextlib.AbstractAsyncContextManager[list[Averager]]:
    """``n`` averagers of one open run (``tests/helpers.averagers``)."""
    return averagers(n, config, name="open-rounds", sockets=sockets)


async def audited(peers: list[Averager], count: int, *, seconds: float = 30.0) -> None:
    """Wait until each of ``peers`` finished ``count`` audits (they run after the round)."""

    async def done() -> bool:
        return all(sum(p.checks[f"audit_{r}"] for r in AUDIT_RESULTS) >= count for p in peers)

    await until(done, timeout_seconds=seconds, what=f"{count} audits by each member",
                interval_seconds=0.05)  # fmt: skip


AUDIT_RESULTS = ("passed", "failed", "inconclusive")


def honest_updates(round_: int, n: int) -> list[torch.Tensor]:
    """A shared direction plus each member's own noise of the same size (DiLoCo-like deltas)."""
    g = torch.Generator().manual_seed(round_)
    common = torch.randn(SIZE, generator=g)
    return [common + torch.randn(SIZE, generator=g) for _ in range(n)]


async def average(
    averagers: list[Averager],
    vectors: list[torch.Tensor],
    round_: int,
    hooks: dict[int, NaNPayloads] | None = None,
    owner_hooks: dict[int, OwnerHooks] | None = None,
) -> list[RoundResult | BaseException]:
    """One round of ``averagers`` in one group; ``hooks`` and ``owner_hooks`` by member index:
    the faults those members inject."""
    group = group_of(averagers, round_)
    calls = [
        a.all_reduce(v, group, hooks=(hooks or {}).get(i), owner_hooks=(owner_hooks or {}).get(i))
        for i, (a, v) in enumerate(zip(averagers, vectors, strict=True))
    ]
    return list(await asyncio.gather(*calls, return_exceptions=True))


class Lie:
    """Owner hooks of a lying owner: ``publish`` makes what it sends of each chunk's result."""

    def __init__(self, publish: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        self.publish = publish

    def result(self, index: int, value: torch.Tensor) -> torch.Tensor:
        return self.publish(index, value)


def open_mean(averagers: list[Averager], updates: list[torch.Tensor]) -> torch.Tensor:
    """What an honest open round returns: each part the mean of its members but its owner (an
    owner's own values stay out of its part)."""
    group = group_of(averagers, 0)
    out = torch.empty(SIZE)
    for owner, (start, end) in enumerate(group.partition(SIZE)):
        others = [u[start:end] for i, u in enumerate(updates) if i != owner]
        out[start:end] = torch.stack(others).mean(0)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())
