"""Open-run rounds on real gRPC over 127.0.0.1: owners aggregate robustly, score members and ban
attackers; honest members are never banned and keep averaging (fast tier: 5 members, 1 attacker,
8 rounds)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import grpc
import pytest
import torch

from swarmgrad.node.averaging.allreduce import AllReduceConfig, RoundResult
from swarmgrad.node.averaging.averager import Averager
from swarmgrad.node.averaging.group import Group, Member, chunk_sizes
from swarmgrad.node.averaging.hooks import OwnerHooks
from swarmgrad.node.averaging.open import audits, checks, evidence, reports
from swarmgrad.node.averaging.open.accounts import CheckedPart
from swarmgrad.node.averaging.open.owner import OpenOwner
from swarmgrad.node.averaging.plan import round_key
from swarmgrad.node.averaging.reducer import PartReducer, SenderSession
from swarmgrad.node.identity import Identity
from swarmgrad.node.trust.checks import project, signs
from swarmgrad.node.trust.ledger import Flag
from swarmgrad.protocol.auth import sign_statement
from swarmgrad.protocol.averaging import ACCOUNT_STATEMENT, CHECK_STATEMENT, check_method, seal
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.simulations.attacks import (
    Attack,
    Attacker,
    LyingOwner,
    NaNPayloads,
    false_report,
    lying_result,
)
from tests.helpers import averagers, group_of, until

CHUNK = 4096
SIZE = 5 * 2 * CHUNK  # two chunks per owner's part
ROUNDS = 8
OPEN = AllReduceConfig(
    run_id="open-rounds",
    spec_hash=bytes(32),
    codec="int8",
    chunk_values=CHUNK,
    round_timeout_seconds=20.0,
    sender_timeout_seconds=5.0,
    reducer_timeout_seconds=10.0,
    aggregator="centered_clip",
    uniform_weights=True,
    result_codec="fp16",
    observe=True,
    # In one process, a check step's messages arrive in milliseconds: the tests whose members
    # go silent wait out each step, 2.5 s instead of a real run's 5 (CHECK_TIMEOUT_SECONDS).
    check_timeout_seconds=2.5,
)


def swarm(
    n: int, config: AllReduceConfig = OPEN, *, sockets: bool = False
) -> contextlib.AbstractAsyncContextManager[list[Averager]]:
    """``n`` averagers of one open run (``tests/helpers.averagers``)."""
    return averagers(n, config, name="open-rounds", sockets=sockets)


async def audited(peers: list[Averager], count: int, *, seconds: float = 30.0) -> None:
    """Wait until each of ``peers`` finished ``count`` audits (they run after the round)."""

    async def done() -> bool:
        return all(sum(p.checks[f"audit_{r}"] for r in AUDIT_RESULTS) >= count for p in peers)

    await until(done, timeout_seconds=seconds, what=f"{count} audits by each member",
                interval_seconds=0.05)  # fmt: skip


AUDIT_RESULTS = ("passed", "failed", "inconclusive")


def honest_updates(round_: int, n: int) -> list[torch.Tensor]:
    """A shared direction plus each member's own noise of the same size (DiLoCo-like deltas)."""
    g = torch.Generator().manual_seed(round_)
    common = torch.randn(SIZE, generator=g)
    return [common + torch.randn(SIZE, generator=g) for _ in range(n)]


async def average(
    averagers: list[Averager],
    vectors: list[torch.Tensor],
    round_: int,
    hooks: dict[int, NaNPayloads] | None = None,
    owner_hooks: dict[int, OwnerHooks] | None = None,
) -> list[RoundResult | BaseException]:
    """One round of ``averagers`` in one group; ``hooks`` and ``owner_hooks`` by member index:
    the faults those members inject."""
    group = group_of(averagers, round_)
    calls = [
        a.all_reduce(v, group, hooks=(hooks or {}).get(i), owner_hooks=(owner_hooks or {}).get(i))
        for i, (a, v) in enumerate(zip(averagers, vectors, strict=True))
    ]
    return list(await asyncio.gather(*calls, return_exceptions=True))


class Lie:
    """Owner hooks of a lying owner: ``publish`` makes what it sends of each chunk's result."""

    def __init__(self, publish: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        self.publish = publish

    def result(self, index: int, value: torch.Tensor) -> torch.Tensor:
        return self.publish(index, value)


def open_mean(averagers: list[Averager], updates: list[torch.Tensor]) -> torch.Tensor:
    """What an honest open round returns: each part the mean of its members but its owner (an
    owner's own values stay out of its part)."""
    group = group_of(averagers, 0)
    out = torch.empty(SIZE)
    for owner, (start, end) in enumerate(group.partition(SIZE)):
        others = [u[start:end] for i, u in enumerate(updates) if i != owner]
        out[start:end] = torch.stack(others).mean(0)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


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


@pytest.mark.parametrize("projections_per_chunk", [1, 4])
async def test_a_check_report_of_the_wrong_shape_is_refused_and_the_round_goes_on(
    monkeypatch: pytest.MonkeyPatch, projections_per_chunk: int
) -> None:
    """Every honest member computes 8 projections a chunk; a report with another count is no
    report (refused at the door when it cannot fit any part), never rows of a length that breaks
    the honest members' sums."""
    async with swarm(5) as peers:
        honest, sender = peers[:4], peers[4]
        honest_report = checks.own_report

        def reshaped(part: CheckedPart, me: int, *rest: Any) -> averaging_pb2.PartReport:
            report = honest_report(part, me, *rest)
            if me == peers.index(sender) and report.projections:
                chunks = len(report.projections) // 8
                del report.projections[:]
                report.projections.extend([0.5] * projections_per_chunk * chunks)
            return report

        monkeypatch.setattr(checks, "own_report", reshaped)
        results = await average(peers, honest_updates(0, 5), 0)
        assert all(isinstance(r, RoundResult) for r in results[:4]), results
        assert not any(p.ledger.bans.keys() - {sender.peer_id} for p in honest)


async def test_check_messages_from_strangers_and_forgers_are_refused() -> None:
    async with swarm(3, sockets=True) as peers:  # strangers dial it over gRPC
        target = peers[0]
        group = group_of(peers, 0)
        await average(peers, honest_updates(0, 3)[:3], 0)
        mallory = Identity.from_seed("open-rounds/mallory")
        key = round_key(OPEN, group)
        reveal = averaging_pb2.Reveal(secret=bytes(32))

        def statement(sender: str, **fields: object) -> averaging_pb2.CheckStatement:
            return averaging_pb2.CheckStatement(key=key, sender=sender, reveal=reveal, **fields)  # type: ignore[arg-type]

        forged = seal(mallory, CHECK_STATEMENT, statement(peers[1].peer_id))
        tampered = seal(mallory, CHECK_STATEMENT, statement(mallory.peer_id))
        tampered.body += b"\x08\x01"
        other_run = statement(mallory.peer_id)
        other_run.key.run_id = "another-run"
        cases = {
            "forged": (forged, grpc.StatusCode.UNAUTHENTICATED),
            "tampered": (tampered, grpc.StatusCode.UNAUTHENTICATED),
            "garbage": (
                averaging_pb2.Signed(body=b"\xff" * 64, auth=forged.auth),
                grpc.StatusCode.UNAUTHENTICATED,
            ),
            "unparsable": (
                averaging_pb2.Signed(
                    body=b"\xff" * 8, auth=sign_statement(mallory, CHECK_STATEMENT, b"\xff" * 8)
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            "other run": (
                seal(mallory, CHECK_STATEMENT, other_run),
                grpc.StatusCode.FAILED_PRECONDITION,
            ),
            "oversized": (
                seal(
                    peers[1].identity,
                    CHECK_STATEMENT,
                    averaging_pb2.CheckStatement(
                        key=key,
                        sender=peers[1].peer_id,
                        reveal=averaging_pb2.Reveal(
                            secret=bytes(32), accounts=[averaging_pb2.Signed()] * 10
                        ),
                    ),
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            "stranger": (
                seal(mallory, CHECK_STATEMENT, statement(mallory.peer_id)),
                grpc.StatusCode.PERMISSION_DENIED,
            ),
        }
        async with grpc.aio.insecure_channel(target.endpoint) as channel:
            call = check_method(channel)
            for name, (signed, status) in cases.items():
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(signed, timeout=5)
                assert refused.value.code() == status, (name, refused.value)
        # The target keeps averaging, and checking, with its members.
        results = await average(peers, honest_updates(1, 3)[:3], 1)
        assert all(isinstance(r, RoundResult) and r.complete for r in results)
        assert target.checks["failed"] == 0


async def test_a_flood_of_check_messages_for_rounds_that_never_come_spares_honest_streams() -> None:
    """A stranger parks signed check messages for rounds that will never exist (any fresh key
    can): they fill only the check messages' waiting slots, so members' streams that reach an
    owner a little before it starts its round still wait for it, and the round completes."""
    async with swarm(3) as peers:
        owner = peers[2]
        mallory = Identity.from_seed("open-rounds/flooder")
        refusals = owner.servicer.rejections

        async def bogus(number: int) -> None:
            statement = averaging_pb2.CheckStatement(
                key=averaging_pb2.RoundKey(
                    run_id=OPEN.run_id,
                    spec_hash=OPEN.spec_hash,
                    round=10**9 + number,
                    group_id=number.to_bytes(16, "big"),
                ),
                sender=mallory.peer_id,
                reveal=averaging_pb2.Reveal(secret=bytes(32)),
            )
            method = check_method(owner.transport.channel(owner.endpoint))
            with contextlib.suppress(grpc.aio.AioRpcError):
                await method(seal(mallory, CHECK_STATEMENT, statement), timeout=30)

        flood = asyncio.gather(*(bogus(k) for k in range(70)))
        try:

            async def full() -> bool:  # every waiting slot taken: the rest were refused
                return refusals.by_code()["OVERLOADED"] >= 6

            await until(full, timeout_seconds=10, what="the flood to fill the slots")
            flooded = refusals.by_code()["OVERLOADED"]
            updates, group = honest_updates(0, 3), group_of(peers, 0)
            early = [
                asyncio.ensure_future(p.all_reduce(u, group))
                for p, u in zip(peers[:2], updates, strict=False)
            ]

            async def arrived() -> bool:  # both members' streams wait at the owner (or failed)
                waiting = owner.servicer.open_streams.keys() >= {p.peer_id for p in peers[:2]}
                return waiting or refusals.by_code()["OVERLOADED"] > flooded

            await until(arrived, timeout_seconds=10, what="the members' streams at the owner")
            results = await asyncio.gather(*early, owner.all_reduce(updates[2], group))
        finally:
            flood.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flood
        assert all(r.complete for r in results), [r.failures for r in results]


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


async def test_a_member_that_accepts_no_connections_is_not_held_silent() -> None:
    """A member with no endpoint (it dials out only, owns no part) gets no check messages, so it
    cannot report: the parts it sent to go unchecked, and nobody flags it."""
    async with swarm(4) as peers:
        members = [Member(peer_id=a.peer_id, endpoint=a.endpoint) for a in peers[:3]]
        members.append(Member(peer_id=peers[3].peer_id, endpoint="", bandwidth=0.0))
        for round_ in range(2):
            group = Group(round=round_, members=tuple(members))
            updates = honest_updates(round_, 4)
            results = await asyncio.gather(
                *(a.all_reduce(u[:SIZE], group) for a, u in zip(peers, updates, strict=True))
            )
            assert all(r.complete for r in results)
        for peer in peers:
            assert peer.ledger.bans == {}
            assert all(n == 0 for n in peer.ledger.flag_counts.values())
            assert peer.checks["failed"] == 0


def collude(monkeypatch: pytest.MonkeyPatch) -> dict[int, OwnerHooks]:
    """The owner of part 4 (the last of five members) lies about its part's result and member
    3 reports what cancels the lie in the projection check; every member audits that part. The
    owner hooks to pass to the rounds."""
    shifts: dict[int, torch.Tensor] = {}

    def lie(index: int, value: torch.Tensor) -> torch.Tensor:
        told = lying_result(index, value)
        shifts[index] = told - value  # the pair share what the lie is
        return told

    honest_report = checks.own_report

    def covering(part: CheckedPart, me: int, *rest: Any) -> averaging_pb2.PartReport:
        report = honest_report(part, me, *rest)
        if me != 3 or part.part != 4:  # the colluder, on its owner's part
            return report
        cover: list[float] = []
        for index, chunk in enumerate(part.account.chunks):
            if me in chunk.contributors:  # what the lie takes from the sum, given back
                shift, vectors = (
                    shifts[index],
                    signs(part.seed, index, part.numels[index]),
                )
                cover += project(shift, sum(chunk.clip), vectors)
        covered = [x + c for x, c in zip(report.projections, cover, strict=True)]
        del report.projections[:]
        report.projections.extend(covered)
        return report

    monkeypatch.setattr(checks, "own_report", covering)
    monkeypatch.setattr(audits, "choose", lambda parts, _: 4 if 4 in parts else None)
    return {4: Lie(lie)}


async def test_an_owner_whose_lie_a_colluding_member_covers_is_caught_by_an_audit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The projection check trusts each member's report on its own values: a colluder that knows
    the owner's lie reports what cancels it, and the check passes. An audit of that part (its
    chunks fetched from the owner, checked against the members' signatures, aggregated again)
    convicts both."""
    async with swarm(5, replace(OPEN, audit_probability=1.0)) as peers:
        honest, colluder, owner = peers[:3], peers[3], peers[4]
        lying = collude(monkeypatch)
        results = await average(peers, honest_updates(0, 5), 0, owner_hooks=lying)
        # The check is fooled: every part passes and the lie is applied (the audits may
        # already be under way: they run after the round, off its deadline) ...
        assert all(isinstance(r, RoundResult) and r.complete for r in results)
        assert all(p.checks["failed"] == 0 for p in peers)
        assert not any(
            Flag.LYING_OWNER in ban.flags for p in honest for ban in p.ledger.bans.values()
        )
        # ... and the audits after the round convict the owner and its cover.
        await audited(honest, 1)
        for peer in honest:
            assert peer.checks["audit_failed"] == 1
            assert peer.ledger.bans[owner.peer_id].flags == (Flag.FAILED_AUDIT,)
            assert peer.ledger.bans[colluder.peer_id].flags == (Flag.FALSE_REPORT,)
            assert set(peer.ledger.bans) == {owner.peer_id, colluder.peer_id}


async def test_a_colluding_owner_whose_account_lists_a_malformed_key_is_still_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An owner that lists a malformed key for a member's header signature (one byte, not an
    Ed25519 key) has its account refused: no member applies its lie. And an account that breaks
    an audit fails it: the owner is banned for a failed audit, never left unjudged."""
    async with swarm(5, replace(OPEN, audit_probability=1.0)) as peers:
        honest, owner = peers[:3], peers[4]  # peers[3] covers for it
        lying = collude(monkeypatch)
        real = OpenOwner.account

        def malformed(self: OpenOwner) -> averaging_pb2.Signed | None:
            signed = real(self)
            if signed is None or self.group.members[self.part].peer_id != owner.peer_id:
                return signed
            account = averaging_pb2.PartAccount.FromString(signed.body)
            account.header_auths[0].public_key = b"\x00"
            return seal(owner.identity, ACCOUNT_STATEMENT, account)

        monkeypatch.setattr(OpenOwner, "account", malformed)
        updates = honest_updates(0, 5)
        results = await average(peers, updates, 0, owner_hooks=lying)
        start, end = group_of(peers, 0).partition(SIZE)[4]
        for peer, result, mine in zip(honest, results, updates, strict=False):
            assert isinstance(result, RoundResult)
            assert (start, end) in result.missing
            assert "account" in result.failures[owner.peer_id]
            assert torch.equal(result.averaged[start:end], mine[start:end])  # its own, not the lie
            assert peer.checks["audit_passed"] + peer.checks["audit_failed"] == 0

        # An account that passes the door but breaks the audit's reading of it.
        monkeypatch.setattr(OpenOwner, "account", real)

        def broken(public_key: bytes) -> str:
            raise ValueError(f"an Ed25519 public key has 32 bytes, got {len(public_key)}")

        monkeypatch.setattr(reports, "peer_id_of", broken)
        results = await average(peers, honest_updates(1, 5), 1, owner_hooks=lying)
        assert all(isinstance(r, RoundResult) and r.complete for r in results)
        await audited(honest, 1)
        for peer in honest:
            assert peer.checks["audit_failed"] == 1
            assert peer.ledger.bans[owner.peer_id].flags == (Flag.FAILED_AUDIT,)


async def test_an_owner_that_cannot_show_the_chunks_it_averaged_fails_its_audit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An audit's requests are answered only within bounds, and an owner that serves another
    chunk than the one its account lists (or none) is convicted; one that has gone is not."""
    async with swarm(4, replace(OPEN, audit_probability=1.0), sockets=True) as peers:
        owner = peers[3]
        monkeypatch.setattr(audits, "choose", lambda parts, _: 3 if 3 in parts else None)
        real = OpenOwner.account

        def hide(self: OpenOwner) -> averaging_pb2.Signed | None:
            signed = real(self)
            if self.group.members[self.part].peer_id == owner.peer_id:
                for chunks in self.chunks:  # it keeps other bytes than it accounted for
                    for chunk in chunks.values():
                        chunk.payload = bytes(len(chunk.payload))
            return signed

        monkeypatch.setattr(OpenOwner, "account", hide)
        results = await average(peers, honest_updates(0, 4), 0)
        assert all(isinstance(r, RoundResult) and r.complete for r in results)
        await audited(peers[:3], 1)
        for peer in peers[:3]:
            assert peer.checks["audit_failed"] == 1
            assert peer.ledger.bans[owner.peer_id].flags == (Flag.FAILED_AUDIT,)
        # Out-of-bounds requests are refused, and more than one audit's worth too.
        group = group_of(peers, 1)
        key = round_key(OPEN, group)
        asker = peers[0]

        async def ask(part: int, chunk: int, member: int) -> averaging_pb2.CheckReply:
            statement = averaging_pb2.CheckStatement(
                key=key,
                sender=asker.peer_id,
                audit=averaging_pb2.AuditRequest(part=part, chunk=chunk, member=member),
            )
            async with grpc.aio.insecure_channel(peers[1].endpoint) as channel:
                return await check_method(channel)(
                    seal(asker.identity, CHECK_STATEMENT, statement), timeout=5
                )

        monkeypatch.setattr(OpenOwner, "account", real)
        round_ = asyncio.gather(
            *(p.all_reduce(u, group) for p, u in zip(peers, honest_updates(1, 4), strict=True))
        )
        results = await round_
        assert all(isinstance(r, RoundResult) for r in results)
        reply = await ask(1, 0, 0)
        assert len(reply.payloads) == 1  # its own part's chunk, as member 0 signed it
        cases = {
            (2, 0, 0): grpc.StatusCode.PERMISSION_DENIED,
            (1, 99, 0): grpc.StatusCode.INVALID_ARGUMENT,
        }
        for (part, chunk, member), status in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await ask(part, chunk, member)
            assert refused.value.code() == status
        start, end = group.partition(SIZE)[1]
        # Two audits' worth: every member's chunks (an audit, or stand-ins for missing reports).
        worth = 2 * 4 * len(chunk_sizes(end - start, CHUNK))
        for _ in range(worth - 1):
            await ask(1, 0, 0)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await ask(1, 0, 0)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


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
