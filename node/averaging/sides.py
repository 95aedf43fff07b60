"""The two sides of a round a run's policy (``policy.py``) plays: a member's, an owner's.

The all-reduce (``allreduce.py``) calls a :class:`MemberSide` at its fixed points, the owner's
reducer (``reducer.py``) an :class:`OwnerSide`; a trusted run's sides (:class:`TrustedMember`,
:class:`TrustedOwner`) take everything as it comes and keep nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import torch

from swarmgrad.node.trust.aggregate import Aggregate
from swarmgrad.node.trust.ledger import Flag
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.protocol.v1.auth_pb2 import Auth

#: Chunks received of one owner's part: their contributors, by chunk index.
Received = Mapping[int, tuple[int, ...]]
#: Reads the owner's next message on a member's stream (``grpc.aio.EOF`` at its end).
Read = Callable[[], Awaitable[Any]]


class MemberSide(Protocol):
    """One member's rules for one round."""

    #: Whether the round must keep what the owners decoded of this member's values.
    keeps_sent: bool
    #: What this member's stream headers commit to.
    commitment: bytes

    def sign(self, part: int, index: int, payload: bytes | memoryview) -> bytes:
        """The signature sent with chunk ``index`` of ``part`` (empty: none)."""
        ...

    def digest(self, payload: bytes) -> bytes:
        """What this member keeps of a result it received (empty: nothing)."""
        ...

    async def take(
        self, part: int, numels: list[int], received: Received, digests: Mapping[int, bytes],
        read: Read,
    ) -> Received | None:  # fmt: skip
        """Every result of ``part`` arrived (``received``, with each payload's ``digest``):
        the chunks to apply, or None to take none of them (the stream's next messages are
        ``read``'s). A ProtocolViolation fails the owner."""
        ...

    def keep(
        self, part: int, received: Received, digests: Mapping[int, bytes], values: torch.Tensor,
        *, ended_by_owner: bool,
    ) -> Received:  # fmt: skip
        """The chunks to apply of a part that was not taken: the stream failed, or ended
        (``ended_by_owner``: the owner closed it cleanly) before its last result, or
        :meth:`take` refused them. ``values`` is the part as decoded so far."""
        ...


class OwnerSide(Protocol):
    """An owner's rules for its part of one round."""

    #: Whether the owner must keep every member's values of a chunk (not only their sum).
    buffered: bool

    def opened(self, member: int, commitment: bytes, auth: Auth | None) -> None:
        """``member``'s stream opened with this signed header."""
        ...

    def verify(self, member: int, public_key: bytes, chunk: averaging_pb2.Chunk) -> None:
        """Check ``member``'s chunk (its stream header was signed with ``public_key``) before
        anything of it is taken; ProtocolViolation refuses it (the member is dropped)."""
        ...

    def keep(self, member: int, index: int, chunk: averaging_pb2.Chunk) -> None:
        """``member``'s chunk ``index`` is taken (its values are in the part)."""
        ...

    def bound(self, index: int) -> float | None:
        """The largest norm a member's values of chunk ``index`` may have to be aggregated
        (None: any)."""
        ...

    def aggregated(
        self, index: int, members: list[int], stack: torch.Tensor, outcome: Aggregate
    ) -> None:
        """Chunk ``index`` was aggregated from ``members``' rows of ``stack``."""
        ...

    def published(self, index: int, payload: bytes | memoryview | None) -> None:
        """Chunk ``index``'s result goes out as ``payload`` (None: it has none)."""
        ...

    def flag(self, member: int, flag: Flag) -> None:
        """What ``member``'s values showed when it was dropped."""
        ...

    def account(self) -> averaging_pb2.Signed | None:
        """What the owner signs of its part once every chunk is out (sent to every member last;
        None: nothing)."""
        ...


class TrustedMember:
    keeps_sent = False
    commitment = b""

    def sign(self, part: int, index: int, payload: bytes | memoryview) -> bytes:
        return b""

    def digest(self, payload: bytes) -> bytes:
        return b""

    async def take(
        self, part: int, numels: list[int], received: Received, digests: Mapping[int, bytes],
        read: Read,
    ) -> Received | None:  # fmt: skip
        return received

    def keep(
        self, part: int, received: Received, digests: Mapping[int, bytes], values: torch.Tensor,
        *, ended_by_owner: bool,
    ) -> Received:  # fmt: skip
        return received  # what arrived is averaged: each chunk names its contributors


class TrustedOwner:
    buffered = False

    def opened(self, member: int, commitment: bytes, auth: Auth | None) -> None:
        pass

    def verify(self, member: int, public_key: bytes, chunk: averaging_pb2.Chunk) -> None:
        pass

    def keep(self, member: int, index: int, chunk: averaging_pb2.Chunk) -> None:
        pass

    def bound(self, index: int) -> float | None:
        return None

    def aggregated(
        self, index: int, members: list[int], stack: torch.Tensor, outcome: Aggregate
    ) -> None:
        pass

    def published(self, index: int, payload: bytes | memoryview | None) -> None:
        pass

    def flag(self, member: int, flag: Flag) -> None:
        pass

    def account(self) -> averaging_pb2.Signed | None:
        return None
