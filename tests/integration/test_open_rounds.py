"""Open-run rounds on real gRPC over 127.0.0.1: owners aggregate robustly, score members (and
spot-check their values) and ban attackers; honest members are never banned and keep averaging
(fast tier: 5 members, 1 attacker, 8 rounds)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from swarmgrad.node.averaging.allreduce import RoundResult
from swarmgrad.node.averaging.reducer import PartReducer
from swarmgrad.node.trust.ledger import Flag
from swarmgrad.simulations.attacks import Attack, Attacker, NaNPayloads
from tests.helpers import group_of, until
from tests.integration.open_rounds import (
    OPEN,
    SIZE,
    audited,
    average,
    honest_updates,
    open_mean,
    rel,
    swarm,
)

ROUNDS = 8


async def test_honest_members_are_never_flagged_and_their_replicas_agree() -> None:
    # Six: each owner's part has five other members, enough for their statistics to count.
    async with swarm(6, replace(OPEN, audit_probability=1.0)) as peers:  # audits every round
        for round_ in range(ROUNDS):
            updates = honest_updates(round_, 6)
            results = await average(peers, updates, round_)
            assert all(isinstance(r, RoundResult) and r.complete for r in results), results
            averaged = [r.averaged for r in results if isinstance(r, RoundResult)]
            assert all(torch.equal(averaged[0], a) for a in averaged[1:])
            # With honest members CenteredClip is the mean, up to the codecs.
            assert rel(averaged[0], open_mean(peers, updates)) < 0.02
        for peer in peers:
            assert peer.ledger.bans == {}
            assert all(count == 0 for count in peer.ledger.flag_counts.values())
            table = peer.ledger.table()
            assert len(table) == 5
            assert all(row["rounds"] == ROUNDS for row in table.values())
            assert all(float(row["cosine_ema"]) > 0.5 for row in table.values())  # type: ignore[arg-type]
        # Every member checked every part of every round, and none failed; each audited one
        # other owner's part every round, and every audit passed.
        await audited(peers, ROUNDS)
        for peer in peers:
            assert peer.checks == {"checked": 6 * ROUNDS, "failed": 0, "audit_passed": ROUNDS}
            assert peer.ledger.bans == {}


#: The round by which every honest member has banned the attacker.
BANNED_BY = {
    Attack.ZEROS: 0,
    Attack.NAN: 0,
    Attack.SCALE: 2,
    Attack.SIGN_FLIP: 2,
    Attack.NOISE: 2,
    Attack.REPLAY: 3,  # round 0 is its honest update; it replays from round 1
}


@pytest.mark.parametrize("attack", list(BANNED_BY))  # owner attacks: the tests below
async def test_an_attacker_is_banned_in_time_by_every_honest_member(attack: Attack) -> None:
    attacker = Attacker(attack, seed=7)
    # Five others per part: enough to judge by. Every member audits every round, the attacker
    # too: an owner that refused its stream must not be convicted by the part it never sent.
    async with swarm(6, replace(OPEN, audit_probability=1.0)) as peers:
        honest, bad = peers[:5], peers[5]
        banned_at: int | None = None
        for round_ in range(ROUNDS):
            updates = honest_updates(round_, 6)
            members = peers if banned_at is None else honest
            if banned_at is None and attack is not Attack.NAN:  # NaN: its bytes are poisoned
                updates[5] = attacker.update(updates[5], updates[:5])
            vectors = updates[: len(members)]
            hooks = {5: NaNPayloads()} if attack is Attack.NAN else None
            results = await average(members, vectors, round_, hooks)
            bans = [set(p.ledger.bans) for p in honest]
            if banned_at is None and any(bans):
                banned_at = round_
                # Every honest owner saw the attacker on its own part: they agree at once.
                assert all(b == {bad.peer_id} for b in bans), bans
            if banned_at is not None:
                assert all(b == {bad.peer_id} for b in bans)
                honest_results = [r for r in results[:5] if isinstance(r, RoundResult)]
                assert len(honest_results) == 5
                if round_ > banned_at:
                    # Without the attacker the honest members average as if it never existed.
                    mean = open_mean(honest, updates[:5])
                    assert rel(honest_results[0].averaged, mean) < 0.02
        assert banned_at is not None, attack
        assert banned_at <= BANNED_BY[attack], (attack, banned_at)
        for peer in peers:  # the attacker's own (honest-code) owner bans nobody honest either
            assert set(peer.ledger.bans) <= {bad.peer_id}
        reasons = {p.ledger.bans[bad.peer_id].flags for p in honest}
        assert len(reasons) == 1
        if attack is Attack.ZEROS:
            assert reasons == {(Flag.ZERO,)}
        if attack is Attack.NAN:
            assert reasons == {(Flag.NON_FINITE,)}
        if attack is Attack.REPLAY:
            assert all(Flag.REPLAY in flags for flags in reasons)


async def test_a_banned_peer_is_refused_with_banned() -> None:
    async with swarm(5) as peers:
        attacker = Attacker(Attack.ZEROS)
        updates = honest_updates(0, 5)
        updates[4] = attacker.update(updates[4])
        await average(peers, updates, 0)
        assert all(p.ledger.banned(peers[4].peer_id) for p in peers[:4])
        # A peer that still groups with it (it has not banned it) cannot get it averaged.
        results = await average(peers, honest_updates(1, 5), 1)
        mine = results[4]
        assert isinstance(mine, RoundResult)
        # Nothing of the honest owners' parts reached it: only its own part was averaged.
        assert sum(end - start for start, end in mine.missing) == SIZE - SIZE // 5
        assert set(mine.failures) == {p.peer_id for p in peers[:4]}
        # Each refused it with BANNED (its client may read a refusal mid-send as INTERNAL).
        assert all(p.servicer.rejections.snapshot().get(("Averaging", "BANNED")) for p in peers[:4])


async def test_a_member_left_out_by_an_owner_disputes_it_and_bans_nobody(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with swarm(5) as peers:
        liar, victim = peers[4].peer_id, peers[0].peer_id
        honest_aggregate = PartReducer._aggregate

        def leave_out(self: PartReducer, index: int) -> tuple[torch.Tensor, list[int]]:
            if self.group.members[self.part].peer_id == liar:
                self._inputs[index].pop(self.group.index(victim), None)
            return honest_aggregate(self, index)

        monkeypatch.setattr(PartReducer, "_aggregate", leave_out)
        for round_ in range(3):
            results = await average(peers, honest_updates(round_, 5), round_)
            mine = results[0]
            assert isinstance(mine, RoundResult)
            assert mine.excluded_by == (liar,)
            assert all(isinstance(r, RoundResult) and not r.excluded_by for r in results[1:])
        table = peers[0].ledger.table()
        assert table[liar]["disputes"] == 3
        # Unprovable: a dispute never bans, here or anywhere.
        assert all(p.ledger.bans == {} for p in peers)


class RecordingProbe:
    """A loss probe that notes what it was given and scores by the values' sum."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, torch.Tensor]] = []
        self.snapshots = 0

    def snapshot(self) -> Callable[[str, int, int, torch.Tensor], float]:
        self.snapshots += 1

        def measure(peer_id: str, round_: int, start: int, values: torch.Tensor) -> float:
            self.calls.append((peer_id, round_, start, values.clone()))
            return float(values.sum())

        return measure


async def test_owners_spot_check_members_values_of_their_part_each_round() -> None:
    async with swarm(4, replace(OPEN, spot_checks=2)) as peers:
        probes = [RecordingProbe() for _ in peers]
        for peer, probe in zip(peers, probes, strict=True):
            peer.loss_probe = probe
        rounds = 3
        for round_ in range(rounds):
            updates = honest_updates(round_, 4)
            results = await average(peers, updates, round_)
            assert all(isinstance(r, RoundResult) and r.complete for r in results)
            bounds = group_of(peers, round_).partition(SIZE)

            async def probed(n: int = 2 * (round_ + 1)) -> bool:  # they run off the round
                return all(len(p.calls) >= n for p in probes)

            await until(probed, timeout_seconds=10, what="the spot checks", interval_seconds=0.05)
            for owner, probe in enumerate(probes):
                start, end = bounds[owner]
                this_round = [c for c in probe.calls if c[1] == round_]
                assert len(this_round) == 2  # two members of its part, itself never
                assert len({c[0] for c in this_round}) == 2
                for peer_id, _, at, values in this_round:
                    member = next(i for i, p in enumerate(peers) if p.peer_id == peer_id)
                    assert member != owner
                    assert at == start
                    # The member's values of the part, as the owner decoded them (int8).
                    assert rel(values, updates[member][start:end]) < 0.02
        for peer, probe in zip(peers, probes, strict=True):
            assert probe.snapshots == rounds  # one capture of the parameters per round
            table = peer.ledger.table()
            assert sum(int(row["spot_checks"]) for row in table.values()) == 2 * rounds  # type: ignore[call-overload]
            assert all(
                row["loss_gain_ema"] is not None for row in table.values() if row["spot_checks"]
            )


async def test_a_loss_probe_that_does_not_fit_the_round_costs_nothing_but_its_score(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Misfit:
        def snapshot(self) -> Callable[[str, int, int, torch.Tensor], float]:
            raise ValueError("parameters of 3 values, the model has 5")

    async with swarm(3, replace(OPEN, spot_checks=1)) as peers:
        peers[0].loss_probe = Misfit()
        results = await average(peers, honest_updates(0, 3), 0)
        assert all(isinstance(r, RoundResult) and r.complete for r in results)
        assert "no spot check: parameters of 3 values" in caplog.text
        assert all(row["spot_checks"] == 0 for row in peers[0].ledger.table().values())
