"""The projection check's arithmetic (node/trust/checks.py): honest CenteredClip results pass
with room to spare, whatever the attackers among the contributors; an owner's lie of 1% of the
result's norm fails every time; the sign vectors are a deterministic function of the seed."""

from __future__ import annotations

import secrets

import torch

from swarmgrad.compression import decode, get_codec
from swarmgrad.node.trust.aggregate import Aggregator, aggregate
from swarmgrad.node.trust.checks import (
    PROJECTIONS,
    holds,
    part_seed,
    project,
    report_slack,
    signs,
)

FP16, INT8 = get_codec("fp16"), get_codec("int8")
TRIALS = 20


def _chunk(g: torch.Generator, n: int = 5, d: int = 8192) -> list[torch.Tensor]:
    common = torch.randn(d, generator=g)
    xs = [common + torch.randn(d, generator=g) for _ in range(n - 1)]
    xs.append(-3.0 * xs[0])  # one attacker, clipped
    return [decode(*INT8.encode(x)) for x in xs]  # what the owner decodes


def _check(
    xs: list[torch.Tensor], aggregator: Aggregator, lie: float, g: torch.Generator
) -> tuple[bool, float]:
    outcome = aggregate(torch.stack(xs), aggregator)
    value = outcome.value.clone()
    if lie:
        shift = torch.randn(value.shape, generator=g)
        value += shift * (lie * float(value.norm()) / float(shift.norm()))
    result = decode(*FP16.encode(value))  # what members receive
    vectors = signs(
        part_seed(secrets.token_bytes(32), {0: secrets.token_bytes(32)}), 0, result.numel()
    )
    reports = [project(xs[i], outcome.clip[i], vectors) for i in outcome.used]
    return holds(result, [outcome.clip[i] for i in outcome.used], reports, vectors)


def test_honest_results_pass_and_lies_of_one_percent_fail() -> None:
    g = torch.Generator().manual_seed(3)
    for aggregator in (Aggregator.CENTERED_CLIP, Aggregator.MEAN):
        ratios, caught = [], 0
        for _ in range(TRIALS):
            xs = _chunk(g)
            ok, ratio = _check(xs, aggregator, 0.0, g)
            assert ok, (aggregator, ratio)
            ratios.append(ratio)
            caught += not _check(xs, aggregator, 0.01, g)[0]
        assert max(ratios) < 0.5, (aggregator, max(ratios))  # measured: <= 0.22
        assert caught == TRIALS, (aggregator, caught)


def _bits(sign_bytes: torch.Tensor) -> torch.Tensor:
    """The sign vectors' bits spelled out, one row per vector (the reference for ``project``)."""
    return (sign_bytes.long().unsqueeze(0) >> torch.arange(PROJECTIONS).unsqueeze(1)) & 1


def test_sign_vectors_follow_the_seed_and_the_chunk() -> None:
    seed = part_seed(b"account", {0: b"a" * 32, 1: b"b" * 32})
    a = signs(seed, 0, 1000)
    assert a.shape == (1000,)
    assert a.dtype == torch.uint8
    assert torch.equal(a, signs(seed, 0, 1000))
    assert not torch.equal(a, signs(seed, 1, 1000))
    assert part_seed(b"account", {0: b"a" * 32, 1: b"c" * 32}) != seed
    # Which members' secrets are in is part of the seed (a silent member is left out of it).
    assert part_seed(b"account", {0: b"a" * 32, 2: b"b" * 32}) != seed
    assert part_seed(b"account", {0: b"a" * 32}) != seed
    # Each of the 8 sign vectors (a bit of every byte) is balanced: about half of it is +1.
    bits = _bits(a)
    assert all(abs(float(share) - 0.5) < 0.06 for share in bits.double().mean(1)), bits.mean(1)


def test_a_report_is_the_projection_on_the_sign_vectors() -> None:
    """The one-pass report equals the dot products with the explicit +-1 vectors."""
    g = torch.Generator().manual_seed(7)
    d, clip = 5000, 0.6
    values = torch.randn(d, generator=g)
    a = signs(bytes(32), 3, d)
    vectors = _bits(a) * 2 - 1
    expected = (clip * (vectors.double() @ values.double())).tolist()
    got = project(values, clip, a)
    assert len(got) == PROJECTIONS
    assert all(abs(x - y) <= 1e-9 * (1 + abs(y)) for x, y in zip(got, expected, strict=True))


def test_a_report_recomputed_elsewhere_agrees_within_its_slack_and_a_cover_does_not() -> None:
    """A false report is proven by recomputing it, maybe on another machine whose fp32 sums run
    in another order: an honest report must stay within the slack, a colluder's cover of a 1%
    lie far outside it."""
    g = torch.Generator().manual_seed(5)
    d, clip = 16384, 0.8
    values, result = torch.randn(d, generator=g), 0.5 * torch.randn(d, generator=g)
    vectors = signs(bytes(32), 0, d)
    mine = project(values, clip, vectors)
    slack = report_slack(values, clip)
    for trial in range(5):
        order = torch.randperm(d, generator=g)
        theirs = project(values[order], clip, vectors[order])
        assert all(abs(a - b) <= slack / 10 for a, b in zip(mine, theirs, strict=True)), trial
    shift = torch.full((d,), 0.01 * float(result.norm()) / d**0.5)  # a 1% lie of the owner
    cover = project(shift, 4 * clip, vectors)  # what 4 contributors lose to it
    assert max(abs(x) for x in cover) > 5 * slack  # the check fails on any of the 8
