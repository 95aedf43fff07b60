"""Overlapped DiLoCo rounds (``algorithm.overlap``): each round's average lands one round late,
every replica applies the same outer step (bit-identical global parameters), the progress made
meanwhile is carried onto it, and a failed round loses nothing. Replicas in one thread, in the
fake group of ``replica_hub``. (Rounds in fragments: test_fragments.py.)"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from swarmgrad.node.averaging.rounds import Outcome
from swarmgrad.node.kinds import RoundOutcome
from swarmgrad.node.training.diloco import DiLoCo
from swarmgrad.node.training.model import flatten
from tests.unit.replica_hub import H, Hub, replicas


def train_round(made: list[tuple[torch.nn.Linear, DiLoCo]], round_: int) -> list[Any]:
    """H inner "steps" on every replica (each moves its parameters its own way); the reports."""
    reports = []
    for step in range(H):
        for i, (model, replica) in enumerate(made):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * (i + 1) * (round_ + 1) + 0.001 * step)
            report = replica.step(samples=1 + i)
            if step == H - 1:
                reports.append(report)
    return reports


def test_rounds_land_one_round_late_with_the_progress_carried_and_replicas_identical() -> None:
    hub = Hub(members=3)
    made = replicas(hub, 3)
    theta0 = made[0][1].outer.theta.clone()
    assert train_round(made, 0) == [None, None, None]  # launched, nothing to land yet
    first = [flatten(r.params) for _, r in made]  # local parameters when round 0 started
    weights = torch.tensor([1.0, 2.0, 3.0]) * H
    expected = sum((w / weights.sum()) * x for w, x in zip(weights, first, strict=True))
    reports = train_round(made, 1)  # lands round 0 at this boundary
    assert {report.outcome for report in reports} == {Outcome.AVERAGED}
    assert {r.epoch for _, r in made} == {1}
    assert len({r.outer.checksum() for _, r in made}) == 1  # bit-identical global parameters
    # outer lr 1, no momentum: the new global is the samples-weighted mean of round 0's locals
    torch.testing.assert_close(made[0][1].outer.theta, expected)
    assert not torch.equal(made[0][1].outer.theta, theta0)
    for i, (_, replica) in enumerate(made):
        # round 1's own progress (train_round's moves), carried onto the new global
        progress = sum(0.01 * (i + 1) * 2 + 0.001 * step for step in range(H))
        torch.testing.assert_close(flatten(replica.params), replica.outer.theta + progress)
        sent = replica._in_flight.compensated  # type: ignore[union-attr]
        torch.testing.assert_close(sent, torch.full_like(sent, -progress))  # what round 1 sends
    for round_ in range(2, 5):
        train_round(made, round_)
    drained = [r.drain() for _, r in made]
    assert {d.outcome for d in drained if d is not None} == {Outcome.AVERAGED}
    assert {r.epoch for _, r in made} == {5}
    assert len({r.outer.checksum() for _, r in made}) == 1
    assert all(r._in_flight is None for _, r in made)


def test_a_failed_round_changes_nothing_and_its_progress_goes_with_the_next() -> None:
    hub = Hub(members=2, failing=(0,))
    made = replicas(hub, 2)
    train_round(made, 0)
    before = [flatten(r.params) for _, r in made]
    theta = made[0][1].outer.theta.clone()
    reports = train_round(made, 1)  # round 0 fails when it lands
    assert {report.outcome for report in reports} == {Outcome.ABORTED}
    assert {r.epoch for _, r in made} == {0}
    assert torch.equal(made[0][1].outer.theta, theta)
    for (_, replica), was in zip(made, before, strict=True):
        sent = replica._in_flight.compensated  # type: ignore[union-attr]
        # the next round carries both rounds' progress, and both rounds' samples
        torch.testing.assert_close(sent, theta - flatten(replica.params))
        assert not torch.equal(flatten(replica.params), was)
    assert [replica._in_flight.weight for _, replica in made] == [2 * H, 4 * H]  # type: ignore[union-attr]
    train_round(made, 2)
    assert {r.epoch for _, r in made} == {1}
    assert len({r.outer.checksum() for _, r in made}) == 1


def test_an_owners_feedback_moves_on_only_with_a_round_that_averaged() -> None:
    # A round works on a copy of the part a node owns and hands it back moved on; the replica
    # takes it only when the round's result is applied (here: +1 on the first half).
    hub = Hub(members=2, failing=(1,))
    made = replicas(hub, 2, owner_feedback=True)
    owner = made[0][1]._owner_residual
    assert owner is not None
    half = owner.numel() // 2

    def moved_by(times: float) -> bool:
        return torch.equal(owner[:half], torch.full((half,), times)) and not owner[half:].any()

    train_round(made, 0)  # round 0 launched
    assert moved_by(0.0)
    train_round(made, 1)  # round 0 lands, round 1 launched
    assert {r.epoch for _, r in made} == {1}
    assert moved_by(1.0)
    reports = train_round(made, 2)  # round 1 fails when it lands: the feedback stays
    assert {report.outcome for report in reports} == {Outcome.ABORTED}
    assert {r.epoch for _, r in made} == {1}
    assert moved_by(1.0)
    train_round(made, 3)  # its retry lands
    assert {r.epoch for _, r in made} == {2}
    assert moved_by(2.0)


def test_the_schedule_position_counts_the_round_in_flight() -> None:
    made = replicas(Hub(members=1), 1)
    replica = made[0][1]
    train_round(made, 0)
    assert replica.epoch == 0
    assert replica.schedule_step == H  # round 1's first step, though round 0 has not landed
    tensors, meta = replica.state_dict()
    assert meta["in_flight"]["epoch"] == 0
    assert tensors["in_flight.boundary"].shape == (replica.numel,)


def test_a_replica_the_swarm_left_behind_carries_its_progress_into_the_swarms_state() -> None:
    """Overlapped, at a boundary: the swarm has landed rounds without this replica (it joined
    mid-round, or a round of its failed); it downloads the swarm's state, keeps its progress and
    samples on top of it, and sends that progress in the round it starts now, with the swarm."""
    hub = Hub(members=2)
    (model, replica), _ = replicas(hub, 2)
    swarm_theta = replica.outer.theta + 0.5
    swarm_state = torch.cat([swarm_theta, torch.zeros_like(swarm_theta)])  # theta, momentum
    donor = SimpleNamespace(peer_id="donor")
    replica.swarm.find_donors = lambda epoch, checksum: [donor] if epoch < 4 else []
    replica.swarm.download_state = lambda donors, numel: SimpleNamespace(
        epoch=4, values=swarm_state.clone()
    )
    moves = [0.01 * (step + 1) for step in range(H)]
    for shift in moves:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(shift)
        report = replica.step(samples=5)
    assert report is not None
    assert report.outcome is RoundOutcome.RESYNCED
    assert replica.epoch == 4
    progress = sum(moves)
    torch.testing.assert_close(flatten(replica.params), swarm_theta + progress)
    assert replica._in_flight is not None  # the round it starts with the swarm's, at epoch 4
    assert replica._in_flight.epoch == 4
    assert replica._in_flight.weight == 5 * H  # its samples came along
    torch.testing.assert_close(
        replica._in_flight.compensated, torch.full_like(swarm_theta, -progress)
    )


def linked(made: list[tuple[torch.nn.Linear, DiLoCo]]) -> None:
    """Each replica resyncs from the others' published states (the newest epoch's holder)."""
    for _, replica in made:
        others = [r for _, r in made if r is not replica]

        def donors(epoch: int, checksum: str, others: list[DiLoCo] = others) -> list[Any]:
            ahead = [r for r in others if r.swarm.snapshot.epoch > epoch]
            return [max(ahead, key=lambda r: r.swarm.snapshot.epoch).swarm] if ahead else []

        replica.swarm.find_donors = donors
        replica.swarm.download_state = lambda donors, numel: donors[0].snapshot


def restarted(made: list[tuple[torch.nn.Linear, DiLoCo]], i: int) -> None:
    """Replica ``i`` from its checkpoint, in a new model (a kill and restart): what it had in
    flight is never collected."""
    tensors, meta = made[i][1].state_dict()
    hub = made[i][1].swarm
    model, replica = replicas(Hub(members=1), 1)[0]
    replica.swarm = hub
    replica.load_state_dict(tensors, json.loads(json.dumps(meta)))
    made[i] = (model, replica)
    linked(made)


@pytest.mark.parametrize("landed", [True, False])
def test_a_round_in_flight_at_a_restart_is_applied_once_whether_it_landed_or_not(
    landed: bool,
) -> None:
    """Restarted right after a boundary, a replica cannot know whether the round it had just
    started landed: if the swarm is past it, its progress up to the boundary is in the swarm's
    state and is not sent again; if not, the next round sends it with its samples. Either way
    the swarm ends where it would have without the restart."""

    def run(restart: bool) -> tuple[torch.Tensor, list[int]]:
        made = replicas(Hub(members=2, failing=() if landed else (2,)), 2)
        linked(made)
        schedule = []
        for round_ in range(7):
            train_round(made, round_)
            if restart and round_ == 2:  # round 2 was started at this boundary
                # The one that steps second: at the next boundary, the other has landed (or
                # failed) round 2 before it looks (the hub has no matchmaking to time out).
                restarted(made, 1)
                schedule = [r.schedule_step for _, r in made]
        for _, replica in made:
            replica.drain()
        thetas = {r.outer.checksum() for _, r in made}
        assert len(thetas) == 1
        return made[1][1].outer.theta, schedule

    expected, _ = run(restart=False)
    theta, schedule = run(restart=True)
    torch.testing.assert_close(theta, expected)
    assert schedule[0] == schedule[1]  # the learning-rate schedule did not fall a round behind


def test_a_stop_while_waiting_for_a_round_keeps_it_in_the_checkpoint() -> None:
    made = replicas(Hub(members=2), 2)
    train_round(made, 0)  # round 0 in flight on both
    replica = made[0][1]
    pending = replica._in_flight
    assert pending is not None
    stopped: concurrent.futures.Future[Any] = concurrent.futures.Future()
    stopped.cancel()  # what the node's loop does to a round when it stops
    replica._in_flight = dataclasses.replace(pending, future=stopped)
    with pytest.raises(concurrent.futures.CancelledError):
        replica.drain()
    tensors, meta = replica.state_dict()
    assert meta["in_flight"] == {"epoch": 0, "fragment": None, "offset": 0, "weight": H}
    assert "in_flight.boundary" in tensors
    assert meta["samples"] == 0  # its samples are the round's, not counted twice
