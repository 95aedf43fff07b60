"""The DiLoCo outer step: Nesterov as specified, replicas stay bit-identical, missing ranges
carry their delta instead of losing it."""

from __future__ import annotations

import pytest
import torch

from swarmgrad.node.training.outer import OuterOptimizer


def randn(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_outer_step_is_nesterov_sgd() -> None:
    theta0 = randn(100, 0)
    opt = OuterOptimizer(theta0, lr=0.7, momentum=0.9)
    g1, g2 = randn(100, 1), randn(100, 2)
    opt.step(g1, own=g1)
    opt.step(g2, own=g2)
    # Reference: v1 = g1; theta1 = theta0 - lr (g1 + mu v1); v2 = mu v1 + g2; ...
    v1 = g1
    theta1 = theta0 - 0.7 * (g1 + 0.9 * v1)
    v2 = 0.9 * v1 + g2
    theta2 = theta1 - 0.7 * (g2 + 0.9 * v2)
    assert torch.allclose(opt.theta, theta2, atol=1e-6)


def test_replicas_applying_the_same_average_stay_bit_identical() -> None:
    theta0 = randn(10_000, 3)
    replicas = [OuterOptimizer(theta0, lr=0.7, momentum=0.9) for _ in range(3)]
    for round_ in range(20):
        locals_ = [r.theta - 0.01 * randn(10_000, 100 * round_ + i) for i, r in enumerate(replicas)]
        owns = [r.pseudo_gradient(t) for r, t in zip(replicas, locals_, strict=True)]
        averaged = torch.stack(owns).mean(0)  # what the all-reduce hands every member
        for replica, own in zip(replicas, owns, strict=True):
            replica.step(averaged, own=own)
    assert len({r.checksum() for r in replicas}) == 1
    assert torch.equal(replicas[0].theta, replicas[2].theta)


def test_missing_ranges_do_not_move_and_carry_the_delta_to_the_next_round() -> None:
    theta0 = randn(1000, 4)
    opt = OuterOptimizer(theta0, lr=1.0, momentum=0.0)
    local = theta0 - 0.5
    own = opt.pseudo_gradient(local)
    assert torch.allclose(own, torch.full((1000,), 0.5))
    opt.step(own, own=own, missing=[(100, 200)])
    assert torch.equal(opt.theta[100:200], theta0[100:200])  # nothing arrived: nothing moves
    assert torch.allclose(opt.theta[:100], theta0[:100] - 0.5)
    # The next pseudo-gradient includes what could not be sent.
    nxt = opt.pseudo_gradient(opt.theta)
    assert torch.allclose(nxt[100:200], torch.full((100,), 0.5))
    assert torch.equal(nxt[:100], torch.zeros(100))
    opt.step(nxt, own=nxt)
    assert torch.allclose(opt.theta, theta0 - 0.5, atol=1e-6)  # nothing was lost


def test_state_round_trips_and_bad_input_is_refused() -> None:
    opt = OuterOptimizer(randn(50, 5), lr=0.7, momentum=0.9)
    g = randn(50, 6)
    opt.step(g, own=g, missing=[(0, 10)])
    other = OuterOptimizer(torch.zeros(50), lr=0.7, momentum=0.9)
    other.load_state_dict(opt.state_dict())
    assert other.checksum() == opt.checksum()
    assert torch.equal(other.carry, opt.carry)
    with pytest.raises(ValueError, match="does not match"):
        other.load_state_dict({**opt.state_dict(), "carry": torch.zeros(49)})
    with pytest.raises(ValueError, match="lr > 0"):
        OuterOptimizer(torch.zeros(3), lr=0.0, momentum=0.9)
    with pytest.raises(ValueError, match="shape"):
        opt.step(torch.zeros(49), own=torch.zeros(49))
