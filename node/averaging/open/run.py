"""Open runs: one member's view of one round for its checks (:class:`CheckRun`), and what they
found (:class:`Verdict`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from swarmgrad.node.averaging.group import Group
from swarmgrad.node.averaging.open.accounts import CheckedPart
from swarmgrad.node.averaging.open.box import CheckBox
from swarmgrad.node.averaging.open.member import OpenMember
from swarmgrad.node.averaging.open.reports import listed_values
from swarmgrad.node.averaging.plan import AllReduceConfig, RoundResult
from swarmgrad.node.trust.ledger import Flag
from swarmgrad.protocol.auth import Signer
from swarmgrad.protocol.v1 import averaging_pb2

__all__ = [
    "CheckRun",
    "Verdict",
    "checked_chunks",
    "own_values",
    "reachable",
    "result_of",
]


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


def reachable(run: CheckRun, member: int) -> bool:
    """Whether ``member`` can receive check messages: one with no endpoint (it accepts no
    connections) gets no reveals, so it cannot report; the parts it sent to are checked with its
    signed chunks instead, and it is not held silent for it."""
    return bool(run.group.members[member].endpoint)


def result_of(run: CheckRun, part: CheckedPart) -> Callable[[int], torch.Tensor]:
    """The result this member holds of a chunk of ``part`` (from its owner, or kept while its
    account was missing)."""
    pending = run.member.pending.get(part.part) if part.forwarded else None

    def result(index: int) -> torch.Tensor:
        start, end = part.span(index)
        if pending is not None:
            return pending.values[start:end]
        return run.result.averaged[part.start + start : part.start + end]

    return result


def checked_chunks(run: CheckRun, part: CheckedPart) -> set[int]:
    """The chunks of ``part`` this member checks: those it holds results of (all, as owner)."""
    if part.part == run.me:
        return {i for i, chunk in enumerate(part.account.chunks) if len(chunk.contributors)}
    return set(part.applicable)


def own_values(run: CheckRun, part: CheckedPart, member: int) -> dict[int, torch.Tensor] | None:
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
