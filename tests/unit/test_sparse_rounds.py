"""Trusted rounds with the ``sparse`` codec, in memory (``transport/memory.py``): each part's
owner merges its members' sparse values and returns one sparse part, so every member applies the
same bits and a member's download stays near one payload of its vector, whatever the group's
size (an all-gather of everyone's payloads would grow with it)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmgrad.compression import get_codec
from swarmgrad.node.averaging.allreduce import AllReduceConfig, RoundResult
from tests.helpers import averagers, group_of

VALUES = 1 << 16


async def _round(n: int) -> tuple[list[RoundResult], list[int]]:
    config = AllReduceConfig(
        run_id="sparse",
        spec_hash=bytes(32),
        codec="sparse",
        chunk_values=VALUES // 4,
        sender_timeout_seconds=5.0,
        reducer_timeout_seconds=10.0,
        round_timeout_seconds=20.0,
    )
    async with averagers(n, config, name="sparse") as peers:
        group = group_of(peers, 0)
        g = torch.Generator().manual_seed(n)
        updates = [torch.randn(VALUES, generator=g) for _ in peers]
        results = await asyncio.gather(
            *(p.all_reduce(u, group) for p, u in zip(peers, updates, strict=True))
        )
        # What each member downloaded: as a member (the owners' results) and as an owner (the
        # other members' values of its part).
        received = [p.traffic["received"] for p in peers]
    assert all(isinstance(r, RoundResult) for r in results)
    return list(results), received


@pytest.mark.parametrize("n", [4, 8, 16])
async def test_members_apply_identical_sparse_results_and_download_about_one_payload(
    n: int,
) -> None:
    results, received = await _round(n)
    assert all(r.complete for r in results)
    assert all(torch.equal(results[0].averaged, r.averaged) for r in results[1:])
    # One sparse result: each part's owner sparsified its mean again (1 value in 64 kept).
    assert int((results[0].averaged != 0).sum()) == VALUES // 64
    payload = len(get_codec("sparse").encode(torch.randn(VALUES))[0])
    # Results (one sparse part from each owner) plus, as an owner, the others' values of its
    # own part: two payloads at most, at every group size.
    assert max(received) <= 2 * payload * 1.1, (max(received), payload)


async def _held(rounds: int, *, owner_feedback: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Four members send the same update every round, each with its own error feedback (as a
    replica does). Returns what the rounds applied plus what the residuals still hold (the
    members' mean, the owners' sum), and the sum of the mean updates."""
    config = AllReduceConfig(run_id="sparse", spec_hash=bytes(32), codec="sparse",
                             chunk_values=VALUES // 4)  # fmt: skip
    g = torch.Generator().manual_seed(7)
    updates = [torch.randn(VALUES, generator=g) for _ in range(4)]
    members = [torch.zeros(VALUES) for _ in updates]
    owners = [torch.zeros(VALUES) for _ in updates]
    applied = torch.zeros(VALUES)
    async with averagers(4, config, name="sparse-feedback") as peers:
        for r in range(rounds):
            group = group_of(peers, r)
            compensated = [u + m for u, m in zip(updates, members, strict=True)]
            before = [o.clone() for o in owners]
            results = await asyncio.gather(
                *(
                    p.all_reduce(
                        c, group, keep_sent=True, owner_residual=o if owner_feedback else None
                    )
                    for p, c, o in zip(peers, compensated, owners, strict=True)
                )
            )
            assert all(torch.equal(results[0].averaged, x.averaged) for x in results[1:])
            # The round only read the owners' feedback (one that aborts changes nothing).
            assert all(torch.equal(o, b) for o, b in zip(owners, before, strict=True))
            for member, owner, c, result in zip(members, owners, compensated, results, strict=True):
                assert result.sent is not None
                torch.sub(c, result.sent, out=member)
                if owner_feedback:  # the round only read it: it returns the part's moved on
                    assert result.owner_residual is not None
                    start, moved = result.owner_residual
                    owner[start : start + moved.numel()] = moved
            applied += results[0].averaged
    held = applied + torch.stack(members).mean(0) + torch.stack(owners).sum(0)
    return held, torch.stack(updates).mean(0) * rounds


async def test_owners_feedback_keeps_what_their_sparse_results_dropped() -> None:
    # An owner's result keeps 1 value in 64 of its merged members' values, though each member's
    # feedback counts all it sent as delivered. With the owner's feedback, every value the
    # members meant is applied or still held by a residual (delivered later); without it, the
    # rest is lost for good.
    held, meant = await _held(4, owner_feedback=True)
    assert float((held - meant).norm() / meant.norm()) < 1e-5
    held, meant = await _held(4, owner_feedback=False)
    assert float((held - meant).norm() / meant.norm()) > 0.3
