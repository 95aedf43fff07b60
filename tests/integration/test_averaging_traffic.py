"""What an averaging round sends, on real grpc.aio servers (127.0.0.1:0): a member's error
feedback carries exactly what its owner did not receive, and an owner's results go through its
upload cap."""

from __future__ import annotations

import asyncio
import time

import torch

from swarmgrad.compression import decode, get_codec
from swarmgrad.node.averaging.averager import Averager, standalone
from tests.integration.averaging_streams import (
    CHUNK,
    CONFIG,
    check_honest,
    group_of,
    honest_round,
    ident,
)
from tests.integration.averaging_streams import pair as pair  # a fixture; "as" marks it used


async def test_error_feedback_carries_exactly_what_the_owner_did_not_receive(
    pair: tuple[Averager, Averager],
) -> None:
    """A member encodes each chunk once; what it reports as sent is what its owner decodes
    (the same bytes through the same decoder), its own part exact. Fed back round after round,
    nothing is lost: what went out plus one residual is what came in."""
    owner, honest = pair
    codec = get_codec(CONFIG.codec)
    size = 3 * CHUNK + 100
    residual, inputs, sent_total = torch.zeros(size), torch.zeros(size), torch.zeros(size)
    generator = torch.Generator().manual_seed(5)
    for round_ in range(5):
        group = group_of(round_, owner, honest, [])
        mine, theirs = (
            torch.randn(size, generator=generator),
            torch.randn(size, generator=generator),
        )
        compensated = theirs + residual
        own, member = await asyncio.gather(
            owner.all_reduce(mine, group, keep_sent=True),
            honest.all_reduce(compensated, group, keep_sent=True),
        )
        assert own.sent is not None
        assert member.sent is not None
        assert torch.equal(own.sent, mine)  # the owner's part is reduced from its exact values
        for start in range(0, size, CHUNK):  # the honest member owns nothing: every chunk goes
            piece = compensated[start : start + CHUNK]
            assert torch.equal(member.sent[start : start + CHUNK], decode(*codec.encode(piece)))
        assert not torch.equal(member.sent, compensated)  # int8 loses something
        residual = compensated - member.sent
        inputs += theirs
        sent_total += member.sent
    assert torch.allclose(sent_total + residual, inputs, atol=1e-4)
    assert (sent_total - inputs).norm() < 2 * residual.norm() + 1e-6


async def test_an_owners_results_go_through_its_upload_cap() -> None:
    # The owner owns the whole vector, so every byte it uploads is a result: with its link
    # capped, the round cannot end before those bytes could have gone up the link.
    rate = 20_000.0  # bytes per second: the results (~3 x 4 KiB x int8) take ~0.6 s
    async with (
        standalone(ident("owner"), CONFIG, upload_bytes_per_second=rate) as owner,
        standalone(ident("honest"), CONFIG) as honest,
    ):
        group = group_of(7, owner, honest, [])
        started = time.monotonic()
        results = await honest_round(owner, honest, group, (5, 6))
        elapsed = time.monotonic() - started
    check_honest(results, (5, 6))
    sent = owner.traffic["sent"]
    assert sent > 3 * CHUNK  # the results, one byte per value and the blocks' scales
    burst = 0.1 * rate  # what the bucket lets through at once
    assert elapsed >= (sent - burst) / rate
