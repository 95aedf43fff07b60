"""Overlapped DiLoCo rounds (``algorithm.overlap``): each round's average lands one round late,
every replica applies the same outer step (bit-identical global parameters), the progress made
meanwhile is carried onto it, and a failed round loses nothing. Replicas in one thread, a fake
group that averages once every member has started the round."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from swarmgrad.node.averaging.plan import RoundResult
from swarmgrad.node.averaging.rounds import Averaged, Outcome
from swarmgrad.node.kinds import RoundOutcome
from swarmgrad.node.runspec.algorithm import AlgorithmSection
from swarmgrad.node.training.diloco import DiLoCo
from swarmgrad.node.training.model import flatten

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
