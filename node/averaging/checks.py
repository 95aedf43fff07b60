"""Open runs: after a round, the members check every owner's result before anyone applies it.

An owner could return anything for its part. Each member holds only its own values, so no member
can recompute a part; together they can check it (BTARD's idea; the arithmetic and its tolerance
are in ``node/trust/checks.py``). The steps, each bounded by ``check_timeout_seconds``:

1. *Accounts* (as results arrive, :func:`verify_account`): an owner signs a :class:`PartAccount`
   of its part: per chunk, the result's hash, the contributors with their clip coefficients and
   payload hashes, and the commitments members' stream headers carried. A member takes a part
   only with an account that names the bytes it received.
2. *Reveal*: every member sends every other member its secret and the accounts it received. Two
   different accounts signed by one owner for one part of one round are proof of equivocation.
3. *Report*: with every contributor's secret revealed (and matching its commitment), the part's
   seed is fixed; each contributor sends ``c_i <z_k, x_i - v>`` for its chunks of the part. The
   sums must vanish within the tolerance.
4. *Accusation*: an owner whose part fails recomputes every report from the members' signed
   chunks it kept, and sends the chunks behind any false one; anyone can check the member's
   signatures and recompute. A proven false report convicts that member, and its report is
   replaced by the true one.
5. A part that still fails convicts its owner: its values are dropped (the caller keeps its own
   there, as for a missing part), and the owner is banned.

Convictions here rest on signed evidence (equivocation, a false report, a failed check whose
reports stand), so they are decisive. Equivocation, a forged commitment and a false secret come
with evidence small enough for peers outside the group to check (``evidence.py``): the ledger
keeps it with the ban, and ``node/trust/board.py`` publishes it. What is not proof stays a flag:
a member that does not reveal or report is only marked silent (banned after repeated rounds, like
other flags), and the part goes unchecked this round; an owner that drops a member's values is a
dispute (``ledger``). A member covering its owner's lie with a false report passes these checks;
the audits after the round (``audits.py``) catch both.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from swarmgrad.compression import CodecError, decode
from swarmgrad.node.averaging import evidence
from swarmgrad.node.averaging.group import Group, chunk_sizes
from swarmgrad.node.averaging.plan import AllReduceConfig, RoundResult, round_key
from swarmgrad.node.trust.checks import (
    PROJECTIONS,
    SECRET_BYTES,
    commitment,
    holds,
    part_seed,
    project,
    report_slack,
    signs,
)
from swarmgrad.node.trust.ledger import Flag
from swarmgrad.protocol.auth import NONCE_BYTES, Signer
from swarmgrad.protocol.averaging import (
    ACCOUNT_STATEMENT,
    CHECK_STATEMENT,
    check_method,
    chunk_signed_by,
    header_signed,
    seal,
    unseal,
)
from swarmgrad.protocol.errors import ProtocolViolation
from swarmgrad.protocol.keys import KEY_BYTES, SIGNATURE_BYTES, peer_id_of
from swarmgrad.protocol.tensors import meta_from_proto
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

log = logging.getLogger(__name__)

__all__ = ["CheckBox", "CheckRun", "Verdict", "run_checks", "verify_account"]


def _bad(why: str) -> ProtocolViolation:
    return ProtocolViolation(ResultCode.BAD_PAYLOAD, why)


def verify_account(
    signed: averaging_pb2.Signed,
    *,
    group: Group,
    key: averaging_pb2.RoundKey,
    part: int,
    numels: Sequence[int],
    results: Mapping[int, bytes] | None = None,
    contributors: Mapping[int, Sequence[int]] | None = None,
) -> averaging_pb2.PartAccount:
    """The account of ``part``, once it is signed by the part's owner, is about this round and
    part, is well formed, and (where given) names the result bytes (``results``: SHA-256 by
    chunk) and contributors this member received; ProtocolViolation otherwise.

    Well formed means exact: every hash and signature field has its one length, each stream
    header signature is in the key of the member it is listed for, and no field is unknown. An
    account is shown again as evidence (``evidence.py``) and read by audits (``audits.py``), so
    its size follows from the group and the part alone, and nothing in it breaks those readers.
    """
    owner = group.members[part].peer_id
    signer, account = unseal(signed, ACCOUNT_STATEMENT, averaging_pb2.PartAccount)
    if signer != owner:
        raise ProtocolViolation(
            ResultCode.UNAUTHENTICATED, f"the account of part {part} is signed by {signer}"
        )
    if account.key != key or account.part != part or account.owner != owner:
        raise _bad(f"{owner}'s account is not of this round's part {part}")
    known = averaging_pb2.PartAccount()
    known.CopyFrom(account)
    known.DiscardUnknownFields()
    if known.ByteSize() != account.ByteSize():
        raise _bad(f"{owner}'s account carries fields this protocol does not have")
    if len(account.chunks) != len(numels):
        raise _bad(f"{owner}'s account has {len(account.chunks)} chunks, not {len(numels)}")
    n = len(group.members)
    for index, chunk in enumerate(account.chunks):
        members = list(chunk.contributors)
        if (
            len(set(members)) != len(members)
            or not all(0 <= m < n and m != part for m in members)
            or len(chunk.clip) != len(members)
            or len(chunk.payload_sha256) != len(members)
            or not all(math.isfinite(c) and 0.0 <= c <= 1.0 for c in chunk.clip)
            or not all(len(d) == 32 for d in chunk.payload_sha256)
            or len(chunk.result_sha256) not in (0, 32)  # empty: the chunk has no result
        ):
            raise _bad(f"{owner}'s account of chunk {index} is malformed")
        if results is not None and index in results and chunk.result_sha256 != results[index]:
            raise _bad(f"{owner}'s account names other bytes than it sent for chunk {index}")
        if (
            contributors is not None
            and index in contributors
            and sorted(members) != sorted(contributors[index])
        ):
            raise _bad(f"{owner}'s account of chunk {index} names other contributors")
    if (
        len(account.members) != len(account.commitments)
        or len(account.members) != len(account.header_auths)
        or len(set(account.members)) != len(account.members)
        or not all(0 <= m < n for m in account.members)
        or not all(len(c) == 32 for c in account.commitments)
    ):
        raise _bad(f"{owner}'s account lists malformed commitments")
    for member, auth in zip(account.members, account.header_auths, strict=True):
        if (
            len(auth.public_key) != KEY_BYTES
            or len(auth.nonce) != NONCE_BYTES
            or len(auth.signature) != SIGNATURE_BYTES
            or not math.isfinite(auth.issued_at)
            or peer_id_of(auth.public_key) != group.members[member].peer_id
        ):
            raise _bad(f"{owner}'s account lists a malformed header signature of member {member}")
    committed = set(account.members)
    if not all(set(chunk.contributors) <= committed for chunk in account.chunks):
        raise _bad(f"{owner}'s account counts members with no commitment")
    return account


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
        members, more numbers or chunks than a part has chunks, a secret of the wrong size."""
        n, chunks = len(self.group.members), self.max_chunks
        kind = statement.WhichOneof("body")
        if kind == "reveal":
            ok = (
                len(statement.reveal.secret) == SECRET_BYTES and len(statement.reveal.accounts) <= n
            )
        elif kind == "report":
            ok = len(statement.report.parts) <= n and all(
                p.part < n
                and len(p.projections) <= PROJECTIONS * chunks
                and len(p.projections) % PROJECTIONS == 0
                and len(p.payload_sha256) <= chunks
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
            raise _bad(f"an oversized or malformed {kind} from {statement.sender}")

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

    #: Parts whose results must not be applied (their owner was convicted).
    dropped: set[int] = field(default_factory=set)
    #: Peers convicted on signed evidence, and of what.
    convicted: dict[str, Flag] = field(default_factory=dict)
    #: For some convictions, the evidence any peer can check (``evidence.py``), by peer.
    evidence: dict[str, averaging_pb2.Evidence] = field(default_factory=dict)
    #: Members that did not reveal or report in time: their parts went unchecked.
    silent: set[str] = field(default_factory=set)
    #: Parts checked (and passed or failed), and the largest |sum| / tolerance among passes.
    checked: int = 0
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
    #: This member's own part's chunks as members sent them (it is their owner), by chunk.
    own_chunks: Sequence[Mapping[int, averaging_pb2.Chunk]] = ()
    #: Report false projections (a framing attack; tests and simulations only).
    false_reports: bool = False


@dataclass(slots=True)
class CheckedPart:
    part: int
    account: averaging_pb2.PartAccount
    signed: averaging_pb2.Signed
    start: int
    numels: list[int]
    seed: bytes = b""

    def span(self, index: int) -> tuple[int, int]:
        """[start, end) of chunk ``index`` within the part."""
        start = sum(self.numels[:index])
        return start, start + self.numels[index]


async def run_checks(run: CheckRun) -> Verdict:
    """Run this member's side of the round's checks (module docstring); never raises for what
    peers do."""
    verdict = Verdict()
    group, me, config = run.group, run.me, run.config
    key = round_key(config, group)
    bounds = group.partition(run.result.averaged.numel())
    parts: dict[int, CheckedPart] = {}
    for number, signed in run.result.accounts.items():
        start, end = bounds[number]
        numels = chunk_sizes(end - start, config.chunk_values)
        account = run.result.verified_accounts.get(number)
        if account is None:
            account = verify_account(signed, group=group, key=key, part=number, numels=numels)
        parts[number] = CheckedPart(number, account, signed, start, numels)
    verdict.parts = parts
    timeout = config.check_timeout_seconds

    # 2: reveal, and equivocation.
    await _broadcast(
        run,
        averaging_pb2.CheckStatement(
            reveal=averaging_pb2.Reveal(
                secret=run.result.secret, accounts=[p.signed for p in parts.values()]
            )
        ),
    )
    if not _reachable(run, me):
        return verdict  # nobody can send this member anything: it only gave its secret
    committed = {m for p in parts.values() for m in p.account.members} - {me}
    await run.box.wait_for(lambda: committed <= run.box.reveals.keys(), timeout_seconds=timeout)
    for reveal in list(run.box.reveals.values()):
        for signed in reveal.accounts:
            _equivocation(run, parts, signed, key, verdict)

    # 3: seeds, reports.
    for part in parts.values():
        if part.part not in verdict.dropped:
            _seed(run, part, verdict)
    seeded = {p.part: p for p in parts.values() if p.seed and p.part not in verdict.dropped}
    if config.aggregator == "median":
        seeded = {}  # no fixed point to check (the median is a fallback, not for open runs)
    mine = averaging_pb2.Report(
        parts=await asyncio.to_thread(
            lambda: [
                _report(run, p) for p in seeded.values() if p.part != me and _contributes(p, me)
            ]
        )
    )
    await _broadcast(run, averaging_pb2.CheckStatement(report=mine))
    expected = {
        m
        for p in seeded.values()
        for c in p.account.chunks
        for m in c.contributors
        if m != me and _reachable(run, m)
    }
    await run.box.wait_for(lambda: expected <= run.box.reports.keys(), timeout_seconds=timeout)

    # 4: verify; accusations for failed parts.
    reports = {m: report for m, (_, report) in run.box.reports.items()}
    reports[me] = mine
    verdict.reports = reports
    failed: dict[int, CheckedPart] = {}
    for part in seeded.values():
        outcome = _verify(run, part, reports, verdict)
        if outcome is False:
            failed[part.part] = part
    if failed:
        accusations = await _accuse(run, failed[me], reports) if me in failed else []
        await run.box.wait_for(
            lambda: all(any(a.part == p for a in run.box.accusations) for p in failed if p != me),
            timeout_seconds=timeout,
        )
        for accusation in accusations + list(run.box.accusations):
            _judge_accusation(run, accusation, failed, reports, key, verdict)
        for part in failed.values():
            if _verify(run, part, reports, verdict, again=True) is not False:
                continue
            owner = group.members[part.part].peer_id
            verdict.dropped.add(part.part)
            verdict.convicted.setdefault(owner, Flag.LYING_OWNER)
            log.warning(
                "round %d: %s's result for part %d failed the check", group.round, owner, part.part
            )
    return verdict


def _seed(run: CheckRun, part: CheckedPart, verdict: Verdict) -> None:
    """Fix ``part``'s seed from its account and its contributors' secrets, each checked against
    the commitment the account lists. A secret that matches proves the commitment is the
    member's (nobody else could pick one it hashes to). Only when one does not match is the
    member's stream-header signature (which the account shows) checked: a commitment the member
    did not sign convicts the owner (the part is dropped), one it did sign convicts the member.
    A missing secret leaves the part unchecked and the member flagged silent."""
    group, account = run.group, part.account
    owner = group.members[part.part].peer_id
    secrets = []
    for member, promised, auth in zip(
        account.members, account.commitments, account.header_auths, strict=True
    ):
        peer = group.members[member]
        reveal = run.box.reveals.get(member)
        secret = run.result.secret if member == run.me else reveal.secret if reveal else None
        if secret is None:
            verdict.silent.add(peer.peer_id)
            return
        if commitment(secret) == promised:
            secrets.append(secret)
            continue
        if not header_signed(evidence.header_of(account, group, member, promised), auth):
            verdict.dropped.add(part.part)
            verdict.convicted[owner] = Flag.FORGERY
            verdict.evidence[owner] = evidence.forgery(part.signed, group, member)
            log.warning("round %d: %s forged %s's commitment", group.round, owner, peer.peer_id)
        elif peer.peer_id not in verdict.convicted:
            verdict.convicted[peer.peer_id] = Flag.FALSE_REPORT
            signed = run.box.signed_reveals.get(member)
            if signed is not None:
                proof = evidence.false_secret(part.signed, group, member, signed)
                verdict.evidence[peer.peer_id] = proof
        return
    part.seed = part_seed(part.signed.body, secrets)


def _reachable(run: CheckRun, member: int) -> bool:
    """Whether ``member`` can receive check messages: one with no endpoint (it accepts no
    connections) gets no reveals, so it cannot report; the parts it sent to go unchecked, and it
    is not held silent for it."""
    return bool(run.group.members[member].endpoint)


def _contributes(part: CheckedPart, member: int) -> bool:
    return any(member in c.contributors for c in part.account.chunks)


def _equivocation(
    run: CheckRun,
    parts: Mapping[int, CheckedPart],
    signed: averaging_pb2.Signed,
    key: averaging_pb2.RoundKey,
    verdict: Verdict,
) -> None:
    """Convict an owner that signed another account of a part than the one this member got."""
    if any(signed.body == p.signed.body for p in parts.values()):
        return  # the same bytes as one this member holds: nothing to prove
    try:
        signer, account = unseal(signed, ACCOUNT_STATEMENT, averaging_pb2.PartAccount)
    except ProtocolViolation:
        return  # a forwarded account that does not verify proves nothing against its owner
    mine = parts.get(account.part)
    if (
        mine is None
        or account.key != key
        or signer != run.group.members[account.part].peer_id
        or signed.body == mine.signed.body
    ):
        return
    verdict.dropped.add(account.part)
    verdict.convicted[signer] = Flag.EQUIVOCATION
    verdict.evidence[signer] = evidence.equivocation(mine.signed, signed)
    log.warning(
        "round %d: %s signed two accounts of part %d", run.group.round, signer, account.part
    )


def _values(run: CheckRun, part: CheckedPart, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this member's values as its owner decoded them, the result) of one chunk."""
    start, end = (part.start + at for at in part.span(index))
    return run.sent[start:end], run.result.averaged[start:end]


def _report(run: CheckRun, part: CheckedPart) -> averaging_pb2.PartReport:
    """This member's projections for its chunks of ``part``."""
    out = averaging_pb2.PartReport(part=part.part)
    digests = run.result.sent_digests
    for index, chunk in enumerate(part.account.chunks):
        members = list(chunk.contributors)
        if run.me not in members:
            continue
        values, result = _values(run, part, index)
        vectors = signs(part.seed, index, part.numels[index])
        projections = project(values, result, chunk.clip[members.index(run.me)], vectors)
        if run.false_reports:
            projections = [x + 1e3 * (1.0 + abs(x)) for x in projections]
        out.projections.extend(projections)
        out.payload_sha256.append(digests.get((part.part, index), b""))
    return out


def reported_projections(
    report: averaging_pb2.Report | None, part: CheckedPart, member: int
) -> list[list[float]] | None:
    """A member's projections of its chunks of ``part`` (None: it did not report them all)."""
    if report is None:
        return None
    entry = next((p for p in report.parts if p.part == part.part), None)
    count = sum(member in c.contributors for c in part.account.chunks)
    # Exactly PROJECTIONS a chunk, as every honest member computes them: a report of another
    # shape is no report (rows of the wrong length would break every sum over them).
    if entry is None or not count or len(entry.projections) != PROJECTIONS * count:
        return None
    values = list(entry.projections)
    return [values[i * PROJECTIONS : (i + 1) * PROJECTIONS] for i in range(count)]


def _verify(
    run: CheckRun,
    part: CheckedPart,
    reports: Mapping[int, averaging_pb2.Report],
    verdict: Verdict,
    *,
    again: bool = False,
) -> bool | None:
    """Whether the reports of ``part`` sum to zero (None: some are missing; unchecked);
    ``again``: after accusations (the part is counted once)."""
    by_member: dict[int, list[list[float]]] = {}
    for member in {m for c in part.account.chunks for m in c.contributors}:
        projections = reported_projections(reports.get(member), part, member)
        if projections is None:
            if _reachable(run, member):
                verdict.silent.add(run.group.members[member].peer_id)
            return None
        by_member[member] = projections
    used = dict.fromkeys(by_member, 0)
    passed, worst = True, 0.0
    for index, chunk in enumerate(part.account.chunks):
        rows = []
        for member in chunk.contributors:
            rows.append(by_member[member][used[member]])
            used[member] += 1
        _, result = _values(run, part, index)
        ok, ratio = holds(result, list(chunk.clip), rows)
        passed &= ok
        worst = max(worst, ratio)
    verdict.checked += not again
    if passed:
        verdict.worst_ratio = max(verdict.worst_ratio, worst)
    return passed


async def _accuse(
    run: CheckRun, part: CheckedPart, reports: Mapping[int, averaging_pb2.Report]
) -> list[averaging_pb2.Accusation]:
    """As the owner of a failed part: send the signed chunks behind every false report."""
    sent = []
    for member in {m for c in part.account.chunks for m in c.contributors}:
        claimed = reported_projections(reports.get(member), part, member)
        truth = _true_projections(run, part, member)
        if claimed is None or truth is None or agree(claimed, *truth):
            continue
        signed, _ = run.box.reports[member]
        chunks = [
            run.own_chunks[index][member]
            for index, c in enumerate(part.account.chunks)
            if member in c.contributors
        ]
        accusation = averaging_pb2.Accusation(
            part=part.part, member=member, report=signed, payloads=chunks
        )
        sent.append(accusation)
        await _broadcast(run, averaging_pb2.CheckStatement(accusation=accusation))
    return sent


def _true_projections(
    run: CheckRun,
    part: CheckedPart,
    member: int,
    chunks: Iterable[averaging_pb2.Chunk] | None = None,
) -> tuple[list[list[float]], list[float]] | None:
    """What ``member`` should have reported, from its chunks (the owner's, by default), and
    each chunk's slack."""
    if chunks is None:
        if len(run.own_chunks) != len(part.numels):
            return None
        chunks = [
            run.own_chunks[i][member]
            for i, c in enumerate(part.account.chunks)
            if member in c.contributors and member in run.own_chunks[i]
        ]
    indices = [i for i, c in enumerate(part.account.chunks) if member in c.contributors]
    chunks = list(chunks)
    if len(chunks) != len(indices):
        return None
    values = {}
    for index, chunk in zip(indices, chunks, strict=True):
        decoded = listed_values(part, index, member, chunk)
        if decoded is None:
            return None
        values[index] = decoded
    return true_projections(part, member, values, lambda index: _values(run, part, index)[1])


def listed_values(
    part: CheckedPart, index: int, member: int, chunk: averaging_pb2.Chunk
) -> torch.Tensor | None:
    """``member``'s values of chunk ``index``, if ``chunk`` is the payload the part's account
    lists for it and decodes to the chunk's size (None otherwise)."""
    account = part.account.chunks[index]
    position = list(account.contributors).index(member)
    if hashlib.sha256(chunk.payload).digest() != account.payload_sha256[position]:
        return None
    try:
        values = decode(chunk.payload, meta_from_proto(chunk.meta), max_numel=part.numels[index])
    except (CodecError, ValueError):
        return None
    return values if values.numel() == part.numels[index] else None


def true_projections(
    part: CheckedPart,
    member: int,
    values: Mapping[int, torch.Tensor],
    result: Callable[[int], torch.Tensor],
) -> tuple[list[list[float]], list[float]]:
    """What ``member`` should have reported for its chunks of ``part`` (``values``: its values
    by chunk index; ``result``: the result of a chunk), and each chunk's slack."""
    out: list[list[float]] = []
    slack: list[float] = []
    for index, account in enumerate(part.account.chunks):
        if member not in account.contributors:
            continue
        clip = account.clip[list(account.contributors).index(member)]
        vectors = signs(part.seed, index, part.numels[index])
        out.append(project(values[index], result(index), clip, vectors))
        slack.append(report_slack(values[index], result(index), clip))
    return out, slack


def agree(
    claimed: Sequence[Sequence[float]], truth: Sequence[Sequence[float]], slack: Sequence[float]
) -> bool:
    """Whether a member's reported projections are the ones its values give, within each
    chunk's ``slack`` (:func:`~swarmgrad.node.trust.checks.report_slack`: the recomputation may
    run on another machine)."""
    return all(
        abs(x - y) <= bound
        for row_a, row_b, bound in zip(claimed, truth, slack, strict=True)
        for x, y in zip(row_a, row_b, strict=True)
    )


def _judge_accusation(
    run: CheckRun,
    accusation: averaging_pb2.Accusation,
    failed: Mapping[int, CheckedPart],
    reports: dict[int, averaging_pb2.Report],
    key: averaging_pb2.RoundKey,
    verdict: Verdict,
) -> None:
    """Convict a member whose report the owner's accusation proves false (and use the true
    projections); an accusation that proves nothing is ignored."""
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
    if (
        signer != accused
        or statement.key != key
        or statement.WhichOneof("body") != "report"
        or not all(
            chunk_signed_by(public_key, key, accused, part.part, chunk)
            for chunk in accusation.payloads
        )
    ):
        return
    claimed = reported_projections(statement.report, part, member)
    recomputed = _true_projections(run, part, member, accusation.payloads)
    if claimed is None or recomputed is None or agree(claimed, *recomputed):
        return
    verdict.convicted[accused] = Flag.FALSE_REPORT
    truth = recomputed[0]
    entry = averaging_pb2.PartReport(part=part.part, projections=[x for row in truth for x in row])
    reports[member] = averaging_pb2.Report(parts=[entry])
    log.warning(
        "round %d: %s's check report for part %d was false", run.group.round, accused, part.part
    )


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
