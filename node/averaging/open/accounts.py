"""Open runs: the owners' signed accounts of their parts, at the door and among the members.

An owner ends every member's stream with a signed :class:`PartAccount` of its part (per chunk:
the result's hash, the contributors with their clip coefficients and payload hashes; the
commitments the members' stream headers carried). :func:`verify_account` takes one only if it is
exact (every field its one size, every header signature in its member's key) and, where given,
names the very bytes this member received.

An owner can leave a member without its account (it ends the stream early, or never sends it).
Every member forwards the accounts it got in its reveal (``checks.py``), so one that got none
takes the part's account from another (:func:`take_forwarded`): it can then report its values
of the part like everyone else, and apply the result if the account names the bytes it holds.
Two different accounts one owner signed for one part are equivocation, whoever forwarded them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from swarmgrad.node.averaging.group import Group
from swarmgrad.node.averaging.open import evidence
from swarmgrad.protocol.auth import NONCE_BYTES
from swarmgrad.protocol.averaging import ACCOUNT_STATEMENT, unseal
from swarmgrad.protocol.errors import ProtocolViolation
from swarmgrad.protocol.keys import KEY_BYTES, SIGNATURE_BYTES, peer_id_of
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

__all__ = ["CheckedPart", "Forwarded", "PendingPart", "take_forwarded", "verify_account"]


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


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingPart:
    """What arrived of another owner's part without a valid account of it (the checks may
    still take it, with an account another member forwards)."""

    #: Per chunk received: its contributors and the SHA-256 of its payload.
    contributors: Mapping[int, tuple[int, ...]]
    digests: Mapping[int, bytes]
    #: The part's values as decoded (chunks not received: undefined).
    values: torch.Tensor
    #: Whether every chunk of the part arrived.
    complete: bool


@dataclass(slots=True)
class CheckedPart:
    """A part whose account this member holds, as its checks see it."""

    part: int
    account: averaging_pb2.PartAccount
    signed: averaging_pb2.Signed
    start: int
    numels: list[int]
    seed: bytes = b""
    #: Chunks this member may apply: with an account from the owner itself, every one it
    #: received; with a forwarded one, those it holds bytes of that the account names.
    applicable: set[int] = field(default_factory=set)
    #: Whether the account came forwarded by another member (the owner sent it none).
    forwarded: bool = False

    def span(self, index: int) -> tuple[int, int]:
        """[start, end) of chunk ``index`` within the part."""
        start = sum(self.numels[:index])
        return start, start + self.numels[index]

    def contributors(self) -> set[int]:
        """Every member whose values are in some chunk of the part."""
        return {m for chunk in self.account.chunks for m in chunk.contributors}

    def chunks_of(self, member: int) -> list[int]:
        """The chunks ``member``'s values are in."""
        return [i for i, chunk in enumerate(self.account.chunks) if member in chunk.contributors]

    def clip(self, index: int, member: int) -> float:
        chunk = self.account.chunks[index]
        return chunk.clip[list(chunk.contributors).index(member)]


@dataclass(slots=True, kw_only=True)
class Forwarded:
    """What taking the accounts other members forwarded found."""

    #: Owners convicted of equivocation, with the evidence, and the parts they lose.
    convicted: dict[str, averaging_pb2.Evidence] = field(default_factory=dict)
    dropped: set[int] = field(default_factory=set)
    #: Owners whose forwarded account leaves out (or alters) this member's values it sent them.
    excluded_by: set[str] = field(default_factory=set)


def take_forwarded(
    signed: averaging_pb2.Signed,
    *,
    group: Group,
    me: int,
    key: averaging_pb2.RoundKey,
    parts: dict[int, CheckedPart],
    layout: Callable[[int], tuple[int, list[int]]],
    pending: Mapping[int, PendingPart],
    sent_digests: Mapping[tuple[int, int], bytes],
    found: Forwarded,
) -> None:
    """Take one account another member forwarded: evidence of equivocation if its owner signed
    another for the same part, the part's account if this member has none (``layout``: a part's
    start and chunk sizes; ``pending``: what it received of parts without an account)."""
    if any(signed.body == p.signed.body for p in parts.values()):
        return  # the same bytes as one this member holds: nothing to learn
    try:
        signer, account = unseal(signed, ACCOUNT_STATEMENT, averaging_pb2.PartAccount)
    except ProtocolViolation:
        return  # a forwarded account that does not verify proves nothing against its owner
    number = account.part
    if (
        account.key != key
        or not 0 <= number < len(group.members)
        or signer != group.members[number].peer_id
    ):
        return
    mine = parts.get(number)
    if mine is not None:
        found.dropped.add(number)
        found.convicted[signer] = evidence.equivocation(mine.signed, signed)
        return
    start, numels = layout(number)
    try:
        account = verify_account(signed, group=group, key=key, part=number, numels=numels)
    except ProtocolViolation:
        return  # malformed: no use to anyone, and no proof of anything
    part = CheckedPart(number, account, signed, start, numels, forwarded=True)
    held = pending.get(number)
    if held is not None:
        part.applicable = {
            index
            for index, digest in held.digests.items()
            if account.chunks[index].result_sha256 == digest
            and sorted(account.chunks[index].contributors) == sorted(held.contributors[index])
        }
    for index in range(len(numels)):
        digest = sent_digests.get((number, index))
        chunk = account.chunks[index]
        members = list(chunk.contributors)
        if digest is not None and (
            me not in members or chunk.payload_sha256[members.index(me)] != digest
        ):
            found.excluded_by.add(signer)
    parts[number] = part
