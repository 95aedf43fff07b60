"""The trimmed mean, an aggregation rule added as a component (``node/trust/aggregate.py`` and
the spec's list of rules, nothing else): its arithmetic, and open rounds of 6 members run with
it on the in-memory transport, without sockets."""

from __future__ import annotations

import asyncio

import torch

from swarmgrad.node.averaging.allreduce import AllReduceConfig, RoundResult
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.trust.aggregate import Aggregator, aggregate, trimmed_mean
from tests.helpers import averagers, group_of, until


def test_each_coordinate_drops_its_extremes_and_a_member_is_scored_by_what_was_kept() -> None:
    g = torch.Generator().manual_seed(1)
    honest = torch.randn(3000, generator=g) + 0.5 * torch.randn(5, 3000, generator=g)
    wild = 1e3 * torch.randn(1, 3000, generator=g)
    stack = torch.cat([honest, wild])  # 6 members: one dropped at each end of every coordinate
    value, kept = trimmed_mean(stack)
    expected = stack.sort(dim=0).values[1:5].mean(0)
    assert torch.allclose(value, expected)
    assert kept[5] < 0.01  # the wild member is at an end of nearly every coordinate
    assert all(0.5 < share < 1.0 for share in kept[:5])
    assert abs(sum(kept) - 4.0) < 1e-9  # four of six values kept at each coordinate
    assert float((value - honest.mean(0)).abs().max()) < 2.0  # the wild rows moved nothing far
    # Fewer than five members: nothing is trimmed, it is the mean.
    small, shares = trimmed_mean(stack[:4])
    assert torch.allclose(small, stack[:4].mean(0))
    assert shares == [1.0] * 4
    # Through aggregate(): the rule by name, its results unchecked by the members' projections.
    outcome = aggregate(stack, Aggregator("trimmed_mean"))
    assert torch.allclose(outcome.value, expected)
    assert not Aggregator.TRIMMED_MEAN.checkable
    assert outcome.cosine[5] < 0.1 < min(outcome.cosine[:5])


def test_the_spec_takes_it() -> None:
    spec = RunSpec.from_toml(
        '[run]\nid = "x"\n[trust]\nmode = "open"\naggregator = "trimmed_mean"\n'
    )
    assert spec.trust.effective_aggregator == "trimmed_mean"


async def test_open_rounds_with_it_average_and_pass_their_audits_in_memory() -> None:
    config = AllReduceConfig(
        run_id="trimmed",
        spec_hash=bytes(32),
        codec="int8",
        chunk_values=4096,
        aggregator="trimmed_mean",
        uniform_weights=True,
        result_codec="fp16",
        observe=True,
        audit_probability=1.0,
        sender_timeout_seconds=5.0,
        reducer_timeout_seconds=10.0,
        round_timeout_seconds=20.0,
    )
    async with averagers(6, config, name="trimmed") as peers:
        group = group_of(peers, 0)
        g = torch.Generator().manual_seed(0)
        common = torch.randn(6 * 8192, generator=g)
        updates = [common + 0.5 * torch.randn(common.shape, generator=g) for _ in peers]
        results = await asyncio.gather(
            *(p.all_reduce(u, group) for p, u in zip(peers, updates, strict=True))
        )
        assert all(isinstance(r, RoundResult) and r.complete for r in results)
        assert all(torch.equal(results[0].averaged, r.averaged) for r in results[1:])
        assert float((results[0].averaged - common).norm() / common.norm()) < 0.3

        async def audited() -> bool:  # each member audits one other owner's part
            return sum(p.checks["audit_passed"] + p.checks["audit_failed"] for p in peers) >= 6

        await until(audited, timeout_seconds=30, what="every member's audit")
        assert all(p.checks["audit_failed"] == 0 for p in peers)
        assert all(p.ledger.bans == {} for p in peers)
