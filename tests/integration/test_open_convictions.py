"""Open-run rounds on real gRPC over 127.0.0.1: a peer that lies where the check can prove it
(an owner's false result, two accounts of one part, a forged commitment; a member's false
reports or secret) is convicted in the round it acts, by every honest member, with evidence
anyone can check; nobody honest is banned and the round goes on without it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from swarmgrad.node.averaging.allreduce import RoundResult
from swarmgrad.node.averaging.averager import Averager
from swarmgrad.node.averaging.open import checks, evidence
from swarmgrad.node.averaging.open.accounts import CheckedPart
from swarmgrad.node.averaging.open.owner import OpenOwner
from swarmgrad.node.averaging.reducer import SenderSession
from swarmgrad.node.trust.ledger import Flag
from swarmgrad.protocol.averaging import ACCOUNT_STATEMENT, CHECK_STATEMENT, seal
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.simulations.attacks import LyingOwner, false_report
from tests.helpers import group_of
from tests.integration.open_rounds import OPEN, SIZE, average, honest_updates, swarm


def assert_proven(judges: list[Averager], accused: Averager, flag: Flag) -> bytes:
    """Every judge banned ``accused`` for ``flag`` with evidence that anyone can check (no
    group, no round state: only the run and spec), and that a changed byte breaks."""
    proofs = set()
    for judge in judges:
        ban = judge.ledger.bans[accused.peer_id]
        assert ban.flags == (flag,)
        assert ban.evidence
        assert not ban.source
        found = evidence.verify_bytes(ban.evidence, run_id=OPEN.run_id, spec_hash=OPEN.spec_hash)
        assert found == (accused.peer_id, flag, 0)
        proofs.add(ban.evidence)
    proof = min(proofs)
    with pytest.raises(evidence.EvidenceError, match="another run"):
        evidence.verify_bytes(proof, run_id="another-run", spec_hash=OPEN.spec_hash)
    item = averaging_pb2.Evidence.FromString(proof)
    forged = bytearray(item.accounts[0].body)
    forged[-1] ^= 1  # one bit of the owner's signed account
    item.accounts[0].body = bytes(forged)
    with pytest.raises(evidence.EvidenceError):
        evidence.verify(item, run_id=OPEN.run_id, spec_hash=OPEN.spec_hash)
    return proof


async def test_a_lying_owner_is_convicted_in_the_round_it_lies() -> None:
    async with swarm(5) as peers:
        honest, bad = peers[:4], peers[4]
        updates = honest_updates(0, 5)
        results = await average(peers, updates, 0, owner_hooks={4: LyingOwner()})
        bounds = group_of(peers, 0).partition(SIZE)
        for peer, result in zip(honest, results, strict=False):
            assert isinstance(result, RoundResult)
            assert peer.ledger.bans[bad.peer_id].flags == (Flag.LYING_OWNER,)
            # Its part is not applied: the member keeps its own values there ...
            assert result.missing == (bounds[4],)
            start, end = bounds[4]
            assert torch.equal(result.averaged[start:end], updates[peers.index(peer)][start:end])
            # ... and every other part passed.
            assert peer.checks["failed"] == 1
        assert not any(p.ledger.bans.keys() - {bad.peer_id} for p in peers)
        # Without it, the honest members go on as before.
        results = await average(honest, honest_updates(1, 4), 1)
        assert all(isinstance(r, RoundResult) and r.complete for r in results)
        assert all(p.checks["failed"] == 1 for p in honest)


async def test_a_member_that_frames_an_owner_with_false_reports_is_convicted_instead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with swarm(5) as peers:
        honest, framer = peers[:4], peers[4]
        honest_report, framing = checks.own_report, false_report(checks.own_report)

        def report(part: CheckedPart, me: int, *rest: Any) -> averaging_pb2.PartReport:
            return (framing if me == 4 else honest_report)(part, me, *rest)

        monkeypatch.setattr(checks, "own_report", report)
        results = await average(peers, honest_updates(0, 5), 0)
        for peer in honest:
            # Every owner showed the framer's signed chunks: the framer is banned, nobody else.
            assert set(peer.ledger.bans) == {framer.peer_id}
            assert peer.ledger.bans[framer.peer_id].flags == (Flag.FALSE_REPORT,)
            assert peer.checks["failed"] == 0
        assert all(isinstance(r, RoundResult) and r.complete for r in results[:4])


async def test_an_owner_that_signs_two_accounts_of_its_part_is_convicted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with swarm(5) as peers:
        honest, bad = peers[:4], peers[4]
        honest_account = SenderSession.account

        async def two_faced(self: SenderSession) -> averaging_pb2.Signed | None:
            signed = await honest_account(self)
            reducer = self._reducer
            if signed is None or reducer.group.members[reducer.part].peer_id != bad.peer_id:
                return signed
            if self._member % 2:  # odd members get another account: one clip nudged
                account = averaging_pb2.PartAccount.FromString(signed.body)
                account.chunks[0].clip[0] *= 0.999
                return seal(bad.identity, ACCOUNT_STATEMENT, account)
            return signed

        monkeypatch.setattr(SenderSession, "account", two_faced)
        results = await average(peers, honest_updates(0, 5), 0)
        bounds = group_of(peers, 0).partition(SIZE)
        for peer, result in zip(honest, results, strict=False):
            assert isinstance(result, RoundResult)
            assert peer.ledger.bans[bad.peer_id].flags == (Flag.EQUIVOCATION,)
            assert result.missing == (bounds[4],)  # its part is dropped by everyone
        assert not any(p.ledger.bans.keys() - {bad.peer_id} for p in peers)
        proof = averaging_pb2.Evidence.FromString(assert_proven(honest, bad, Flag.EQUIVOCATION))
        # The same account twice, or two accounts of different rounds, prove nothing.
        same = evidence.equivocation(proof.accounts[0], proof.accounts[0])
        with pytest.raises(evidence.EvidenceError, match="the same"):
            evidence.verify(same, run_id=OPEN.run_id, spec_hash=OPEN.spec_hash)
        later = averaging_pb2.PartAccount.FromString(proof.accounts[1].body)
        later.key.round += 1
        other = evidence.equivocation(
            proof.accounts[0], seal(bad.identity, ACCOUNT_STATEMENT, later)
        )
        with pytest.raises(evidence.EvidenceError, match="not one owner's"):
            evidence.verify(other, run_id=OPEN.run_id, spec_hash=OPEN.spec_hash)


async def test_an_owner_that_forges_a_members_commitment_is_convicted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An owner that lists a commitment a member never made (so that the member's secret looks
    false and the part goes unchecked) is caught by the member's header signature it must show."""
    async with swarm(5) as peers:
        honest, bad = peers[:4], peers[4]
        honest_sign = OpenOwner.account

        def forge(self: OpenOwner) -> averaging_pb2.Signed | None:
            if self.group.members[self.part].peer_id == bad.peer_id:
                first = next(iter(self.commitments))
                self.commitments[first] = (bytes(32), self.commitments[first][1])
            return honest_sign(self)

        monkeypatch.setattr(OpenOwner, "account", forge)
        results = await average(peers, honest_updates(0, 5), 0)
        bounds = group_of(peers, 0).partition(SIZE)
        for peer, result in zip(honest, results, strict=False):
            assert isinstance(result, RoundResult)
            assert peer.ledger.bans[bad.peer_id].flags == (Flag.FORGERY,)
            assert result.missing == (bounds[4],)
        assert not any(p.ledger.bans.keys() - {bad.peer_id} for p in peers)
        proof = averaging_pb2.Evidence.FromString(assert_proven(honest, bad, Flag.FORGERY))
        # Pointing at a member whose commitment is genuine, or at another group, proves nothing.
        account = averaging_pb2.PartAccount.FromString(proof.accounts[0].body)
        genuine = averaging_pb2.Evidence()
        genuine.CopyFrom(proof)
        genuine.member = next(m for m in account.members if m != proof.member)
        with pytest.raises(evidence.EvidenceError, match="did sign"):
            evidence.verify(genuine, run_id=OPEN.run_id, spec_hash=OPEN.spec_hash)
        del genuine.members[-1]
        with pytest.raises(evidence.EvidenceError, match="not the round's group"):
            evidence.verify(genuine, run_id=OPEN.run_id, spec_hash=OPEN.spec_hash)


async def test_a_member_that_reveals_another_secret_than_it_committed_to_is_convicted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with swarm(5) as peers:
        honest, liar = peers[:4], peers[4]
        honest_broadcast = checks._broadcast

        async def broadcast(run: checks.CheckRun, statement: averaging_pb2.CheckStatement) -> None:
            if run.signer.peer_id == liar.peer_id and statement.WhichOneof("body") == "reveal":
                statement.reveal.secret = bytes(32)  # not the secret it committed to
            await honest_broadcast(run, statement)

        monkeypatch.setattr(checks, "_broadcast", broadcast)
        results = await average(peers, honest_updates(0, 5), 0)
        proof = averaging_pb2.Evidence.FromString(assert_proven(honest, liar, Flag.FALSE_REPORT))
        # The evidence convicts the member who signed the reveal, nobody else.
        assert proof.reason == "false_secret"
        framed = averaging_pb2.CheckStatement.FromString(proof.reveal.body)
        framed.sender = honest[0].peer_id
        proof.reveal.CopyFrom(seal(honest[0].identity, CHECK_STATEMENT, framed))
        with pytest.raises(evidence.EvidenceError, match="not the member's"):
            evidence.verify(proof, run_id=OPEN.run_id, spec_hash=OPEN.spec_hash)
        # Parts it contributed to went unchecked this round, not dropped: nothing is lost.
        assert all(isinstance(r, RoundResult) and r.complete for r in results[:4])
        assert not any(p.ledger.bans.keys() - {liar.peer_id} for p in peers)
