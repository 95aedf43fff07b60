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
from collections.abc import Callable

from swarmgrad.node.averaging.group import chunk_sizes
from swarmgrad.node.averaging.open import evidence
from swarmgrad.node.averaging.open.accounts import (
    CheckedPart,
    Forwarded,
    take_forwarded,
    verify_account,
)
from swarmgrad.node.averaging.open.accusations import defend, judge_accusation
from swarmgrad.node.averaging.open.box import CheckBox
from swarmgrad.node.averaging.open.reports import Rows, check_part, own_report
from swarmgrad.node.averaging.open.rows import gather_rows, own_rows
from swarmgrad.node.averaging.open.run import (
    CheckRun,
    Verdict,
    checked_chunks,
    reachable,
    result_of,
)
from swarmgrad.node.averaging.plan import round_key
from swarmgrad.node.trust.aggregate import Aggregator
from swarmgrad.node.trust.checks import commitment, part_seed
from swarmgrad.node.trust.ledger import Flag
from swarmgrad.protocol.averaging import CHECK_STATEMENT, check_method, header_signed, seal
from swarmgrad.protocol.errors import ProtocolViolation
from swarmgrad.protocol.v1 import averaging_pb2

log = logging.getLogger(__name__)

__all__ = ["CheckBox", "CheckRun", "CheckedPart", "Verdict", "run_checks", "verify_account"]


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
    if not reachable(run, me):
        return verdict  # nobody can send this member anything: it only gave its secret
    others = {
        m
        for m in range(len(group.members))
        if m != me and reachable(run, m) and m not in run.refused
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
        own = own_rows(run, checking[me], reports)
        if own is None:
            verdict.unchecked.add(me)
        else:
            rows[me] = own
            defence = asyncio.create_task(defend(run, checking[me], reports, own, _broadcast))
    others_parts = {n: p for n, p in checking.items() if n != me}
    rows |= await gather_rows(run, others_parts, reports, verdict)
    failed: dict[int, CheckedPart] = {}
    for number, part in checking.items():
        if number not in rows:
            continue
        passed, worst = await asyncio.to_thread(
            check_part, part, rows[number], result_of(run, part), checked_chunks(run, part)
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
            judge_accusation(run, accusation, failed, rows, key, verdict)
        for number, part in failed.items():
            passed, _ = check_part(
                part, rows[number], result_of(run, part), checked_chunks(run, part)
            )
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
            if reachable(run, member) and member not in run.refused:
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
