"""One round under one deadline (node/averaging/rounds.py), with stand-ins for the DHT and the
all-reduce: no sockets, no processes."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, cast

import pytest
import torch

from swarmgrad.node.averaging.allreduce import RoundResult
from swarmgrad.node.averaging.group import Group, Member
from swarmgrad.node.averaging.rounds import Outcome, RoundParts, Rounds, RoundsConfig
from swarmgrad.node.scraped import Tallies
from swarmgrad.protocol.errors import RoundAborted

GROUP = Group(
    round=3,
    members=(
        Member(peer_id="a", endpoint="127.0.0.1:1", weight=1.0),
        Member(peer_id="b", endpoint="127.0.0.1:2", weight=1.0),
    ),
)


class Stalls:
    """A part whose call never returns (a DHT node that stopped answering, a hung peer)."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        await asyncio.Event().wait()


class Matchmaker:
    settle_seconds = 0.0

    def __init__(self, form_group: Any) -> None:
        self.form_group = form_group


class Averager:
    def __init__(self, all_reduce: Any) -> None:
        self.all_reduce = all_reduce


class Directory:
    def __init__(self) -> None:
        self.peers: list[Any] = []
        self.withdrawn: list[str] = []

    async def withdraw(self, topic: str) -> None:
        self.withdrawn.append(topic)


class Reachability:
    owner_share = 1.0

    def __init__(self) -> None:
        self.settled = asyncio.Event()
        self.settled.set()
        self.endpoint = "127.0.0.1:1"


class Routes:
    async def prepare(self, endpoints: Any, peers: Any) -> None:
        pass


def rounds(
    *, form_group: Any, all_reduce: Any = None, budget_seconds: float = 0.5
) -> tuple[Rounds, Tallies, Directory, list[asyncio.Task[None]]]:
    tallies, directory, spawned = Tallies(), Directory(), []

    def spawn(coro: Coroutine[Any, Any, None], name: str) -> None:
        spawned.append(asyncio.create_task(coro, name=name))

    parts = RoundParts(
        matchmaker=cast(Any, Matchmaker(form_group)),
        averager=cast(Any, Averager(all_reduce)),
        directory=cast(Any, directory),
        reachability=cast(Any, Reachability()),
        routes=cast(Any, Routes()),
        tallies=tallies,
        spawn=spawn,
    )
    return Rounds(parts, RoundsConfig(budget_seconds=budget_seconds)), tallies, directory, spawned


async def test_a_stalled_matchmaking_ends_as_no_group_within_the_budget() -> None:
    stalled = Stalls()
    node, tallies, directory, spawned = rounds(form_group=stalled, budget_seconds=0.5)
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with asyncio.timeout(5):  # the test's own bound: the round's must come first
        report = await node.run(torch.ones(8), epoch=3, weight=1.0)
    assert report.outcome is Outcome.NO_GROUP
    assert "budget of 0.5 s" in report.error
    assert 0.5 <= loop.time() - started < 2.0
    assert stalled.calls == 1
    assert tallies.counts["no group"] == 1
    await asyncio.gather(*spawned)
    assert directory.withdrawn == ["round/3"]  # its readiness record does not linger


async def test_a_stalled_all_reduce_ends_as_aborted_within_the_budget() -> None:
    async def form_group(*args: Any, **kwargs: Any) -> Group:
        return GROUP

    node, tallies, _, spawned = rounds(
        form_group=form_group, all_reduce=Stalls(), budget_seconds=0.5
    )
    async with asyncio.timeout(5):
        report = await node.run(torch.ones(8), epoch=3, weight=1.0)
    assert report.outcome is Outcome.ABORTED
    assert report.group == GROUP
    assert tallies.failures["aborted_round"] == 1
    for task in spawned:
        task.cancel()
    await asyncio.gather(*spawned, return_exceptions=True)


@pytest.mark.parametrize("aborts", [False, True])
async def test_a_round_in_time_reports_what_the_all_reduce_did(aborts: bool) -> None:
    async def form_group(*args: Any, **kwargs: Any) -> Group:
        return GROUP

    async def all_reduce(
        vector: torch.Tensor, group: Group, keep_sent: bool, owner_residual: Any
    ) -> RoundResult:
        if aborts:
            raise RoundAborted("nothing was averaged with another peer")
        return RoundResult(
            averaged=vector * 2, contributors=("a", "b"), partial=(), missing=(), failures={}
        )

    node, tallies, directory, spawned = rounds(
        form_group=form_group, all_reduce=all_reduce, budget_seconds=5.0
    )
    report = await node.run(torch.ones(8), epoch=3, weight=1.0)
    await asyncio.gather(*spawned)
    if aborts:
        assert report.outcome is Outcome.ABORTED
        assert tallies.counts["aborted"] == 1
    else:
        assert report.outcome is Outcome.AVERAGED
        assert report.result is not None
        assert torch.equal(report.result.averaged, torch.full((8,), 2.0))
        assert tallies.counts["averaged"] == 1
    assert "round/3" in directory.withdrawn


async def test_an_unexpected_error_in_a_round_loses_the_round_not_the_node(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def form_group(*args: Any, **kwargs: Any) -> Group:
        return GROUP

    calls = 0

    async def all_reduce(
        vector: torch.Tensor, group: Group, keep_sent: bool, owner_residual: Any
    ) -> RoundResult:
        nonlocal calls
        calls += 1
        if calls == 1:  # what a peer's input once reached: an IndexError deep in the checks
            raise IndexError("list index out of range")
        return RoundResult(
            averaged=vector, contributors=("a", "b"), partial=(), missing=(), failures={}
        )

    node, tallies, directory, spawned = rounds(
        form_group=form_group, all_reduce=all_reduce, budget_seconds=5.0
    )
    failed = await node.run(torch.ones(8), epoch=3, weight=1.0)
    assert failed.outcome is Outcome.ABORTED
    assert "IndexError" in failed.error
    assert tallies.failures["internal"] == 1
    assert "the round failed on an unexpected error" in caplog.text  # with its traceback
    assert (await node.run(torch.ones(8), epoch=4, weight=1.0)).outcome is Outcome.AVERAGED
    await asyncio.gather(*spawned)
    assert "round/3" in directory.withdrawn


async def test_a_first_round_announces_the_endpoint_its_reachability_verdict_gave() -> None:
    # A NAT'd node that learns it is relayed while it waits must announce the relay's address,
    # not the LAN one it had when the round was asked for (the NAT lab saw peers dial
    # 192.168.x.y and fail).
    announced: list[str] = []

    async def form_group(epoch: int, *, endpoint: str, **options: Any) -> None:
        announced.append(endpoint)

    node, _, directory, spawned = rounds(form_group=form_group, budget_seconds=5.0)
    directory.peers = [object(), object()]  # peers to ask: the first round waits for a verdict
    reach = node._parts.reachability
    reach.settled.clear()
    reach.endpoint = "192.168.1.2:5000"

    async def verdict() -> None:
        await asyncio.sleep(0.1)
        reach.endpoint = "11.7.0.10:6000"  # its relay's
        reach.settled.set()

    asyncio.get_running_loop().call_soon(lambda: spawned.append(asyncio.create_task(verdict())))
    report = await node.run(torch.ones(8), epoch=0, weight=1.0)
    assert report.outcome is Outcome.NO_GROUP
    assert announced == ["11.7.0.10:6000"]
    await asyncio.gather(*spawned)
