"""Rounds by time window (``algorithm.round_seconds``): each replica trains as many inner steps
as fit and comes to the round weighted by its samples, so peers of different speeds are ready
together: in the model, a swarm with a 4x speed spread averages every round as one group."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from swarmgrad.node.averaging.slots import (
    SETTLE_SECONDS,
    checks,
    in_slot,
    slot_cut,
    slot_grace,
    slot_of,
    window_end,
)
from swarmgrad.node.kinds import RoundOutcome
from swarmgrad.node.runspec import RunSpec, RunSpecError
from swarmgrad.node.training.window import RoundWindow, steps_in_window, take_step
from swarmgrad.simulations.des.model import ModelConfig, SwarmModel
from swarmgrad.simulations.profiles import PeerProfile
from swarmgrad.simulations.swarm import DEMO_SPEC
from tests.unit.replica_hub import Hub, replicas


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_window_ends_at_a_slot_boundary_before_a_step_would_cross_it() -> None:
    assert steps_in_window(1.0, 0.25) == 4
    assert steps_in_window(1.0, 0.3) == 3  # a fourth would end past the boundary
    assert steps_in_window(1.0, 4.0) == 1  # one at the least
    # Opened anywhere in a slot, a window ends at a multiple of the slot, at least a quarter
    # slot on: peers that started at different moments end together.
    assert window_end(100.0, 2.0) == 102.0
    assert window_end(100.4, 2.0) == 102.0
    assert window_end(101.6, 2.0) == 104.0  # less than half a second left: the next one
    clock = Clock()
    clock.now = 100.4
    window = RoundWindow(2.0, clock)
    assert window.ends_at == 102.0
    steps = 0
    while True:
        clock.now += 0.3
        steps += 1
        if window.due():
            break
    assert steps == 5
    assert clock.now == pytest.approx(101.9)
    window.restart()
    assert window.ends_at == 104.0
    assert not window.check_due()
    # Checked at every quarter slot before the boundary (102.5, 103, 103.5), each once.
    assert checks(101.9, 104.0, 2.0) == [102.5, 103.0, 103.5]
    clock.now = 102.6
    assert window.check_due()
    assert not window.check_due()
    clock.now = 103.7  # two marks passed while it stepped: one check
    assert window.check_due()
    assert not window.check_due()
    # After a round the trainer evaluates (and may checkpoint) before its next step: that is
    # not the step's time. A window told the step's own time trains on to the boundary.
    clock.now = 104.0
    window.restart()
    assert window.ends_at == 106.0
    clock.now += 1.25 + 0.125  # a 1.25 s evaluation, then a 0.125 s step
    assert not window.due(0.125)
    stepped = 1
    while not window.due(0.125):
        clock.now += 0.125
        stepped += 1
    assert stepped == 6  # the last one ends at the boundary
    assert clock.now == 106.0
    clock.now = 106.0
    window.restart()
    clock.now += 1.25 + 0.125
    assert window.due()  # timed from the round: the evaluation counted as a step, 5 lost
    with pytest.raises(ValueError, match="positive"):
        RoundWindow(0.0, clock)


def test_a_record_counts_in_its_slot_up_to_the_grace() -> None:
    """Every peer puts a readiness record in the same slot, or in none, from its signed time
    alone: a record signed past the grace is in nobody's groups."""
    assert slot_grace(2.0) == 0.25
    assert slot_grace(60.0) == 2.0
    assert slot_of(101.9, 2.0) == 51
    assert in_slot(101.9, 51, 2.0)
    assert in_slot(102.2, 51, 2.0)
    assert not in_slot(102.3, 51, 2.0)  # past the grace
    assert not in_slot(103.1, 51, 2.0)  # the next slot's


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("round_seconds = -1.0", "must be >= 0"),
        ('round_seconds = 5.0\nname = "sync"', "for algorithm.name = 'diloco' without fragments"),
        ("round_seconds = 5.0\nfragments = 2\ninner_steps = 10", "without fragments"),
        ("round_seconds = 0.7", r"must be at least 0.80 s: a slot's round is cut only after"),
        ("round_seconds = 0.5\noverlap = true", r"must be at least 0.80 s"),
    ],
)
def test_the_spec_refuses_windows_it_cannot_keep(extra: str, message: str) -> None:
    with pytest.raises(RunSpecError, match=message):
        RunSpec.from_toml(f'[run]\nid = "w"\n[algorithm]\n{extra}\n')
    fine = RunSpec.from_toml('[run]\nid = "w"\n[algorithm]\nround_seconds = 5.0\n')
    assert fine.algorithm.round_seconds == 5.0
    assert fine.hash != RunSpec.from_toml('[run]\nid = "w"\n').hash
    # The shortest slots that are kept: the cut, a grace and the settle time after the
    # boundary, comes before a blocking round must end (three quarters of the slot).
    assert slot_cut(0, 0.8) + SETTLE_SECONDS == pytest.approx(0.75 * 0.8)
    assert RunSpec.from_toml('[run]\nid = "w"\n[algorithm]\nround_seconds = 0.8\n')


def test_a_replica_rounds_when_its_window_ends_with_the_samples_it_trained() -> None:
    """Two replicas, one 2x faster: each trains until its window ends (4 steps against 2) and
    their round weighs them by their samples; the next window starts at the round."""
    hub = Hub(members=2)
    made = replicas(hub, 2, overlap=True)  # overlapped: the round starts without blocking
    clock = Clock()
    windows = [RoundWindow(1.0, clock), RoundWindow(1.0, clock)]
    step_seconds = [0.25, 0.5]
    steps = [0, 0]
    reports: list[Any] = [None, None]
    for i, ((model_, replica), window) in enumerate(zip(made, windows, strict=True)):
        clock.now = 100.0
        while reports[i] is None and steps[i] < 100:
            with torch.no_grad():
                for p in model_.parameters():
                    p.add_(0.01)
            clock.now += step_seconds[i]
            steps[i] += 1
            take_step(replica, window, samples=4)
            reports[i] = replica._in_flight
    assert steps == [4, 2]
    weights = [r._in_flight.weight for _, r in made]  # type: ignore[union-attr]
    assert weights == [16, 8]  # 4 samples a step
    assert not windows[0].due()  # restarted at its round
    landed = [r.drain() for _, r in made]
    assert {d.outcome for d in landed if d is not None} == {RoundOutcome.AVERAGED}
    assert len({r.outer.checksum() for _, r in made}) == 1


def test_a_4x_speed_spread_averages_every_round_as_one_group() -> None:
    """In the model: 8 peers, 1x to 4x slower. With fixed steps the fast ones wait for the
    slow ones at every round; with a window they are ready together: every round is averaged
    by all 8, nothing is resynced or lost, and their compute is more of their time."""
    profiles = tuple(
        PeerProfile(upload_bytes_per_second=5e6, slowdown=1 + 3 * i / 7) for i in range(8)
    )
    # Slots of 2 s: the slowest peer's 10 steps. (At 1 s, a round's fixed cost, the slot's grace
    # and the settle time, is a larger share of each slot than the fast peers' waiting for the
    # slow ones costs with fixed steps: 43% against 49% utilization; 65% at 2 s.)
    window = DEMO_SPEC.replace("[averaging]", "round_seconds = 2.0\n\n[averaging]")

    def run(text: str) -> SwarmModel:
        swarm = SwarmModel(
            ModelConfig(spec=RunSpec.from_toml(text), nodes=8, rounds=6, profiles=profiles,
                        step_seconds=0.05)
        )  # fmt: skip
        swarm.run()
        return swarm

    fixed, windowed = run(DEMO_SPEC), run(window)
    for peer in windowed.peers:
        assert [(h["outcome"], h["group_size"]) for h in peer.history] == [("averaged", 8)] * 6
    summary = windowed.summary()
    assert summary["totals"]["samples_kept"] == 1.0
    # The fastest peer trained 4x the slowest's steps, in the same time.
    samples = sorted(p.samples for p in windowed.peers)
    assert samples[-1] >= 3.5 * samples[0]
    assert summary["totals"]["utilization"] > fixed.summary()["totals"]["utilization"]
