"""The round's seam: what a run's trust rules do at a round's fixed points.

A round has one skeleton: the member's streams under one deadline (``allreduce.py``), the
owner's aggregation (``reducer.py``), the registry of rounds and the Averaging service
(``averager.py``). It calls its run's :class:`RoundPolicy` at fixed points:

* as a member, through a :class:`MemberSide` made for the round: what its stream headers commit
  to, what it signs of each chunk it sends, how it takes an owner's results once they are all in,
  and what it keeps of a part whose results it did not take;
* as an owner, through an :class:`OwnerSide` made for its part: what it checks and keeps of each
  member's chunk, what it notes of each aggregated chunk, what it signs once its part is out;
* after the round (:meth:`RoundPolicy.settle`: what the members check together, what is applied)
  and after the owner's part is done (:meth:`RoundPolicy.finish`: what it judged of the members);
* for the check messages members send each other (:meth:`RoundPolicy.check`).

A trusted run's policy, :class:`TrustedPolicy`, takes every result as it comes and does nothing
else. Open runs' policy, with its checks, audits and evidence, is a room of its own
(``node/averaging/open/``). How an owner combines the members' values is another component, an
aggregation rule chosen by the run spec (``node/trust/aggregate.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from swarmgrad.node.averaging.group import Group
from swarmgrad.node.averaging.plan import RoundResult
from swarmgrad.node.averaging.sides import MemberSide, OwnerSide, TrustedMember, TrustedOwner
from swarmgrad.protocol.errors import ProtocolViolation
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode


@dataclass(slots=True, kw_only=True)
class Finished:
    """One member's round, as the all-reduce left it, for :meth:`RoundPolicy.settle`."""

    result: RoundResult
    #: The caller's vector (its values stay where a part is not applied).
    vector: torch.Tensor
    group: Group
    me: int
    member: MemberSide
    owner: OwnerSide | None
    #: What this owner sent every member after its part (None: nothing, or it owns none).
    own_account: averaging_pb2.Signed | None
    #: The policy's state of the round (:meth:`RoundPolicy.begin`).
    state: object


class RoundPolicy(Protocol):
    """A run's trust rules for its rounds (see the module docstring)."""

    #: Whether an owner's own values stay out of its part.
    owner_abstains: bool
    #: Whether a round's vector must be on the host (its checks run there).
    on_host: bool
    #: How long a finished round keeps answering its members (results, checks, audits).
    linger_seconds: float

    def begin(
        self, group: Group, me: int, bounds: list[tuple[int, int]], vector: torch.Tensor
    ) -> tuple[MemberSide, OwnerSide | None, object]:
        """This member's side of a new round, its side as the owner of its part (None: it owns
        none; ``bounds``: every part's [start, end); ``vector``: this member's values, which the
        round never modifies), and the policy's state of the round."""
        ...

    async def settle(self, round_: Finished) -> RoundResult:
        """The round's result as the caller is to apply it."""
        ...

    async def finish(self, group: Group, owner: OwnerSide) -> None:
        """After this owner's part is done (aborted rounds too)."""
        ...

    async def check(
        self,
        state: object,
        member: int,
        statement: averaging_pb2.CheckStatement,
        signed: averaging_pb2.Signed,
    ) -> averaging_pb2.Chunk | None:
        """A check message ``member`` sent this node about the round (the Averaging service's
        Check); ProtocolViolation refuses it."""
        ...


class TrustedPolicy:
    """Every peer is honest: results are applied as they come, nothing is checked."""

    owner_abstains = False
    on_host = False

    def __init__(self, linger_seconds: float) -> None:
        self.linger_seconds = linger_seconds

    def begin(
        self, group: Group, me: int, bounds: list[tuple[int, int]], vector: torch.Tensor
    ) -> tuple[MemberSide, OwnerSide | None, object]:
        start, end = bounds[me]
        return TrustedMember(), TrustedOwner() if end > start else None, None

    async def settle(self, round_: Finished) -> RoundResult:
        return round_.result

    async def finish(self, group: Group, owner: OwnerSide) -> None:
        pass

    async def check(
        self,
        state: object,
        member: int,
        statement: averaging_pb2.CheckStatement,
        signed: averaging_pb2.Signed,
    ) -> averaging_pb2.Chunk | None:
        raise ProtocolViolation(ResultCode.UNKNOWN_ROUND, "this round runs no checks")
