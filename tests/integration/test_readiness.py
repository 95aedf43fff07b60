"""Readiness records and failed attempts: a peer's record for a round does not outlive its group,
nor an attempt that found nobody.

Two real swarms (hivemind DHT, gRPC) in one process. One member stalls after its group is formed
(its all-reduce starts late, as a slow or stuck attempt would); while it stalls, a peer starting
matchmaking for the same round must not see its record. If it did, it would build a group from
that attempt's record while the staller's next attempt announces another (its weight grows in
between), and the two would compute different group ids on every attempt: the livelock CI saw.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
import torch

from swarmgrad.node import Swarm, SwarmConfig
from swarmgrad.node.averaging.allreduce import RoundResult
from swarmgrad.node.averaging.group import Group
from swarmgrad.node.averaging.rounds import WITHDRAW_MARGIN_SECONDS, Outcome
from swarmgrad.node.identity import Identity
from swarmgrad.node.runspec import RunSpec
from swarmgrad.simulations.swarm import DEMO_SPEC

pytestmark = pytest.mark.slow

SPEC = RunSpec.from_toml(
    DEMO_SPEC.replace("group_size = 256", "group_size = 2")
    .replace('codec = "int8"', 'codec = "none"')
    .replace("matchmaking_timeout_seconds = 20.0", "matchmaking_timeout_seconds = 10.0")
)


async def test_a_stalled_attempt_withdraws_its_readiness_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stall_seconds = WITHDRAW_MARGIN_SECONDS + 6.0
    stalled, released = asyncio.Event(), asyncio.Event()

    async with Swarm(SPEC, Identity.generate(), SwarmConfig()) as first:
        bootstrap = tuple(first.visible_maddrs())  # type: ignore[union-attr]
        async with Swarm(SPEC, Identity.generate(), SwarmConfig(bootstrap=bootstrap)) as second:
            all_reduce = first._averager.all_reduce

            async def stall(vector: torch.Tensor, group: Group, **options: Any) -> RoundResult:
                stalled.set()  # the group formed; this member is slow to start its all-reduce
                with contextlib.suppress(TimeoutError):  # until the test has seen enough
                    async with asyncio.timeout(stall_seconds):
                        await released.wait()
                return await all_reduce(vector, group, **options)

            monkeypatch.setattr(first._averager, "all_reduce", stall)
            vector = torch.ones(1000)
            rounds = [
                asyncio.create_task(first.average(vector, epoch=0, weight=1.0)),
                asyncio.create_task(second.average(vector * 3, epoch=0, weight=1.0)),
            ]
            async with asyncio.timeout(30):  # no group formed, if it runs out
                await stalled.wait()
            formed = asyncio.get_running_loop().time()
            # Both records are there while the group forms (the mates read them), then the
            # staller's goes although its attempt has not ended.
            deadline = formed + WITHDRAW_MARGIN_SECONDS + 3.0
            while True:
                ready = await second.directory.discovery.find_ready(0)  # type: ignore[union-attr]
                if first.peer_id not in {r.peer_id for r in ready}:
                    break
                now = asyncio.get_running_loop().time()
                assert now < deadline, "the stalled member's readiness record is still up"
                await asyncio.sleep(0.2)
            assert asyncio.get_running_loop().time() - formed < stall_seconds - 1.0
            assert not rounds[0].done()  # still in its attempt
            released.set()
            async with asyncio.timeout(60):
                results = await asyncio.gather(*rounds)
    # The stall made the attempt late, not wrong: nothing mixed, and no one hung.
    for result in results:
        if result.result is not None and result.result.complete:
            assert torch.allclose(result.result.averaged, torch.full((1000,), 2.0))


async def test_a_peer_that_found_nobody_takes_its_readiness_record_down() -> None:
    # It trains on; a peer arriving for the round later must not build a group around it.
    spec = RunSpec.from_toml(
        DEMO_SPEC.replace("group_size = 256", "group_size = 2").replace(
            "matchmaking_timeout_seconds = 20.0", "matchmaking_timeout_seconds = 2.0"
        )
    )
    async with Swarm(spec, Identity.generate(), SwarmConfig()) as lone:
        bootstrap = tuple(lone.visible_maddrs())  # type: ignore[union-attr]
        async with Swarm(spec, Identity.generate(), SwarmConfig(bootstrap=bootstrap)) as witness:
            attempt = asyncio.create_task(lone.average(torch.ones(100), epoch=0, weight=1.0))
            deadline = asyncio.get_running_loop().time() + 10.0
            while True:  # the witness sees the record while the lone peer waits
                ready = await witness.directory.discovery.find_ready(0)  # type: ignore[union-attr]
                if lone.peer_id in {r.peer_id for r in ready}:
                    break
                assert asyncio.get_running_loop().time() < deadline, "no readiness record seen"
                await asyncio.sleep(0.1)
            async with asyncio.timeout(30):
                result = await attempt
            assert result.outcome is Outcome.NO_GROUP
            ready = await witness.directory.discovery.find_ready(0)  # type: ignore[union-attr]
            assert lone.peer_id not in {r.peer_id for r in ready}
    with pytest.raises(RuntimeError, match="was closed: make a new one"):  # not a half-start
        async with lone:
            pass
