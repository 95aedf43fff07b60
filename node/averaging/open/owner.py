"""An open run's owner of one part: signed chunks only, every one kept, every member observed,
and a signed account of the part.

A member's chunk is taken only with its signature (so the owner can show what it sent: to
audits, in accusations, as stand-ins for a missing report). Every member's values of a chunk are
kept (the owner aggregates robustly, ``node/trust/aggregate.py``), and what each looked like goes
into an :class:`~swarmgrad.node.trust.ledger.Observation` for the node's trust ledger. Once every
result is out the owner signs a :class:`PartAccount` (per chunk: the result's hash, the
contributors with their clip coefficients and payload hashes; the members' commitments with the
stream headers' signatures), which it sends every member after the last result.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from swarmgrad.node.averaging.group import Group
from swarmgrad.node.trust.aggregate import Aggregate
from swarmgrad.node.trust.flags import Flag
from swarmgrad.node.trust.observations import Observation, observe_chunk
from swarmgrad.protocol.auth import Signer
from swarmgrad.protocol.averaging import ACCOUNT_STATEMENT, chunk_signed_by, seal
from swarmgrad.protocol.errors import ProtocolViolation
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.protocol.v1.auth_pb2 import Auth
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

__all__ = ["OWN_SCALE_LIMIT", "OpenOwner"]

#: A member whose values of a chunk are over this many times the norm of the owner's own values
#: there is left out of the chunk and flagged ``outsized``, in a chunk of any size: the owner's
#: own update stays out of its part, and is the one honest measure no colluding majority of the
#: others can move. Honest pseudo-gradients of one run differ by a few times at most; x100
#: attackers that were most of a group of 4 decided honest owners' parts without it.
OWN_SCALE_LIMIT = 20.0


class OpenOwner:
    """One owner's side of its part in an open round (module docstring)."""

    buffered = True

    def __init__(
        self,
        *,
        signer: Signer,
        key: averaging_pb2.RoundKey,
        group: Group,
        part: int,
        offset: int,
        chunk_numels: Sequence[int],
        probes: Sequence[int] = (),
        own: torch.Tensor | None = None,
    ) -> None:
        """``offset``: where the part starts in the round's vector (names chunks for replay
        checks); ``probes``: members whose values of the part are kept whole, for a spot check
        after the round; ``own``: the owner's own values of the part, which stay out of it but
        measure the members' size (:data:`OWN_SCALE_LIMIT`)."""
        self._signer, self.key, self.group, self.part = signer, key, group, part
        self.offset, self.chunk_numels = offset, list(chunk_numels)
        self._own = own
        n = len(self.chunk_numels)
        #: Each member's chunks as received (signed), by chunk.
        self.chunks: list[dict[int, averaging_pb2.Chunk]] = [{} for _ in range(n)]
        self._digests: list[dict[int, bytes]] = [{} for _ in range(n)]
        self._accounts = [averaging_pb2.ChunkAccount() for _ in range(n)]
        self.commitments: dict[int, tuple[bytes, Auth]] = {}
        #: What the owner saw of each member, by member index.
        self.observations: dict[int, Observation] = {}
        #: The values of the members in ``probes``, by chunk (None: not received).
        self.probed: dict[int, list[torch.Tensor | None]] = {m: [None] * n for m in probes}

    def opened(self, member: int, commitment: bytes, auth: Auth | None) -> None:
        if commitment and auth is not None:
            self.commitments[member] = (commitment, auth)

    def verify(self, member: int, public_key: bytes, chunk: averaging_pb2.Chunk) -> None:
        sender = self.group.members[member].peer_id
        if not chunk_signed_by(public_key, self.key, sender, self.part, chunk):
            raise ProtocolViolation(
                ResultCode.UNAUTHENTICATED, f"chunk {chunk.index} is not signed by {sender}"
            )

    def keep(self, member: int, index: int, chunk: averaging_pb2.Chunk) -> None:
        kept = averaging_pb2.Chunk()
        kept.CopyFrom(chunk)
        self.chunks[index][member] = kept
        self._digests[index][member] = hashlib.sha256(chunk.payload).digest()

    def aggregated(
        self, index: int, members: list[int], stack: torch.Tensor, outcome: Aggregate
    ) -> None:
        for member, kept in self.probed.items():
            if member in members:
                kept[index] = stack[members.index(member)].clone()
        account = self._accounts[index]
        for k in outcome.used:
            account.contributors.append(members[k])
            account.clip.append(outcome.clip[k])
            account.payload_sha256.append(self._digests[index].get(members[k], b""))
        position = (self.offset + sum(self.chunk_numels[:index]), self.chunk_numels[index])
        observe_chunk(self.observations, members, stack, outcome, position)

    def bound(self, index: int) -> float | None:
        if self._own is None:
            return None
        start = sum(self.chunk_numels[:index])
        norm = float(self._own[start : start + self.chunk_numels[index]].norm())
        return OWN_SCALE_LIMIT * norm if norm > 0 else None

    def published(self, index: int, payload: bytes | memoryview | None) -> None:
        if payload is not None:
            self._accounts[index].result_sha256 = hashlib.sha256(payload).digest()

    def flag(self, member: int, flag: Flag) -> None:
        self.observations.setdefault(member, Observation()).flags.add(flag)

    def account(self) -> averaging_pb2.Signed | None:
        members = sorted(self.commitments)
        account = averaging_pb2.PartAccount(
            key=self.key,
            owner=self.group.members[self.part].peer_id,
            part=self.part,
            chunks=self._accounts,
            members=members,
            commitments=[self.commitments[m][0] for m in members],
            header_auths=[self.commitments[m][1] for m in members],
        )
        return seal(self._signer, ACCOUNT_STATEMENT, account)
