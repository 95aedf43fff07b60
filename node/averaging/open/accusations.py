"""Open runs: an owner's accusations of false reports, and a member's judgement of them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence

from swarmgrad.node.averaging.open.accounts import CheckedPart
from swarmgrad.node.averaging.open.reports import (
    Rows,
    agree,
    check_part,
    listed_values,
    reported,
    true_projections,
)
from swarmgrad.node.averaging.open.run import (
    CheckRun,
    Verdict,
    checked_chunks,
    own_values,
    result_of,
)
from swarmgrad.node.trust.ledger import Flag
from swarmgrad.protocol.averaging import CHECK_STATEMENT, chunk_signed_by, unseal
from swarmgrad.protocol.errors import ProtocolViolation
from swarmgrad.protocol.v1 import averaging_pb2

log = logging.getLogger(__name__)

__all__ = ["defend", "judge_accusation"]

#: Sends a check message to every other member (``checks.py``).
Send = Callable[[CheckRun, averaging_pb2.CheckStatement], Awaitable[None]]


async def defend(
    run: CheckRun,
    part: CheckedPart,
    reports: Mapping[int, averaging_pb2.Report],
    rows: Mapping[int, Rows],
    send: Send,
) -> list[averaging_pb2.Accusation]:
    """As the owner of ``part``: send the signed chunks behind every false report of it, for
    reports under another seed than this owner's (a checker that shares that seed would be
    misled) and, if its part fails under its own seed, for every report."""

    def false_ones() -> list[int]:
        passed, _ = check_part(part, rows, result_of(run, part), checked_chunks(run, part))
        out = []
        for member in sorted(part.contributors()):
            report = reports.get(member)
            entry = next((p for p in entries(report) if p.part == part.part), None)
            if entry is None or len(entry.seed) != 32 or (passed and entry.seed == part.seed):
                continue
            claimed = reported(report, part, member, entry.seed)
            values = own_values(run, part, member)
            if claimed is None or values is None:
                continue
            if not agree(claimed, *true_projections(part, member, values, entry.seed)):
                out.append(member)
        return out

    sent = []
    for member in await asyncio.to_thread(false_ones):
        signed, _ = run.box.reports[member]
        chunks = [run.own_chunks[index][member] for index in part.chunks_of(member)]
        accusation = averaging_pb2.Accusation(
            part=part.part, member=member, report=signed, payloads=chunks
        )
        sent.append(accusation)
        await send(run, averaging_pb2.CheckStatement(accusation=accusation))
    return sent


def entries(report: averaging_pb2.Report | None) -> Sequence[averaging_pb2.PartReport]:
    return () if report is None else report.parts


def judge_accusation(
    run: CheckRun,
    accusation: averaging_pb2.Accusation,
    failed: Mapping[int, CheckedPart],
    rows: dict[int, dict[int, Rows]],
    key: averaging_pb2.RoundKey,
    verdict: Verdict,
) -> None:
    """Convict a member whose report the owner's accusation proves false (under the seed the
    report names), and take its true rows (under this member's seed); an accusation that
    proves nothing is ignored."""
    part = failed.get(accusation.part)
    n = len(run.group.members)
    if part is None or not 0 <= accusation.member < n:
        return
    member = accusation.member
    accused = run.group.members[member].peer_id
    public_key = accusation.report.auth.public_key  # its signer is checked below
    try:
        signer, statement = unseal(accusation.report, CHECK_STATEMENT, averaging_pb2.CheckStatement)
    except ProtocolViolation:
        return
    indices = part.chunks_of(member)
    if (
        signer != accused
        or statement.key != key
        or statement.WhichOneof("body") != "report"
        or len(accusation.payloads) != len(indices)
        or not all(
            chunk.index == index and chunk_signed_by(public_key, key, accused, part.part, chunk)
            for index, chunk in zip(indices, accusation.payloads, strict=True)
        )
    ):
        return
    entry = next((p for p in statement.report.parts if p.part == part.part), None)
    if entry is None or len(entry.seed) != 32:
        return
    values = {}
    for index, chunk in zip(indices, accusation.payloads, strict=True):
        decoded = listed_values(part, index, member, chunk)
        if decoded is None:
            return
        values[index] = decoded
    claimed = reported(statement.report, part, member, entry.seed)
    if claimed is None or agree(claimed, *true_projections(part, member, values, entry.seed)):
        return
    verdict.convicted[accused] = Flag.FALSE_REPORT
    rows.setdefault(part.part, {})[member] = true_projections(part, member, values)[0]
    log.warning("round %d: %s's check report for part %d was false",
                run.group.round, accused, part.part)  # fmt: skip
