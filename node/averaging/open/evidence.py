"""Open runs: proof of a broken rule that any peer can check on its own, from signatures alone.

The owner checks (``checks.py``) convict a peer on signed statements. Three convictions rest on
statements small enough to show to a peer that was not in the group:

* ``equivocation``: two different accounts one key signed for the same part of the same round;
* ``forgery``: an owner's signed account listing a commitment with a stream-header signature
  that does not hold for the member it names (the group's member list, which hashes to the
  round's group id, says who that member is and what its header held);
* ``false_secret``: a member's signed reveal whose secret does not hash to the commitment the
  member signed in its stream header (shown by the owner's signed account).

An :class:`~swarmgrad.protocol.v1.averaging_pb2.Evidence` carries those statements;
:func:`verify` checks one for a run and spec and names the peer it convicts, and of what. A
lying owner or a false projection report is proven by the part's values (megabytes), so it is
not evidence here: it stays the local ban of the members that checked it.
"""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.message import DecodeError

from swarmgrad.node.averaging.group import Group, Member
from swarmgrad.node.runspec.trust import OPEN_MAX_GROUP_SIZE
from swarmgrad.node.trust.checks import commitment
from swarmgrad.node.trust.ledger import Flag
from swarmgrad.protocol.averaging import (
    ACCOUNT_STATEMENT,
    CHECK_STATEMENT,
    StreamHeader,
    header_signed,
    unseal,
)
from swarmgrad.protocol.errors import ProtocolViolation
from swarmgrad.protocol.v1 import averaging_pb2

__all__ = [
    "MAX_EVIDENCE_BYTES",
    "REASONS",
    "EvidenceError",
    "equivocation",
    "false_secret",
    "forgery",
    "header_of",
    "verify",
    "verify_bytes",
]

#: What each kind of evidence convicts of (the ledger's flag).
REASONS = {
    "equivocation": Flag.EQUIVOCATION,
    "forgery": Flag.FORGERY,
    "false_secret": Flag.FALSE_REPORT,
}
#: Larger evidence is not published (a DHT value is small); it stays a local ban.
MAX_EVIDENCE_BYTES = 12 * 1024
#: The most members a group in evidence may list (so an open run's spec refuses larger groups).
MAX_MEMBERS = OPEN_MAX_GROUP_SIZE


class EvidenceError(ValueError):
    """Evidence that proves nothing: the message says why."""


def equivocation(a: averaging_pb2.Signed, b: averaging_pb2.Signed) -> averaging_pb2.Evidence:
    """Evidence of two accounts of one part signed by one owner."""
    return averaging_pb2.Evidence(reason="equivocation", accounts=[a, b])


def forgery(account: averaging_pb2.Signed, group: Group, member: int) -> averaging_pb2.Evidence:
    """Evidence of an owner's account listing a commitment ``member`` never signed."""
    return averaging_pb2.Evidence(
        reason="forgery", accounts=[account], members=_members(group), member=member
    )


def false_secret(
    account: averaging_pb2.Signed, group: Group, member: int, reveal: averaging_pb2.Signed
) -> averaging_pb2.Evidence:
    """Evidence of ``member`` revealing a secret other than the one it committed to."""
    return averaging_pb2.Evidence(
        reason="false_secret",
        accounts=[account],
        members=_members(group),
        member=member,
        reveal=reveal,
    )


def header_of(
    account: averaging_pb2.PartAccount, group: Group, member: int, promised: bytes
) -> StreamHeader:
    """The stream header ``member`` signed to send its values of ``account``'s part, if it
    committed to ``promised``."""
    peer = group.members[member]
    return StreamHeader(
        run_id=account.key.run_id,
        spec_hash=account.key.spec_hash,
        round=account.key.round,
        group_id=account.key.group_id,
        sender=peer.peer_id,
        receiver=group.members[account.part].peer_id,
        part=account.part,
        weight=peer.weight,
        commitment=promised,
    )


def verify_bytes(data: bytes, *, run_id: str, spec_hash: bytes) -> tuple[str, Flag, int]:
    """:func:`verify` of serialized evidence."""
    if len(data) > MAX_EVIDENCE_BYTES:
        raise EvidenceError(f"evidence of {len(data)} bytes")
    evidence = averaging_pb2.Evidence()
    try:
        evidence.ParseFromString(data)
    except DecodeError:
        raise EvidenceError("evidence that does not parse") from None
    return verify(evidence, run_id=run_id, spec_hash=spec_hash)


def verify(
    evidence: averaging_pb2.Evidence, *, run_id: str, spec_hash: bytes
) -> tuple[str, Flag, int]:
    """(the peer ``evidence`` convicts, of what, in which round), if it holds for this run and
    spec; EvidenceError otherwise."""
    flag = REASONS.get(evidence.reason)
    if flag is None:
        raise EvidenceError(f"an unknown reason {evidence.reason[:32]!r}")
    if evidence.reason == "equivocation":
        return _equivocation(evidence, run_id, spec_hash)
    if len(evidence.accounts) != 1:
        raise EvidenceError(f"{evidence.reason} shows one account")
    owner, account = _account(evidence.accounts[0], run_id, spec_hash)
    group = _group(evidence.members, account)
    if group.members[account.part].peer_id != owner:
        raise EvidenceError("the account is not signed by the part's owner")
    try:
        position = list(account.members).index(evidence.member)
    except ValueError:
        raise EvidenceError("the account lists no commitment of that member") from None
    if evidence.member >= len(group.members):
        raise EvidenceError("no such member")
    promised = account.commitments[position]
    header = header_of(account, group, evidence.member, promised)
    signed_by_member = header_signed(header, account.header_auths[position])
    if evidence.reason == "forgery":
        if signed_by_member:
            raise EvidenceError("the member did sign that commitment")
        return owner, flag, account.key.round
    if not signed_by_member:
        raise EvidenceError("the member's commitment is not shown signed")
    accused = group.members[evidence.member].peer_id
    try:
        signer, statement = unseal(evidence.reveal, CHECK_STATEMENT, averaging_pb2.CheckStatement)
    except ProtocolViolation as error:
        raise EvidenceError(f"the reveal: {error.detail}") from None
    if signer != accused or statement.sender != accused:
        raise EvidenceError("the reveal is not the member's")
    if statement.key != account.key or statement.WhichOneof("body") != "reveal":
        raise EvidenceError("the reveal is not about the account's round")
    if commitment(statement.reveal.secret) == promised:
        raise EvidenceError("the secret matches the commitment")
    return accused, flag, account.key.round


def _equivocation(
    evidence: averaging_pb2.Evidence, run_id: str, spec_hash: bytes
) -> tuple[str, Flag, int]:
    if len(evidence.accounts) != 2:
        raise EvidenceError("equivocation shows two accounts")
    first, second = evidence.accounts
    if first.body == second.body:
        raise EvidenceError("the two accounts are the same")
    signer, a = _account(first, run_id, spec_hash)
    other, b = _account(second, run_id, spec_hash)
    if signer != other or a.key != b.key or a.part != b.part:
        raise EvidenceError("the accounts are not one owner's of one part and round")
    return signer, Flag.EQUIVOCATION, a.key.round


def _account(
    signed: averaging_pb2.Signed, run_id: str, spec_hash: bytes
) -> tuple[str, averaging_pb2.PartAccount]:
    """(its signer, the account) of a signed account of this run and spec, signed by the owner
    it names."""
    try:
        signer, account = unseal(signed, ACCOUNT_STATEMENT, averaging_pb2.PartAccount)
    except ProtocolViolation as error:
        raise EvidenceError(f"an account: {error.detail}") from None
    if account.key.run_id != run_id or account.key.spec_hash != spec_hash:
        raise EvidenceError("an account of another run or spec")
    if account.owner != signer:
        raise EvidenceError("an account signed by another peer than its owner")
    if not len(account.members) == len(account.commitments) == len(account.header_auths):
        raise EvidenceError("an account with malformed commitments")
    return signer, account


def _group(
    members: Sequence[averaging_pb2.GroupMember], account: averaging_pb2.PartAccount
) -> Group:
    """The group ``members`` list, if it is the one the account's round key names."""
    if not 0 < len(members) <= MAX_MEMBERS:
        raise EvidenceError(f"a group of {len(members)} members")
    try:
        group = Group(
            round=account.key.round,
            members=tuple(
                Member(
                    peer_id=m.peer_id, endpoint=m.endpoint, bandwidth=m.bandwidth, weight=m.weight
                )
                for m in members
            ),
        )
    except ValueError as error:
        raise EvidenceError(f"a malformed group: {error}") from None
    if group.group_id != account.key.group_id:
        raise EvidenceError("the members are not the round's group")
    if account.part >= len(group.members):
        raise EvidenceError("no such part")
    return group


def _members(group: Group) -> list[averaging_pb2.GroupMember]:
    return [
        averaging_pb2.GroupMember(
            peer_id=m.peer_id, endpoint=m.endpoint, bandwidth=m.bandwidth, weight=m.weight
        )
        for m in group.members
    ]
