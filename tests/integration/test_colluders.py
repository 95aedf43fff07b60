"""Open runs on real gRPC over 127.0.0.1: statistics bans that attackers cannot turn against
honest members. Two colluders in a group of 4 are most of an honest owner's other members: they
must not make the honest members ban each other. In a group of 8, noise attackers are banned by
every honest member in the same round, not by one of them."""

from __future__ import annotations

import torch

from swarmgrad.node.averaging.allreduce import RoundResult
from swarmgrad.node.trust.ledger import Flag
from swarmgrad.simulations.attacks import Attack, Attacker
from tests.helpers import group_of
from tests.integration.open_rounds import SIZE, average, honest_updates, rel, swarm

ROUNDS = 6


def colluded(updates: list[torch.Tensor], honest: int, round_: int) -> list[torch.Tensor]:
    """What a colluding pair sends: the honest members' mean plus one direction they share
    (drawn from the round: they need no channel), twice an honest member's spread, each with
    a little noise of its own (identical values would be flagged as duplicates)."""
    mean = torch.stack(updates[:honest]).mean(0)
    g = torch.Generator().manual_seed(10_000 + round_)
    direction = torch.randn(mean.shape, generator=g)
    spread = float((updates[0] - mean).norm())
    shared = mean + direction * (2.0 * spread / float(direction.norm()))
    return [shared + 0.01 * spread * torch.randn(mean.shape, generator=g) / mean.numel() ** 0.5
            for _ in range(2)]  # fmt: skip


async def test_a_colluding_pair_in_a_group_of_four_gets_no_honest_member_banned() -> None:
    async with swarm(4) as peers:
        honest = peers[:2]
        for round_ in range(ROUNDS):
            updates = honest_updates(round_, 4)
            updates[2], updates[3] = colluded(updates, 2, round_)
            results = await average(peers, updates, round_)
            assert all(isinstance(r, RoundResult) for r in results), results
        for peer in honest:
            assert not peer.ledger.bans, peer.ledger.bans
            flags = peer.ledger.table()[honest[1 - honest.index(peer)].peer_id]["flags"]
            assert not flags, flags  # three others are too few to judge by


async def test_noise_attackers_in_a_group_of_eight_are_banned_by_every_honest_member_at_once() -> (
    None
):
    async with swarm(8) as peers:
        honest, bad = peers[:6], peers[6:]
        # Seeds far from the rounds' own (honest_updates draws round r's direction from seed r).
        attackers = [Attacker(Attack.NOISE, seed=s) for s in (1001, 1002)]
        banned_at: dict[str, dict[str, int]] = {p.peer_id: {} for p in honest}
        members = peers
        for round_ in range(4):
            updates = honest_updates(round_, len(members))
            for k, attacker in enumerate(attackers):
                if len(members) > 6:
                    updates[6 + k] = attacker.update(updates[6 + k])
            await average(members, updates, round_)
            for peer in honest:
                for b in bad:
                    if peer.ledger.banned(b.peer_id):
                        banned_at[peer.peer_id].setdefault(b.peer_id, round_)
            if all(len(found) == 2 for found in banned_at.values()):
                members = honest  # every honest member has banned both: they group alone
        rounds = {r for found in banned_at.values() for r in found.values()}
        assert rounds == {2}, banned_at  # together, in the third round they saw them
        for peer in honest:
            assert set(peer.ledger.bans) == {b.peer_id for b in bad}
            assert all(ban.flags == (Flag.MISALIGNED,) or Flag.CLIPPED in ban.flags
                       for ban in peer.ledger.bans.values())  # fmt: skip


async def test_x100_attackers_most_of_a_small_group_are_left_out_by_the_owners_own_measure() -> (
    None
):
    """Two x100 members in a group of 4 are most of an honest owner's others, so the statistics
    among them say nothing; the owner's own values (kept out of its part) still measure their
    size. Every honest owner leaves both out of its part from the first round (the part is the
    other honest member's values), flags them (``outsized``) and bans them in the third round,
    as for the other statistical flags, without flagging the other honest member."""
    async with swarm(4) as peers:
        honest, bad = peers[:2], peers[2:]
        attackers = [Attacker(Attack.SCALE, seed=s) for s in (1001, 1002)]
        bounds = group_of(peers, 0).partition(SIZE)
        for round_ in range(3):
            updates = honest_updates(round_, 4)
            for k, attacker in enumerate(attackers):
                updates[2 + k] = attacker.update(updates[2 + k])
            results = await average(peers, updates, round_)
            for owner in (0, 1):  # an honest owner's part: the other honest member's values
                start, end = bounds[owner]
                other = updates[1 - owner][start:end]
                for result in results[:2]:
                    assert isinstance(result, RoundResult), result
                    assert rel(result.averaged[start:end], other) < 0.02, (round_, owner)
            banned = [set(p.ledger.bans) for p in honest]
            assert banned == [set() if round_ < 2 else {b.peer_id for b in bad}] * 2, round_
        for peer in honest:
            assert all(ban.flags == (Flag.OUTSIZED,) for ban in peer.ledger.bans.values())
            other_id = honest[1 - honest.index(peer)].peer_id
            assert not peer.ledger.table()[other_id]["flags"]
