"""Open runs: re-aggregation audits, which catch an owner whose lie a colluding member covers.

The projection check (``checks.py``) rests on each contributor's report about its own values,
so a member in league with an owner can report whatever makes the owner's lie vanish. Audits
close that gap. After a round's checks each member, with probability ``audit_probability``
(default 1/n: about one audit per group and round), audits one other owner's part, chosen by
itself at random, so no owner knows in advance:

1. it asks the owner (an ``AuditRequest`` over ``Averaging.Check``) for every contributor's
   chunk of the part as the owner received it;
2. it checks each against the contributor's signature (its key is in the owner's signed account,
   with its stream header) and against the hash the account lists;
3. it aggregates them again with the round's rules and compares with the result it received:
   the clip coefficients must be the account's, and the result must lie within twice the result
   codec's own rounding of the re-aggregation.

A chunk that is not what the account says, other clip coefficients or another result convict
the owner (``failed_audit``); with the part's seed from the checks, a contributor whose report
the audited values prove false is convicted of a false report (the colluder). An owner that
does not answer (gone, or the round already retired) leaves the audit inconclusive: nobody is
blamed. An account or chunk that breaks the audit itself fails it: what the owner signed is the
owner's to make checkable. Audits run after the round, off its deadline, on copies of what they
need; a failed audit bans, it does not correct the values already applied.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from swarmgrad.compression import decode
from swarmgrad.node.averaging.group import Group
from swarmgrad.node.averaging.open.accounts import CheckedPart
from swarmgrad.node.averaging.open.reports import (
    agree,
    fetch_chunk,
    reported,
    signed_values,
    true_projections,
)
from swarmgrad.node.averaging.plan import AllReduceConfig, round_key
from swarmgrad.node.trust.aggregate import Aggregator, aggregate
from swarmgrad.node.trust.ledger import Flag
from swarmgrad.protocol.auth import Signer
from swarmgrad.protocol.v1 import averaging_pb2

log = logging.getLogger(__name__)

__all__ = ["Audit", "AuditOutcome", "choose", "run_audit"]

#: Chunk requests an audit keeps in flight.
_CONCURRENCY = 8
_random = random.SystemRandom()


def choose(
    candidates: Sequence[int], probability: float, rng: random.Random = _random
) -> int | None:
    """The part this member audits this round (None: none): with ``probability``, one of
    ``candidates`` at random."""
    if not candidates or rng.random() >= probability:
        return None
    return rng.choice(list(candidates))


@dataclass(slots=True, kw_only=True)
class Audit:
    """What one audit needs, copied out of its round (the round's buffers are reused)."""

    signer: Signer
    config: AllReduceConfig
    group: Group
    channel: Callable[[str], grpc.aio.Channel]
    part: CheckedPart
    #: The part's result as this member received it.
    received: torch.Tensor
    #: The members' reports of the round's checks (this member's included).
    reports: Mapping[int, averaging_pb2.Report]


@dataclass(slots=True)
class AuditOutcome:
    #: "passed", "failed" (the owner convicted) or "inconclusive" (no answer).
    result: str
    convicted: dict[str, Flag] = field(default_factory=dict)
    why: str = ""


async def run_audit(audit: Audit) -> AuditOutcome:
    """Audit one owner's part (module docstring); never raises for what peers do."""
    group, part = audit.group, audit.part
    owner = group.members[part.part]
    if not owner.endpoint:
        return AuditOutcome("inconclusive", why="the owner accepts no connections")
    wanted = [(i, m) for i, chunk in enumerate(part.account.chunks) for m in chunk.contributors]
    limit = asyncio.Semaphore(_CONCURRENCY)

    async def fetch(index: int, member: int) -> averaging_pb2.Chunk | None:
        async with limit:
            return await _fetch(audit, index, member)

    try:
        fetched = await asyncio.gather(*(fetch(i, m) for i, m in wanted))
    except (grpc.aio.AioRpcError, TimeoutError) as error:
        why = error.code().name if isinstance(error, grpc.aio.AioRpcError) else "timed out"
        return AuditOutcome("inconclusive", why=f"the owner did not answer ({why})")
    chunks = dict(zip(wanted, fetched, strict=True))
    try:
        return await asyncio.to_thread(_judge, audit, chunks)
    except Exception as error:  # what the owner signed broke the audit
        # The account and chunks are the owner's: one an audit cannot judge is one the owner
        # cannot show to be right, and an audit that ended here would never convict anyone.
        log.exception("round %d: the audit of %s's part broke", group.round, owner.peer_id)
        return _failed(owner.peer_id, f"its part cannot be audited ({error!r})")


async def _fetch(audit: Audit, index: int, member: int) -> averaging_pb2.Chunk | None:
    return await fetch_chunk(
        signer=audit.signer,
        config=audit.config,
        group=audit.group,
        channel=audit.channel,
        part=audit.part.part,
        index=index,
        member=member,
    )


def _judge(
    audit: Audit, chunks: Mapping[tuple[int, int], averaging_pb2.Chunk | None]
) -> AuditOutcome:
    group, part = audit.group, audit.part
    owner = group.members[part.part].peer_id
    key = round_key(audit.config, group)
    values: dict[tuple[int, int], torch.Tensor] = {}
    for (index, member), chunk in chunks.items():
        decoded = signed_values(part, group, key, index, member, chunk)
        if decoded is None:
            peer = group.members[member].peer_id
            return _failed(owner, f"cannot show {peer}'s chunk {index} as its account lists it")
        values[(index, member)] = decoded
    lie = _check_result(audit, values)
    # Were the reports true? A member that covered a lie (or framed nobody) reported otherwise.
    convicted = _false_reports(audit, values) if part.seed else {}
    if lie:
        convicted[owner] = Flag.FAILED_AUDIT
    if convicted:
        return AuditOutcome("failed", convicted, why=lie or "false reports")
    return AuditOutcome("passed")


def _check_result(audit: Audit, values: Mapping[tuple[int, int], torch.Tensor]) -> str:
    """Why the owner's result is not the part's values aggregated again ("": it is)."""
    part, account = audit.part, audit.part.account
    codec = audit.config.owner_rules().result_codec or audit.config.make_codec()
    for index, chunk_account in enumerate(account.chunks):
        start, end = part.span(index)
        received = audit.received[start:end]
        members = list(chunk_account.contributors)
        if not members:
            continue
        stack = torch.stack([values[(index, m)] for m in members])
        outcome = aggregate(stack, Aggregator(audit.config.aggregator))
        if len(outcome.used) != len(members) or not all(
            math.isclose(outcome.clip[k], c, rel_tol=1e-4, abs_tol=1e-6)
            for k, c in enumerate(chunk_account.clip)
        ):
            return f"other clip coefficients in chunk {index} than its account's"
        payload, meta = codec.encode(outcome.value)
        rounding = float((decode(payload, meta) - outcome.value).norm())
        error = float((received - outcome.value).norm())
        if error > 2.0 * rounding + 1e-6 * (1.0 + float(outcome.value.norm())):
            return (
                f"chunk {index}'s result is {error:.3g} from the audit's (rounding {rounding:.3g})"
            )
    return ""


def _false_reports(audit: Audit, values: Mapping[tuple[int, int], torch.Tensor]) -> dict[str, Flag]:
    """Contributors whose reports (under this member's seed) differ from what their audited
    values give."""
    part = audit.part
    out: dict[str, Flag] = {}
    for member in sorted(part.contributors()):
        claimed = reported(audit.reports.get(member), part, member)
        if claimed is None:
            continue  # no report under this seed: stood in for by its chunks in the checks
        mine = {index: v for (index, m), v in values.items() if m == member}
        if not agree(claimed, *true_projections(part, member, mine)):
            out[audit.group.members[member].peer_id] = Flag.FALSE_REPORT
    return out


def _failed(owner: str, why: str) -> AuditOutcome:
    return AuditOutcome("failed", {owner: Flag.FAILED_AUDIT}, why=why)
