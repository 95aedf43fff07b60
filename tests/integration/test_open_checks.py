"""The check step of open rounds on real gRPC over 127.0.0.1: check reports of the wrong shape,
check messages from strangers and forgers, and a flood of them for rounds that never come are
refused without stopping the round or starving honest streams; a member that accepts no
connections is not flagged for the reports it cannot give."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
import pytest

from swarmgrad.node.averaging.allreduce import RoundResult
from swarmgrad.node.averaging.group import Group, Member
from swarmgrad.node.averaging.open import checks
from swarmgrad.node.averaging.open.accounts import CheckedPart
from swarmgrad.node.averaging.plan import round_key
from swarmgrad.node.identity import Identity
from swarmgrad.protocol.auth import sign_statement
from swarmgrad.protocol.averaging import CHECK_STATEMENT, check_method, seal
from swarmgrad.protocol.v1 import averaging_pb2
from tests.helpers import group_of, until
from tests.integration.open_rounds import OPEN, SIZE, average, honest_updates, swarm


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
