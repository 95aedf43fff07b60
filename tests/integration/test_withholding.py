"""Open runs on real gRPC over 127.0.0.1: an owner that withholds its account (or its results)
from some members, alone or with a lie, and members that stay silent. The owner is the one
blamed; no honest member is flagged for an owner's silence, and no lie is ever applied."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import pytest
import torch

from swarmgrad.node.averaging.allreduce import RoundResult
from swarmgrad.node.averaging.averager import Averager
from swarmgrad.node.averaging.open import audits, checks
from swarmgrad.node.averaging.reducer import SenderSession
from swarmgrad.node.trust.ledger import Flag
from swarmgrad.protocol.averaging import ChunkResult
from swarmgrad.protocol.v1 import averaging_pb2
from tests.helpers import group_of
from tests.integration.open_rounds import (
    OPEN,
    SIZE,
    Lie,
    audited,
    average,
    honest_updates,
    open_mean,
    rel,
    swarm,
)

N = 5
OWNER = N - 1  # the attacker's index: the last member


def times_minus_three(index: int, value: torch.Tensor) -> torch.Tensor:
    return value * -3.0


#: The lie of the review's attacker, as its owner hooks: its part's result times -3.
FLIP = {OWNER: Lie(times_minus_three)}


def victim(round_: int) -> int:
    """The honest member the owner withholds from in ``round_``: each in turn."""
    return round_ % OWNER


def withhold(
    monkeypatch: pytest.MonkeyPatch,
    bad: Averager,
    whom: Callable[[int], set[int]],
    *,
    results: bool = False,
) -> None:
    """Make ``bad``, as an owner, end the streams of members ``whom(round)`` without its signed
    account (``results``: without any result either, once it has their chunks)."""
    honest_account, honest_results = SenderSession.account, SenderSession.results

    def targeted(session: SenderSession) -> bool:
        reducer = session._reducer
        owner = reducer.group.members[reducer.part].peer_id
        return owner == bad.peer_id and session._member in whom(reducer.group.round)

    async def account(self: SenderSession) -> averaging_pb2.Signed | None:
        signed = await honest_account(self)
        return None if targeted(self) else signed

    async def nothing() -> AsyncIterator[ChunkResult]:
        return
        yield  # an async generator that yields nothing

    def results_(self: SenderSession) -> AsyncIterator[ChunkResult]:
        return nothing() if results and targeted(self) else honest_results(self)

    monkeypatch.setattr(SenderSession, "account", account)
    monkeypatch.setattr(SenderSession, "results", results_)


def applied_no_lie(
    peers: list[Averager], results: list[RoundResult | BaseException], updates: list[torch.Tensor]
) -> None:
    """No honest member applied the attacker's part: each holds its own values there."""
    start, end = group_of(peers, 0).partition(SIZE)[OWNER]  # the same cut every round
    for member, result in enumerate(results[:OWNER]):
        assert isinstance(result, RoundResult), result
        assert torch.equal(result.averaged[start:end], updates[member][start:end]), member


async def run_rounds(
    peers: list[Averager], rounds: int
) -> list[tuple[list[torch.Tensor], list[RoundResult | BaseException]]]:
    out = []
    for round_ in range(rounds):
        updates = honest_updates(round_, len(peers))
        out.append((updates, await average(peers, updates, round_)))
    return out


def no_honest_flags(honest: list[Averager], bad: Averager) -> None:
    for peer in honest:
        assert set(peer.ledger.bans) <= {bad.peer_id}, peer.ledger.bans
        for other in honest:
            if other is peer:
                continue
            flags = peer.ledger.table().get(other.peer_id, {}).get("flags", {})
            assert not flags, (peer.peer_id, other.peer_id, flags)


async def test_a_rotating_withholder_that_lies_is_banned_by_every_honest_member_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The review's critical attack: an owner withholds its account from one member a round, in
    turn, and returns its result x(-3). The victim takes the account another member forwards
    and reports like everyone else: the check fails in the first round, every honest member
    convicts the owner, and nobody ever applies the lie."""
    async with swarm(N) as peers:
        honest, bad = peers[:OWNER], peers[OWNER]
        withhold(monkeypatch, bad, lambda r: {victim(r)})
        updates = honest_updates(0, N)
        results = await average(peers, updates, 0, owner_hooks=FLIP)
        applied_no_lie(peers, results, updates)
        for peer in honest:
            assert peer.ledger.bans[bad.peer_id].flags == (Flag.LYING_OWNER,), peer.peer_id
        no_honest_flags(honest, bad)
        # Every honest member, the victim too, applied the same values elsewhere.
        end = group_of(peers, 0).partition(SIZE)[OWNER][0]
        done = [r for r in results[:OWNER] if isinstance(r, RoundResult)]
        assert all(torch.equal(done[0].averaged[:end], r.averaged[:end]) for r in done[1:])


async def test_withholding_results_too_does_not_keep_a_victim_out_of_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reports do not depend on the result: a member the owner sent nothing back reports its
    values all the same, so the lie fails everyone else's check (it went unchecked before). The
    victim, which holds no result to check, applies nothing of the part and notes the owner."""
    async with swarm(N) as peers:
        honest, bad = peers[:OWNER], peers[OWNER]
        withhold(monkeypatch, bad, lambda r: {victim(r)}, results=True)
        updates = honest_updates(0, N)
        results = await average(peers, updates, 0, owner_hooks=FLIP)
        applied_no_lie(peers, results, updates)
        for member, peer in enumerate(honest):
            if member == victim(0):
                assert peer.ledger.table()[bad.peer_id]["flags"] == {"withheld": 1}
            else:
                assert peer.ledger.bans[bad.peer_id].flags == (Flag.LYING_OWNER,)
        no_honest_flags(honest, bad)


async def test_an_honest_victim_of_withholding_is_never_held_silent_and_keeps_the_part(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Withholding alone (no lie), a victim a round: every member applies every part (the
    victim with the account another member forwarded), replicas agree, no honest member is
    flagged, and only the victim (which saw it) counts it against the owner."""
    async with swarm(N) as peers:
        honest, bad = peers[:OWNER], peers[OWNER]
        withhold(monkeypatch, bad, lambda r: {victim(r)})
        for _, results in await run_rounds(peers, OWNER):
            done = [r for r in results if isinstance(r, RoundResult)]
            assert len(done) == N
            assert all(r.complete for r in done), [r.missing for r in done]
            assert all(torch.equal(done[0].averaged, r.averaged) for r in done[1:])
        no_honest_flags(honest, bad)
        for member, peer in enumerate(honest):
            flags = peer.ledger.table()[bad.peer_id]["flags"]
            assert flags == {"withheld": 1}, (member, flags)  # its own round as the victim
            assert peer.ledger.table()[bad.peer_id]["disputes"] == OWNER - 1  # the others' word
            assert bad.peer_id not in peer.ledger.bans
            assert peer.checks["failed"] == 0
            assert peer.checks["unchecked"] == 0


async def test_a_victim_audits_the_results_it_applied_from_a_forwarded_account(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Audits every round, of an owner that withholds (and does not lie): the victim, whose part
    is applied only once the forwarded account came, audits those results, not its own values
    that stood there before; no audit fails and nobody is banned."""
    # Every member audits the withholder's part, every round.
    monkeypatch.setattr(audits, "choose", lambda parts, _: OWNER if OWNER in parts else None)
    async with swarm(N, replace(OPEN, audit_probability=1.0)) as peers:
        honest, bad = peers[:OWNER], peers[OWNER]
        withhold(monkeypatch, bad, lambda r: {victim(r)})
        for round_ in range(OWNER):  # each honest member a victim once
            results = await average(peers, honest_updates(round_, N), round_)
            assert all(isinstance(r, RoundResult) and r.complete for r in results[:OWNER])
            await audited(honest, round_ + 1)
        for peer in honest:
            assert peer.checks["audit_failed"] == 0, peer.checks
            assert not peer.ledger.bans, peer.ledger.bans


async def test_an_owner_that_withholds_every_account_is_banned_and_its_part_never_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with swarm(N) as peers:
        honest, bad = peers[:OWNER], peers[OWNER]
        withhold(monkeypatch, bad, lambda r: set(range(N)))
        honest_broadcast = checks._broadcast

        async def keep_own(run: checks.CheckRun, statement: averaging_pb2.CheckStatement) -> None:
            if run.signer.peer_id == bad.peer_id and statement.WhichOneof("body") == "reveal":
                own = run.own.body if run.own is not None else b""
                kept = [a for a in statement.reveal.accounts if a.body != own]
                del statement.reveal.accounts[:]
                statement.reveal.accounts.extend(kept)  # nor does it forward its own account
            await honest_broadcast(run, statement)

        monkeypatch.setattr(checks, "_broadcast", keep_own)
        banned_at = None
        for round_ in range(3):
            updates = honest_updates(round_, N)
            results = await average(peers, updates, round_, owner_hooks=FLIP)
            applied_no_lie(peers, results, updates)
            if banned_at is None and all(p.ledger.banned(bad.peer_id) for p in honest):
                banned_at = round_
        assert banned_at == 2  # three rounds in a row, seen by each honest member itself
        assert {p.ledger.bans[bad.peer_id].flags for p in honest} == {(Flag.WITHHELD,)}
        no_honest_flags(honest, bad)


async def test_a_silent_member_cannot_leave_a_lying_owners_part_unchecked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A colluder that reveals and reports nothing used to leave every part it sent to
    unchecked (and applied). Now its row is its signed chunks, fetched from the owner: a lying
    owner that shows them is convicted, one that does not has its part dropped; honest owners'
    parts are checked and applied; the colluder is flagged silent."""
    async with swarm(N) as peers:
        honest, colluder, bad = peers[: N - 2], peers[N - 2], peers[OWNER]
        honest_broadcast = checks._broadcast

        async def mute(run: checks.CheckRun, statement: averaging_pb2.CheckStatement) -> None:
            if run.signer.peer_id != colluder.peer_id:
                await honest_broadcast(run, statement)

        monkeypatch.setattr(checks, "_broadcast", mute)
        updates = honest_updates(0, N)
        results = await average(peers, updates, 0, owner_hooks=FLIP)
        applied_no_lie(peers, results, updates)
        bounds = group_of(peers, 0).partition(SIZE)
        for peer, result in zip(honest, results, strict=False):
            assert isinstance(result, RoundResult)
            assert result.missing == (bounds[OWNER],)  # every honest part checked and applied
            assert peer.ledger.bans[bad.peer_id].flags == (Flag.LYING_OWNER,)
            assert peer.ledger.table()[colluder.peer_id]["flags"] == {"silent": 1}
            assert peer.checks["unchecked"] == 0
        for peer in honest:
            assert set(peer.ledger.bans) == {bad.peer_id}


async def test_a_member_that_dies_after_sending_leaves_every_part_checked_and_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Churn, not an attack: a member that streams its values and then goes quiet (its checks
    never run) is stood in for by its chunks; the survivors check and apply every part."""
    async with swarm(N) as peers:
        gone = peers[0]
        honest_run = checks.run_checks

        async def run_checks(run: checks.CheckRun) -> checks.Verdict:
            if run.signer.peer_id == gone.peer_id:
                return checks.Verdict()
            return await honest_run(run)

        monkeypatch.setattr(checks, "run_checks", run_checks)
        monkeypatch.setattr("swarmgrad.node.averaging.open.policy.run_checks", run_checks)
        updates = honest_updates(0, N)
        results = await average(peers, updates, 0)
        survivors = [r for r in results[1:] if isinstance(r, RoundResult)]
        assert len(survivors) == N - 1
        assert all(r.complete for r in survivors), [r.missing for r in survivors]
        assert all(torch.equal(survivors[0].averaged, r.averaged) for r in survivors[1:])
        for peer in peers[1:]:
            assert peer.checks["checked"] == N
            assert peer.checks["unchecked"] == 0
            assert peer.ledger.bans == {}


async def test_honest_open_rounds_are_exact_after_the_change() -> None:
    """The honest path: every part checked by every member, nothing fetched, the open mean."""
    async with swarm(N) as peers:
        for updates, results in await run_rounds(peers, 2):
            done = [r for r in results if isinstance(r, RoundResult)]
            assert len(done) == N
            assert all(r.complete for r in done)
            assert rel(done[0].averaged, open_mean(peers, updates)) < 0.02
        for peer in peers:
            assert peer.checks["checked"] == 2 * N
            assert peer.checks["failed"] == 0
            assert "unchecked" not in peer.checks
            assert peer.ledger.bans == {}
