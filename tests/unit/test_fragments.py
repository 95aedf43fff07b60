"""Rounds in fragments (``algorithm.fragments``): each sync averages one range of the parameters
and leaves the others alone, replicas stay bit-identical with overlapped rounds too, and the end
of a run lands every fragment's progress. Replicas each in its own thread, in the fake group of
``replica_hub``."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import torch

from swarmgrad.node.averaging.rounds import Outcome
from swarmgrad.node.training.diloco import DiLoCo
from swarmgrad.node.training.model import flatten
from tests.unit.replica_hub import Hub, replicas


def move(made: list[tuple[torch.nn.Linear, DiLoCo]], steps: int, salt: float) -> list[Any]:
    """``steps`` inner "steps" on every replica, each in its own thread (a blocking round waits
    for the others); the reports of the last step."""

    def run(i: int) -> Any:
        model, replica = made[i]
        report = None
        for step in range(steps):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * (i + 1) * salt + 0.001 * step)
            report = replica.step(samples=1)
        return report

    with concurrent.futures.ThreadPoolExecutor(len(made)) as pool:
        return list(pool.map(run, range(len(made)), timeout=20))


def test_fragments_sync_one_range_each_turn_and_leave_the_others_alone() -> None:
    made = replicas(Hub(members=2), 2, overlap=False, fragments=3, inner_steps=6)
    first = made[0][1]
    assert first.sync_every == 2
    assert [end - start for start, end in first.bounds] == [3, 3, 4]  # 10 values, 3 ranges
    for turn in range(6):
        fragment = turn % 3
        start, end = first.bounds[fragment]
        theta_before = first.outer.theta.clone()
        locals_before = [flatten(r.params) for _, r in made]
        reports = move(made, 2, salt=turn + 1)  # the second step runs the fragment's round
        assert {report.outcome for report in reports} == {Outcome.AVERAGED}
        assert {r.epoch for _, r in made} == {turn + 1}
        theta = first.outer.theta
        assert torch.equal(theta[:start], theta_before[:start])
        assert torch.equal(theta[end:], theta_before[end:])
        assert not torch.equal(theta[start:end], theta_before[start:end])
        assert len({r.outer.checksum() for _, r in made}) == 1
        for i, ((_, replica), before) in enumerate(zip(made, locals_before, strict=True)):
            local = flatten(replica.params)
            # blocking: the fragment's local values are the new global ones; the other ranges
            # kept their own two steps' moves
            assert torch.equal(local[start:end], theta[start:end])
            moved = 2 * 0.01 * (i + 1) * (turn + 1) + 0.001
            outside = torch.cat([local[:start] - before[:start], local[end:] - before[end:]])
            torch.testing.assert_close(outside, torch.full_like(outside, moved))


def test_fragments_with_overlap_keep_replicas_identical() -> None:
    made = replicas(Hub(members=3), 3, overlap=True, fragments=2, inner_steps=4)
    for turn in range(7):
        move(made, 2, salt=turn + 1)
    drained = [r.drain() for _, r in made]
    assert {d.outcome for d in drained if d is not None} == {Outcome.AVERAGED}
    assert {r.epoch for _, r in made} == {7}
    assert len({r.outer.checksum() for _, r in made}) == 1
    _, meta = made[0][1].state_dict()
    assert len(meta["fragment_samples"]) == 2


def test_the_end_of_a_run_lands_every_fragments_progress() -> None:
    """finish(): the round in flight lands, then the other fragments' rounds send the progress
    made since their own last round; after it every replica's parameters are the global ones,
    the mean of the replicas' parameters before it (outer lr 1, no momentum)."""
    made = replicas(Hub(members=3), 3, overlap=True, fragments=2, inner_steps=4)
    for turn in range(5):
        move(made, 2, salt=turn + 1)
    assert {r.rounds_started for _, r in made} == {5}  # 4 landed, 1 in flight
    expected = sum(flatten(r.params) for _, r in made) / 3
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        finished = list(pool.map(lambda pair: pair[1].finish(), made, timeout=20))
    assert [[report.outcome for report in reports] for reports in finished] == [
        [Outcome.AVERAGED, Outcome.AVERAGED]
    ] * 3
    assert {r.epoch for _, r in made} == {6}
    assert len({r.outer.checksum() for _, r in made}) == 1
    for _, replica in made:
        assert torch.equal(flatten(replica.params), replica.outer.theta)
        torch.testing.assert_close(replica.outer.theta, expected)
