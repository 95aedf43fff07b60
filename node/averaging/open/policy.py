"""Open runs' round policy: nothing any member sends, as owner or as member, is taken unchecked.

As a member, a node signs its chunks and takes results only with an owner's account
(``member.py``); as an owner it takes only signed chunks, aggregates robustly, observes every
member and signs an account of its part (``owner.py``); its own values stay out of its part
(nobody could check what it claims of them). After the round, before anything is applied, the
members check every owner's result together (``checks.py``): a part whose owner is convicted, or
that cannot be checked, is dropped (the caller keeps its own values there), a part whose account
came forwarded by another member is taken, and peers convicted on signed evidence are banned at
once. Then, in the background, perhaps one audit of another owner's part (``audits.py``), and,
as an owner, what it saw of each member goes to the :class:`TrustLedger`, with a spot check of a
few members' values by the loss they take off (``node/training/spot_check.py``).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

import grpc
import torch

from swarmgrad.node.averaging.coverage import cover
from swarmgrad.node.averaging.group import Group, chunk_sizes
from swarmgrad.node.averaging.open import audits
from swarmgrad.node.averaging.open.checks import CheckBox, CheckRun, Verdict, run_checks
from swarmgrad.node.averaging.open.evidence import MAX_EVIDENCE_BYTES
from swarmgrad.node.averaging.open.member import OpenMember
from swarmgrad.node.averaging.open.owner import OpenOwner
from swarmgrad.node.averaging.plan import AllReduceConfig, RoundResult, round_key
from swarmgrad.node.averaging.policy import Finished
from swarmgrad.node.averaging.sides import MemberSide, OwnerSide
from swarmgrad.node.tasks import TaskSet
from swarmgrad.node.trust.ledger import Flag, TrustLedger
from swarmgrad.protocol.auth import Signer
from swarmgrad.protocol.errors import ProtocolViolation
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

log = logging.getLogger(__name__)
_random = random.SystemRandom()

__all__ = ["LossProbe", "OpenPolicy"]


class LossProbe(Protocol):
    """What spot checks need from the trainer (``node/training/spot_check.py``)."""

    def snapshot(self) -> Callable[[str, int, int, torch.Tensor], float]:
        """Capture this round's parameters; the returned function (run off the loop) gives
        the loss a peer's values (``start``: their place in the vector) take off on windows
        drawn from (run, peer, round)."""
        ...


@dataclass(slots=True)
class _Round:
    """The policy's state of one round: the other members' check messages, this owner's side
    of its part (audits read its chunks), and the chunks served to each member."""

    box: CheckBox
    owner: OpenOwner | None = None
    served: Counter[int] = field(default_factory=Counter)


class OpenPolicy:
    """The :class:`~swarmgrad.node.averaging.policy.RoundPolicy` of open runs (module
    docstring)."""

    owner_abstains = True
    on_host = True  # the checks project the vector on the host

    def __init__(
        self,
        *,
        signer: Signer,
        config: AllReduceConfig,
        channel: Callable[[str], grpc.aio.Channel],
        ledger: TrustLedger,
        checks: Counter[str],
        background: TaskSet,
        loss_probe: Callable[[], LossProbe | None],
        linger_seconds: float,
    ) -> None:
        """``checks`` counts the owner checks and audits; ``background`` runs audits and spot
        checks; ``loss_probe`` gives the trainer's probe, once it has one."""
        self._signer, self.config, self._channel = signer, config, channel
        self.ledger, self.checks = ledger, checks
        self._background, self._loss_probe = background, loss_probe
        # An owner's chunks stay for the other members' audits a little longer.
        self.linger_seconds = linger_seconds + 2 * config.check_timeout_seconds
        self._me = signer.peer_id

    def begin(
        self, group: Group, me: int, bounds: list[tuple[int, int]], vector: torch.Tensor
    ) -> tuple[MemberSide, OwnerSide | None, object]:
        config = self.config
        member = OpenMember(signer=self._signer, config=config, group=group, me=me)
        largest = max(end - start for start, end in bounds)
        state = _Round(CheckBox(group, max_chunks=len(chunk_sizes(largest, config.chunk_values))))
        start, end = bounds[me]
        if end > start:
            state.owner = OpenOwner(
                signer=self._signer,
                key=round_key(config, group),
                group=group,
                part=me,
                offset=start,
                chunk_numels=chunk_sizes(end - start, config.chunk_values),
                probes=self._probes(group, me),
                own=vector[start:end],
            )
        return member, state.owner, state

    async def settle(self, round_: Finished) -> RoundResult:
        """Check the owners' results with the other members; take the parts whose accounts
        came forwarded, drop what fails or cannot be checked."""
        result, group, me = round_.result, round_.group, round_.me
        member = round_.member
        assert isinstance(member, OpenMember)  # this policy's own sides and state
        assert isinstance(round_.state, _Round)
        assert result.sent is not None  # kept in open rounds
        owner = round_.state.owner
        verdict = await run_checks(
            CheckRun(
                signer=self._signer,
                config=self.config,
                group=group,
                me=me,
                box=round_.state.box,
                channel=self._channel,
                result=result,
                sent=result.sent,
                member=member,
                own=round_.own_account,
                own_chunks=owner.chunks if owner is not None else (),
                refused=frozenset(
                    i for i, m in enumerate(group.members) if self.ledger.banned(m.peer_id)
                ),
            )
        )
        self._record(group.round, verdict, member, result)
        vector = round_.vector
        bounds = group.partition(vector.numel())
        contributors = dict(result.chunk_contributors)
        for number, part in verdict.parts.items():
            held = member.pending.get(number)
            if not part.forwarded or held is None or number in verdict.dropped:
                continue
            for index in part.applicable:  # forwarded, and naming the bytes it holds
                start, end = (part.start + at for at in part.span(index))
                result.averaged[start:end] = held.values[start - part.start : end - part.start]
                contributors[(number, index)] = held.contributors[index]
        for number in verdict.dropped:
            start, end = bounds[number]
            result.averaged[start:end] = vector[start:end]
            for index in range(len(chunk_sizes(end - start, self.config.chunk_values))):
                contributors.pop((number, index), None)
        # Audited against what this member applies: a part whose account came forwarded
        # holds its results only from here on, and one whose owner refused this member's
        # stream (or whose results never came) holds this member's own values, not a result.
        self._maybe_audit(group, me, verdict, result, contributors)
        if contributors == result.chunk_contributors:
            return result
        coverage = cover(group, self.config, bounds, contributors, me, abstains=True)
        return replace(
            result,
            contributors=coverage.contributors,
            partial=coverage.partial,
            missing=coverage.missing,
            chunk_contributors=contributors,
        )

    async def finish(self, group: Group, owner: OwnerSide) -> None:
        """Hand the ledger what this owner saw of each member (itself aside); spot checks."""
        assert isinstance(owner, OpenOwner)
        seen = {
            group.members[member].peer_id: observation
            for member, observation in owner.observations.items()
            if member != owner.part
        }
        self.ledger.observe(group.round, seen)
        self._spot_check(group, owner)

    async def check(
        self,
        state: object,
        member: int,
        statement: averaging_pb2.CheckStatement,
        signed: averaging_pb2.Signed,
    ) -> averaging_pb2.Chunk | None:
        """A member's check message: into the round's box; an audit's (or a stand-in's)
        request: the chunk asked for."""
        assert isinstance(state, _Round)
        if statement.WhichOneof("body") == "audit":
            return _serve(state, member, statement.audit)
        await state.box.put(member, statement, signed)
        return None

    # -- the verdict, audits, spot checks -------------------------------------------------------

    def _record(
        self, round_: int, verdict: Verdict, member: OpenMember, result: RoundResult
    ) -> None:
        self.checks["checked"] += verdict.checked
        self.checks["failed"] += verdict.failed
        if verdict.unchecked:
            self.checks["unchecked"] += len(verdict.unchecked)
        # What this node saw itself: an owner that sent it every result but no account.
        flags = dict.fromkeys(member.withheld - verdict.convicted.keys(), Flag.WITHHELD)
        flags |= dict.fromkeys(verdict.silent - verdict.convicted.keys(), Flag.SILENT)
        flags |= verdict.convicted
        flags.pop(self._me, None)
        proofs = {
            peer: e.SerializeToString(deterministic=True) for peer, e in verdict.evidence.items()
        }
        if flags:
            self.ledger.note(
                round_, flags, {p: e for p, e in proofs.items() if len(e) <= MAX_EVIDENCE_BYTES}
            )
        excluded = (
            set(result.excluded_by) | member.excluded_by | verdict.excluded_by
        ) - verdict.convicted.keys()
        if excluded:
            self.ledger.dispute(round_, sorted(excluded))
        # What others say an owner withheld from them is their word: a dispute, never a ban.
        said = {o for o, by in verdict.unaccounted_by.items() if by - {self._me}}
        said -= verdict.convicted.keys() | {self._me}
        if said:
            self.ledger.dispute(round_, sorted(said), "sent another member no account, it says")

    def _maybe_audit(
        self,
        group: Group,
        me: int,
        verdict: Verdict,
        result: RoundResult,
        applied: Mapping[tuple[int, int], object],
    ) -> None:
        """Perhaps audit one other owner's part, in the background (``audits.py``): one whose
        every chunk's result this member ``applied``."""
        candidates = [
            number
            for number, part in verdict.parts.items()
            if number != me
            and number not in verdict.dropped
            and group.members[number].endpoint
            and all((number, index) in applied for index in range(len(part.numels)))
        ]
        probability = self.config.audit_probability
        if probability is None:
            probability = 1.0 / len(group.members)
        chosen = audits.choose(candidates, probability)
        if chosen is None:
            return
        part = verdict.parts[chosen]
        end = part.start + sum(part.numels)
        job = audits.Audit(
            signer=self._signer,
            config=self.config,
            group=group,
            channel=self._channel,
            part=part,
            received=result.averaged[part.start : end].clone(),
            reports=dict(verdict.reports),
        )
        self._background.spawn(self._audit(job), name=f"audit-{group.round}-{chosen}")

    async def _audit(self, job: audits.Audit) -> None:
        round_, owner = job.group.round, job.group.members[job.part.part].peer_id
        outcome = await audits.run_audit(job)
        self.checks[f"audit_{outcome.result}"] += 1
        if outcome.result == "inconclusive":
            log.info("round %d: the audit of %s's part was inconclusive: %s",
                     round_, owner, outcome.why)  # fmt: skip
        convicted = {p: f for p, f in outcome.convicted.items() if p != self._me}
        if convicted:
            log.warning("round %d: the audit of %s's part convicted %s: %s",
                        round_, owner, sorted(convicted), outcome.why)  # fmt: skip
            self.ledger.note(round_, convicted)

    def _probes(self, group: Group, me: int) -> list[int]:
        """Members of this node's part to spot-check this round, picked at random."""
        if self._loss_probe() is None:
            return []
        others = [m for m in range(len(group.members)) if m != me]
        return _random.sample(others, min(self.config.spot_checks, len(others)))

    def _spot_check(self, group: Group, owner: OpenOwner) -> None:
        """Measure, in the background, what the probed members' values do to the loss."""
        probe = self._loss_probe()
        if probe is None:
            return
        probed = {
            m: torch.cat([v for v in chunks if v is not None])
            for m, chunks in owner.probed.items()
            if chunks and all(v is not None for v in chunks)  # dropped members: no measure
        }
        if not probed:
            return
        try:
            measure = probe.snapshot()  # the parameters of this round, taken now
        except ValueError as error:  # the trainer's probe does not fit this round's vector
            log.warning("round %d: no spot check: %s", group.round, error)
            return

        async def spot() -> None:
            for member, values in probed.items():
                peer = group.members[member].peer_id
                try:
                    gain = await asyncio.to_thread(measure, peer, group.round, owner.offset, values)
                except ValueError as error:
                    log.warning("round %d: no spot check of %s: %s", group.round, peer, error)
                    return
                self.ledger.spot(peer, gain)

        self._background.spawn(spot(), name=f"spot-check-{group.round}")


def _serve(
    state: _Round, member: int, request: averaging_pb2.AuditRequest
) -> averaging_pb2.Chunk | None:
    """The chunk an audit asks this owner for, as its member sent it (signed); None if this
    node does not hold it. Each member gets at most two audits' worth of chunks a round (an
    audit, and stand-ins for missing reports: ``reports.py``)."""
    owner = state.owner
    if owner is None or request.part != owner.part:
        raise ProtocolViolation(ResultCode.NOT_A_MEMBER, f"part {request.part} is not owned here")
    n, chunks = len(owner.group.members), len(owner.chunks)
    if request.member >= n or request.chunk >= chunks:
        raise ProtocolViolation(ResultCode.BAD_SHAPE, "an audit of a chunk the part does not have")
    # One audit (every member's chunks) and stand-ins for every member's missing report.
    if state.served[member] >= 2 * n * chunks:
        raise ProtocolViolation(ResultCode.OVERLOADED, "more chunk requests than a part has chunks")
    state.served[member] += 1
    return owner.chunks[request.chunk].get(request.member)
