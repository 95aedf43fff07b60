"""Audits of open rounds on real gRPC over 127.0.0.1: an owner whose lie a colluding member
covers in the check is convicted with it by the audit of its part, and so is one whose account
breaks the audit or that cannot show the chunks it averaged; an owner answers audit requests only
within bounds."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import grpc
import pytest
import torch

from swarmgrad.node.averaging.allreduce import RoundResult
from swarmgrad.node.averaging.group import chunk_sizes
from swarmgrad.node.averaging.hooks import OwnerHooks
from swarmgrad.node.averaging.open import audits, checks, reports
from swarmgrad.node.averaging.open.accounts import CheckedPart
from swarmgrad.node.averaging.open.owner import OpenOwner
from swarmgrad.node.averaging.plan import round_key
from swarmgrad.node.trust.checks import project, signs
from swarmgrad.node.trust.ledger import Flag
from swarmgrad.protocol.averaging import ACCOUNT_STATEMENT, CHECK_STATEMENT, check_method, seal
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.simulations.attacks import lying_result
from tests.helpers import group_of
from tests.integration.open_rounds import (
    CHUNK,
    OPEN,
    SIZE,
    Lie,
    audited,
    average,
    honest_updates,
    swarm,
)


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
