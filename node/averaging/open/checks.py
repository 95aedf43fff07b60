"""Open runs: after a round, the members check every owner's result before anyone applies it.

An owner could return anything for its part. Each member holds only its own values, so no member
can recompute a part; together they can check it (BTARD's idea; the arithmetic and its tolerance
are in ``node/trust/checks.py``). The steps, each bounded by ``check_timeout_seconds``:

1. *Accounts* (as results arrive, ``accounts.py``): an owner signs a :class:`PartAccount` of its
   part. A member takes a part only with an account that names the bytes it received.
2. *Reveal*: every member sends every other member its secret, the accounts it received and the
   parts it got no account of. A member without a part's account takes one another member
   forwarded; two different accounts one owner signed for one part are proof of equivocation.
3. *Report*: each part's seed is fixed from its account and the secrets revealed (each checked
   against its commitment); each contributor reports ``c_i <z_k, x_i>`` for its chunks of the
   part, which needs no result: an owner cannot keep a member out of the check by withholding.
4. *Check* (``reports.py``): a member sums, chunk by chunk, every contributor's row and the
   result it holds. A row it lacks is stood in for by the contributor's signed chunks, fetched
   from the owner. A part that sums to zero passes; one that cannot be checked is not applied.
5. *Accusation*: an owner whose part fails, or that received a report under another seed than
   its own, recomputes the reports from the members' signed chunks it kept and sends the chunks
   behind any false one; anyone can check the member's signatures and recompute. A proven false
   report convicts that member, and its row is replaced by the true one.
6. A part that still fails convicts its owner: its values are dropped (the caller keeps its own
   there, as for a missing part), and the owner is banned.

Convictions here rest on signed evidence (equivocation, a false report, a failed check whose
reports stand), so they are decisive. Equivocation, a forged commitment and a false secret come
with evidence small enough for peers outside the group to check (``evidence.py``): the ledger
keeps it with the ban, and ``node/trust/board.py`` publishes it. What is not proof stays a flag:
a member that does not reveal or report is marked silent, and an owner that sent this member
every result but no account is marked as having withheld it (banned after repeated rounds, like
other flags); what other members say an owner withheld from them is their word, a dispute. A
member covering its owner's lie with a false report passes these checks; the audits after the
round (``audits.py``) catch both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from swarmgrad.node.averaging.group import Group, chunk_sizes
from swarmgrad.node.averaging.open import evidence
from swarmgrad.node.averaging.open.accounts import (
    CheckedPart,
    Forwarded,
    take_forwarded,
    verify_account,
)
from swarmgrad.node.averaging.open.member import OpenMember
from swarmgrad.node.averaging.open.reports import (
    Rows,
    agree,
    check_part,
    fetch_chunk,
    listed_values,
    own_report,
    reported,
    signed_values,
    true_projections,
)
from swarmgrad.node.averaging.plan import AllReduceConfig, RoundResult, round_key
from swarmgrad.node.trust.aggregate import Aggregator
from swarmgrad.node.trust.checks import PROJECTIONS, SECRET_BYTES, commitment, part_seed
from swarmgrad.node.trust.ledger import Flag
from swarmgrad.protocol.auth import Signer
from swarmgrad.protocol.averaging import (
    CHECK_STATEMENT,
    check_method,
    chunk_signed_by,
    header_signed,
    seal,
    unseal,
)
from swarmgrad.protocol.errors import ProtocolViolation
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

log = logging.getLogger(__name__)

__all__ = ["CheckBox", "CheckRun", "CheckedPart", "Verdict", "run_checks", "verify_account"]

#: Stand-in chunks a member fetches at once.
_FETCHES = 8


class CheckBox:
    """The check messages of one round received from the other members, first of each kind per
    member; a message larger than the round can need is refused (BAD_PAYLOAD)."""

    def __init__(self, group: Group, *, max_chunks: int) -> None:
        """``max_chunks``: the most chunks any part of the round has."""
        self.group = group
        self.max_chunks = max_chunks
        self.reveals: dict[int, averaging_pb2.Reveal] = {}
        #: The reveals as their members signed them (evidence of a false secret).
        self.signed_reveals: dict[int, averaging_pb2.Signed] = {}
        self.reports: dict[int, tuple[averaging_pb2.Signed, averaging_pb2.Report]] = {}
        self.accusations: list[averaging_pb2.Accusation] = []
        self._changed = asyncio.Condition()

    def validate(self, statement: averaging_pb2.CheckStatement) -> None:
        """Refuse what no honest member sends: more accounts or parts than the group has
        members, more numbers or chunks than a part has chunks, a secret or seed of the wrong
        size."""
        n, chunks = len(self.group.members), self.max_chunks
        kind = statement.WhichOneof("body")
        if kind == "reveal":
            reveal = statement.reveal
            ok = (
                len(reveal.secret) == SECRET_BYTES
                and len(reveal.accounts) <= n
                and len(reveal.unaccounted) <= n
                and all(p < n for p in reveal.unaccounted)
            )
        elif kind == "report":
            ok = len(statement.report.parts) <= n and all(
                p.part < n
                and len(p.projections) <= PROJECTIONS * chunks
                and len(p.projections) % PROJECTIONS == 0
                and len(p.payload_sha256) <= chunks
                and len(p.seed) in (0, 32)
                for p in statement.report.parts
            )
        elif kind == "accusation":
            accusation = statement.accusation
            ok = (
                accusation.part < n and accusation.member < n and len(accusation.payloads) <= chunks
            )
        else:
            ok = False  # audit requests are answered, not kept (the averager's ``check``)
        if not ok:
            raise ProtocolViolation(
                ResultCode.BAD_PAYLOAD, f"an oversized or malformed {kind} from {statement.sender}"
            )

    async def put(
        self, member: int, statement: averaging_pb2.CheckStatement, signed: averaging_pb2.Signed
    ) -> None:
        self.validate(statement)
        kind = statement.WhichOneof("body")
        if kind == "reveal":
            self.reveals.setdefault(member, statement.reveal)
            self.signed_reveals.setdefault(member, signed)
        elif kind == "report":
            self.reports.setdefault(member, (signed, statement.report))
        elif kind == "accusation" and len(self.accusations) < len(self.group.members) ** 2:
            self.accusations.append(statement.accusation)
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, done: Callable[[], bool], *, timeout_seconds: float) -> bool:
        """Wait until ``done()`` (True) or the timeout (False)."""
        try:
            async with asyncio.timeout(timeout_seconds), self._changed:
                await self._changed.wait_for(done)
        except TimeoutError:
            return done()
        return True


@dataclass(slots=True)
class Verdict:
    """What the checks of one round found."""

    #: Parts whose results must not be applied: their owner was convicted, or this member could
    #: not check them.
    dropped: set[int] = field(default_factory=set)
    #: Of those, the parts this member holds results of but could not check.
    unchecked: set[int] = field(default_factory=set)
    #: Peers convicted on signed evidence, and of what.
    convicted: dict[str, Flag] = field(default_factory=dict)
    #: For some convictions, the evidence any peer can check (``evidence.py``), by peer.
    evidence: dict[str, averaging_pb2.Evidence] = field(default_factory=dict)
    #: Members that did not reveal, or report, in time.
    silent: set[str] = field(default_factory=set)
    #: Owners whose forwarded account leaves out this member's values, and owners other members
    #: say sent them no account of their part (their word: disputes), by owner.
    excluded_by: set[str] = field(default_factory=set)
    unaccounted_by: dict[str, set[str]] = field(default_factory=dict)
    #: Parts checked (and passed or failed), and the largest |sum| / tolerance among passes.
    checked: int = 0
    failed: int = 0
    worst_ratio: float = 0.0
    #: What an audit (``audits.py``) needs of the checks: the parts with their accounts (and
    #: seeds, where fixed), and the members' reports.
    parts: dict[int, CheckedPart] = field(default_factory=dict)
    reports: dict[int, averaging_pb2.Report] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class CheckRun:
    """One member's view of one round, for its checks."""

    signer: Signer
    config: AllReduceConfig
    group: Group
    me: int
    box: CheckBox
    channel: Callable[[str], grpc.aio.Channel]
    result: RoundResult
    #: What the owners decoded of this member's values (the round's ``sent``).
    sent: torch.Tensor
    #: This member's side of the round: its secret, the accounts it received, what waits
    #: for one (``member.py``).
    member: OpenMember
    #: This member's own part's account, as it signed it (None: it owns no part).
    own: averaging_pb2.Signed | None = None
    #: This member's own part's chunks as members sent them (it is their owner), by chunk.
    own_chunks: Sequence[Mapping[int, averaging_pb2.Chunk]] = ()
    #: Members this node refuses (banned): their check messages never come, so nobody waits
    #: for them (that wait would make this member's own reports late for everyone else).
    refused: frozenset[int] = frozenset()


async def run_checks(run: CheckRun) -> Verdict:
    """Run this member's side of the round's checks (module docstring); never raises for what
    peers do."""
    verdict = Verdict()
    group, me, config = run.group, run.me, run.config
    key = round_key(config, group)
    bounds = group.partition(run.result.averaged.numel())

    def layout(number: int) -> tuple[int, list[int]]:
        start, end = bounds[number]
        return start, chunk_sizes(end - start, config.chunk_values)

    parts: dict[int, CheckedPart] = {}
    held: dict[int, set[int]] = {}
    for number, index in run.result.chunk_contributors:
        held.setdefault(number, set()).add(index)
    received = dict(run.member.accounts)
    if run.own is not None:
        received[me] = run.own
    for number, signed in received.items():
        start, numels = layout(number)
        account = run.member.verified.get(number)
        if account is None:  # this member's own part: its own account, which holds
            try:
                account = verify_account(signed, group=group, key=key, part=number, numels=numels)
            except ProtocolViolation as error:
                log.error("round %d: this node's own account is refused: %s", group.round, error)
                verdict.unchecked.add(number)
                continue
        parts[number] = CheckedPart(
            number, account, signed, start, numels, applicable=held.get(number, set())
        )
    verdict.parts = parts
    timeout = config.check_timeout_seconds
    unaccounted = [
        number
        for number, (start, end) in enumerate(bounds)
        if number != me and end > start and number not in parts
    ]

    # 2: reveal; forwarded accounts and equivocation.
    await _broadcast(
        run,
        averaging_pb2.CheckStatement(
            reveal=averaging_pb2.Reveal(
                secret=run.member.secret,
                accounts=[p.signed for p in parts.values()],
                unaccounted=unaccounted,
            )
        ),
    )
    if not _reachable(run, me):
        return verdict  # nobody can send this member anything: it only gave its secret
    others = {
        m
        for m in range(len(group.members))
        if m != me and _reachable(run, m) and m not in run.refused
    }
    committed = {m for p in parts.values() for m in p.account.members} & others
    # Without an account of some part, wait for everyone who could forward it too.
    awaited = committed | (others - set(unaccounted)) if unaccounted else committed
    await run.box.wait_for(lambda: awaited <= run.box.reveals.keys(), timeout_seconds=timeout)
    _take_forwarded(run, parts, layout, verdict)

    if not Aggregator(config.aggregator).checkable:
        return verdict  # no fixed point to check: applied unchecked (audits still run)

    # 3: seeds, reports.
    for part in parts.values():
        if part.part not in verdict.dropped:
            _seed(run, part, verdict)
    seeded = {p.part: p for p in parts.values() if p.seed and p.part not in verdict.dropped}
    digests = run.member.sent_digests
    mine = averaging_pb2.Report(
        parts=await asyncio.to_thread(
            lambda: [
                own_report(p, me, run.sent, digests)
                for p in seeded.values()
                if p.part != me and me in p.contributors()
            ]
        )
    )
    await _broadcast(run, averaging_pb2.CheckStatement(report=mine))
    # A member that revealed nothing here reports under a seed this member cannot share.
    expected = {m for p in seeded.values() for m in p.contributors()} & run.box.reveals.keys()
    await run.box.wait_for(lambda: expected <= run.box.reports.keys(), timeout_seconds=timeout)
    reports = {m: report for m, (_, report) in run.box.reports.items()}
    reports[me] = mine
    verdict.reports = reports

    # 4: the check of every part this member holds results of; 5: accusations.
    for number, part in parts.items():
        if number not in seeded and part.applicable and number not in verdict.dropped:
            verdict.unchecked.add(number)  # no seed: nobody revealed a secret of it
    checking = {n: p for n, p in seeded.items() if n == me or p.applicable}
    rows: dict[int, dict[int, Rows]] = {}
    defence = None
    if me in checking:
        own = _own_rows(run, checking[me], reports)
        if own is None:
            verdict.unchecked.add(me)
        else:
            rows[me] = own
            defence = asyncio.create_task(_defend(run, checking[me], reports, own))
    others_parts = {n: p for n, p in checking.items() if n != me}
    rows |= await _rows(run, others_parts, reports, verdict)
    failed: dict[int, CheckedPart] = {}
    for number, part in checking.items():
        if number not in rows:
            continue
        passed, worst = await asyncio.to_thread(
            check_part, part, rows[number], _result_of(run, part), _chunks(run, part)
        )
        verdict.checked += 1
        if passed:
            verdict.worst_ratio = max(verdict.worst_ratio, worst)
        else:
            failed[number] = part
    accusations = await defence if defence is not None else []
    if failed:
        await run.box.wait_for(
            lambda: all(any(a.part == p for a in run.box.accusations) for p in failed if p != me),
            timeout_seconds=timeout,
        )
        for accusation in accusations + list(run.box.accusations):
            _judge_accusation(run, accusation, failed, rows, key, verdict)
        for number, part in failed.items():
            passed, _ = check_part(part, rows[number], _result_of(run, part), _chunks(run, part))
            if passed:
                continue
            owner = group.members[number].peer_id
            verdict.dropped.add(number)
            verdict.failed += 1
            verdict.convicted.setdefault(owner, Flag.LYING_OWNER)
            log.warning("round %d: %s's result for part %d failed the check",
                        group.round, owner, number)  # fmt: skip
    verdict.dropped |= verdict.unchecked
    return verdict


def _take_forwarded(
    run: CheckRun,
    parts: dict[int, CheckedPart],
    layout: Callable[[int], tuple[int, list[int]]],
    verdict: Verdict,
) -> None:
    """Take the accounts the other members forwarded in their reveals, and what they say
    owners withheld from them."""
    group = run.group
    found = Forwarded()
    for member, reveal in list(run.box.reveals.items()):
        for signed in reveal.accounts:
            take_forwarded(
                signed,
                group=group,
                me=run.me,
                key=round_key(run.config, group),
                parts=parts,
                layout=layout,
                pending=run.member.pending,
                sent_digests=run.member.sent_digests,
                found=found,
            )
        for number in set(reveal.unaccounted) - {member}:
            owner = group.members[number].peer_id
            verdict.unaccounted_by.setdefault(owner, set()).add(group.members[member].peer_id)
    for owner, proof in found.convicted.items():
        verdict.convicted[owner] = Flag.EQUIVOCATION
        verdict.evidence[owner] = proof
        log.warning("round %d: %s signed two accounts of one part", group.round, owner)
    verdict.dropped |= found.dropped
    verdict.excluded_by |= found.excluded_by


def _seed(run: CheckRun, part: CheckedPart, verdict: Verdict) -> None:
    """Fix ``part``'s seed from its account and the secrets revealed of its committed members,
    each checked against the commitment the account lists. A secret that matches proves the
    commitment is the member's (nobody else could pick one it hashes to). Only when one does not
    match is the member's stream-header signature (which the account shows) checked: a
    commitment the member did not sign convicts the owner (the part is dropped), one it did sign
    convicts the member (its secret stays out of the seed). A member that revealed nothing is
    flagged silent and left out of the seed: the others' secrets make it one the owner could not
    know when it signed."""
    group, account = run.group, part.account
    owner = group.members[part.part].peer_id
    secrets: dict[int, bytes] = {}
    for member, promised, auth in zip(
        account.members, account.commitments, account.header_auths, strict=True
    ):
        peer = group.members[member]
        reveal = run.box.reveals.get(member)
        secret = run.member.secret if member == run.me else reveal.secret if reveal else None
        if secret is None:
            if _reachable(run, member) and member not in run.refused:
                verdict.silent.add(peer.peer_id)
            continue
        if commitment(secret) == promised:
            secrets[member] = secret
            continue
        if not header_signed(evidence.header_of(account, group, member, promised), auth):
            verdict.dropped.add(part.part)
            verdict.convicted[owner] = Flag.FORGERY
            verdict.evidence[owner] = evidence.forgery(part.signed, group, member)
            log.warning("round %d: %s forged %s's commitment", group.round, owner, peer.peer_id)
            return
        if peer.peer_id not in verdict.convicted:
            verdict.convicted[peer.peer_id] = Flag.FALSE_REPORT
            signed = run.box.signed_reveals.get(member)
            if signed is not None:
                proof = evidence.false_secret(part.signed, group, member, signed)
                verdict.evidence[peer.peer_id] = proof
    if secrets:
        part.seed = part_seed(part.signed.body, secrets)


def _reachable(run: CheckRun, member: int) -> bool:
    """Whether ``member`` can receive check messages: one with no endpoint (it accepts no
    connections) gets no reveals, so it cannot report; the parts it sent to are checked with its
    signed chunks instead, and it is not held silent for it."""
    return bool(run.group.members[member].endpoint)


def _result_of(run: CheckRun, part: CheckedPart) -> Callable[[int], torch.Tensor]:
    """The result this member holds of a chunk of ``part`` (from its owner, or kept while its
    account was missing)."""
    pending = run.member.pending.get(part.part) if part.forwarded else None

    def result(index: int) -> torch.Tensor:
        start, end = part.span(index)
        if pending is not None:
            return pending.values[start:end]
        return run.result.averaged[part.start + start : part.start + end]

    return result


def _chunks(run: CheckRun, part: CheckedPart) -> set[int]:
    """The chunks of ``part`` this member checks: those it holds results of (all, as owner)."""
    if part.part == run.me:
        return {i for i, chunk in enumerate(part.account.chunks) if len(chunk.contributors)}
    return set(part.applicable)


async def _rows(
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
            if not (mentioned or excused or member in run.refused) and _reachable(run, member):
                verdict.silent.add(group.members[member].peer_id)
    limit = asyncio.Semaphore(_FETCHES)

    async def stand_in(part: CheckedPart, member: int) -> tuple[int, int, Rows | None]:
        async with limit:
            values = await _fetch_values(run, part, member)
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


def _own_values(run: CheckRun, part: CheckedPart, member: int) -> dict[int, torch.Tensor] | None:
    """As the part's owner: ``member``'s values of its chunks, from the chunks it sent (None:
    not all kept)."""
    values = {}
    for index in part.chunks_of(member):
        chunk = run.own_chunks[index].get(member) if index < len(run.own_chunks) else None
        decoded = None if chunk is None else listed_values(part, index, member, chunk)
        if decoded is None:
            return None
        values[index] = decoded
    return values


def _own_rows(
    run: CheckRun, part: CheckedPart, reports: Mapping[int, averaging_pb2.Report]
) -> dict[int, Rows] | None:
    """As the part's owner: every contributor's rows under its seed, from its report or else
    from the chunks it sent (None: neither)."""
    out = {}
    for member in part.contributors():
        rows = reported(reports.get(member), part, member)
        if rows is None:
            values = _own_values(run, part, member)
            if values is None:
                return None
            rows = true_projections(part, member, values)[0]
        out[member] = rows
    return out


async def _fetch_values(
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


async def _defend(
    run: CheckRun,
    part: CheckedPart,
    reports: Mapping[int, averaging_pb2.Report],
    rows: Mapping[int, Rows],
) -> list[averaging_pb2.Accusation]:
    """As the owner of ``part``: send the signed chunks behind every false report of it, for
    reports under another seed than this owner's (a checker that shares that seed would be
    misled) and, if its part fails under its own seed, for every report."""

    def false_ones() -> list[int]:
        passed, _ = check_part(part, rows, _result_of(run, part), _chunks(run, part))
        out = []
        for member in sorted(part.contributors()):
            report = reports.get(member)
            entry = next((p for p in _entries(report) if p.part == part.part), None)
            if entry is None or len(entry.seed) != 32 or (passed and entry.seed == part.seed):
                continue
            claimed = reported(report, part, member, entry.seed)
            values = _own_values(run, part, member)
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
        await _broadcast(run, averaging_pb2.CheckStatement(accusation=accusation))
    return sent


def _entries(report: averaging_pb2.Report | None) -> Sequence[averaging_pb2.PartReport]:
    return () if report is None else report.parts


def _judge_accusation(
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


async def _broadcast(run: CheckRun, statement: averaging_pb2.CheckStatement) -> None:
    """Send ``statement`` (signed) to every other member, each call with the check deadline;
    failures are theirs (a member that misses it goes unchecked or silent)."""
    statement.key.CopyFrom(round_key(run.config, run.group))
    statement.sender = run.signer.peer_id
    signed = seal(run.signer, CHECK_STATEMENT, statement)

    async def send(endpoint: str) -> None:
        method = check_method(run.channel(endpoint))
        await method(signed, timeout=run.config.check_timeout_seconds)

    calls = [
        send(m.endpoint) for i, m in enumerate(run.group.members) if i != run.me and m.endpoint
    ]
    results = await asyncio.gather(*calls, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        log.debug("round %d: %d check message(s) not delivered", run.group.round, len(failures))
