"""Open runs: every contributor's rows of a part, for a member's check of it (``checks.py``):
its report under the checker's seed, or, missing, its signed chunks (``reports.py``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import grpc
import torch

from swarmgrad.node.averaging.open.accounts import CheckedPart
from swarmgrad.node.averaging.open.reports import (
    Rows,
    fetch_chunk,
    reported,
    signed_values,
    true_projections,
)
from swarmgrad.node.averaging.open.run import CheckRun, Verdict, own_values, reachable
from swarmgrad.node.averaging.plan import round_key
from swarmgrad.protocol.v1 import averaging_pb2

log = logging.getLogger(__name__)

__all__ = ["fetch_values", "gather_rows", "own_rows"]

#: Stand-in chunks a member fetches at once.
_FETCHES = 8


async def gather_rows(
    run: CheckRun,
    parts: Mapping[int, CheckedPart],
    reports: Mapping[int, averaging_pb2.Report],
    verdict: Verdict,
) -> dict[int, dict[int, Rows]]:
    """Every contributor's rows of other owners' parts under this member's seed: its report
    (this member's own too), or, missing, its signed chunks from the owner. Parts with a row
    that cannot be had are unchecked."""
    group = run.group
    out: dict[int, dict[int, Rows]] = {}
    wanted: list[tuple[CheckedPart, int]] = []
    for number, part in parts.items():
        out[number] = {}
        for member in part.contributors():
            report = reports.get(member)
            rows = reported(report, part, member)
            if rows is not None:
                out[number][member] = rows
                continue
            wanted.append((part, member))
            mentioned = report is not None and any(p.part == number for p in report.parts)
            excused = number in run.box.reveals.get(member, averaging_pb2.Reveal()).unaccounted
            if not (mentioned or excused or member in run.refused) and reachable(run, member):
                verdict.silent.add(group.members[member].peer_id)
    limit = asyncio.Semaphore(_FETCHES)

    async def stand_in(part: CheckedPart, member: int) -> tuple[int, int, Rows | None]:
        async with limit:
            values = await fetch_values(run, part, member)
        if values is None:
            return part.part, member, None
        rows, _ = await asyncio.to_thread(true_projections, part, member, values)
        return part.part, member, rows

    for number, member, rows in await asyncio.gather(*(stand_in(p, m) for p, m in wanted)):
        if rows is None:
            if out.pop(number, None) is not None:
                verdict.unchecked.add(number)
                log.info("round %d: part %d cannot be checked: no report of %s and no chunks",
                         group.round, number, group.members[member].peer_id)  # fmt: skip
        elif number in out:
            out[number][member] = rows
    return out


def own_rows(
    run: CheckRun, part: CheckedPart, reports: Mapping[int, averaging_pb2.Report]
) -> dict[int, Rows] | None:
    """As the part's owner: every contributor's rows under its seed, from its report or else
    from the chunks it sent (None: neither)."""
    out = {}
    for member in part.contributors():
        rows = reported(reports.get(member), part, member)
        if rows is None:
            values = own_values(run, part, member)
            if values is None:
                return None
            rows = true_projections(part, member, values)[0]
        out[member] = rows
    return out


async def fetch_values(
    run: CheckRun, part: CheckedPart, member: int
) -> dict[int, torch.Tensor] | None:
    """``member``'s signed values of its chunks of ``part``, fetched from the owner (None: the
    owner could not show them all)."""
    key = round_key(run.config, run.group)
    values = {}
    for index in part.chunks_of(member):
        try:
            chunk = await fetch_chunk(
                signer=run.signer,
                config=run.config,
                group=run.group,
                channel=run.channel,
                part=part.part,
                index=index,
                member=member,
            )
        except (grpc.aio.AioRpcError, TimeoutError):
            return None
        decoded = await asyncio.to_thread(signed_values, part, run.group, key, index, member, chunk)
        if decoded is None:
            return None
        values[index] = decoded
    return values
