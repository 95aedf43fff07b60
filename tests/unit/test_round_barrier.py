"""A stage replica's round barrier: a round waits for every active trainer, not for quiet ones,
and never past its deadline."""

from __future__ import annotations

import asyncio

from swarmgrad.node.pipeline.barrier import RoundBarrier


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_round_waits_for_every_active_trainer() -> None:
    clock = Clock()
    barrier = RoundBarrier(active_seconds=10, wait_seconds=20, clock=clock)
    for trainer in ("a", "b", "c"):
        barrier.heard(trainer)
    first = asyncio.create_task(barrier.wait(1, "a"))
    second = asyncio.create_task(barrier.wait(1, "b"))
    await _settle()
    assert not first.done()
    assert not second.done()
    assert barrier.missing(1) == {"c"}
    async with asyncio.timeout(5):
        await barrier.wait(1, "c")  # the last to arrive: nobody left to wait for
        await asyncio.gather(first, second)
    assert barrier.timed_out == 0
    # One who arrives after the round ran (it waits for nobody: everyone asked already).
    async with asyncio.timeout(5):
        await barrier.wait(1, "b")


async def test_a_trainer_gone_quiet_is_not_waited_for() -> None:
    clock = Clock()
    barrier = RoundBarrier(active_seconds=10, wait_seconds=20, clock=clock)
    barrier.heard("gone")
    clock.now += 5
    waiting = asyncio.create_task(barrier.wait(3, "a"))
    await _settle()
    assert not waiting.done()
    clock.now += 6  # "gone" was last heard 11 s ago
    async with asyncio.timeout(5):
        await waiting
    assert barrier.timed_out == 0


async def test_no_round_waits_past_its_deadline() -> None:
    clock = Clock()
    barrier = RoundBarrier(active_seconds=100, wait_seconds=20, clock=clock)
    barrier.heard("slow")
    waiting = asyncio.create_task(barrier.wait(2, "a"))
    await _settle()
    clock.now += 19
    await _settle()
    assert not waiting.done()
    clock.now += 2
    async with asyncio.timeout(5):
        await waiting
    assert barrier.timed_out == 1
    assert barrier.missing(2) == {"slow"}
