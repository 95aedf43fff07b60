"""Open runs: the check messages of one round a member receives from the others (``checks.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from swarmgrad.node.averaging.group import Group
from swarmgrad.node.trust.checks import PROJECTIONS, SECRET_BYTES
from swarmgrad.protocol.errors import ProtocolViolation
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

__all__ = ["CheckBox"]


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
