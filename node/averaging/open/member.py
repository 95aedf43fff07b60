"""An open run's member in one round: it commits to a secret, signs every chunk it sends, and
takes an owner's results only with the owner's signed account of them.

The secret's commitment goes in every stream header, and the secret is revealed only after every
account is out (``checks.py``). Each chunk is signed, so an owner can show what a member sent.
An owner ends each member's stream with its signed account of the part; a member takes the
part's results only if the account holds and names the very bytes it received. Without one (the
owner withheld it, or ended the stream early) the results wait as a :class:`PendingPart` for an
account another member forwards; an owner that sent every result but no valid account, or
closed the stream cleanly before its last result, has *withheld* it: this member saw that
itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from collections.abc import Mapping

import grpc
import torch

from swarmgrad.node.averaging.group import Group, chunk_sizes
from swarmgrad.node.averaging.open.accounts import PendingPart, verify_account
from swarmgrad.node.averaging.plan import AllReduceConfig, round_key
from swarmgrad.node.averaging.sides import Read, Received
from swarmgrad.node.trust.checks import SECRET_BYTES, commitment
from swarmgrad.protocol.auth import Signer
from swarmgrad.protocol.averaging import sign_chunk
from swarmgrad.protocol.errors import ProtocolViolation, SwarmgradError
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

__all__ = ["OpenMember", "PendingPart"]


class OpenMember:
    """One member's side of an open round (module docstring)."""

    keeps_sent = True  # the checks project what the owners decoded of this member's values

    def __init__(self, *, signer: Signer, config: AllReduceConfig, group: Group, me: int) -> None:
        self._signer, self._config, self._group, self.me = signer, config, group, me
        self.key = round_key(config, group)
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self.commitment = commitment(self.secret)
        #: The SHA-256 of each payload this member sent, by (part, chunk).
        self.sent_digests: dict[tuple[int, int], bytes] = {}
        #: Each other owner's signed account as received, by part, and the same parsed.
        self.accounts: dict[int, averaging_pb2.Signed] = {}
        self.verified: dict[int, averaging_pb2.PartAccount] = {}
        #: Parts received without a valid account, and owners that withheld one from it.
        self.pending: dict[int, PendingPart] = {}
        self.withheld: set[str] = set()
        #: Owners whose account counted other values as this member's.
        self.excluded_by: set[str] = set()

    def sign(self, part: int, index: int, payload: bytes | memoryview) -> bytes:
        self.sent_digests[(part, index)] = hashlib.sha256(payload).digest()
        return sign_chunk(self._signer, self.key, part, index, payload)

    def digest(self, payload: bytes) -> bytes:
        return hashlib.sha256(payload).digest()

    async def take(
        self, part: int, numels: list[int], received: Received, digests: Mapping[int, bytes],
        read: Read,
    ) -> Received | None:  # fmt: skip
        """Read the owner's signed account after its last result and take the part with it;
        without a valid one the owner withheld it (ProtocolViolation: the owner failed)."""
        group, config = self._group, self._config
        owner = group.members[part].peer_id
        try:
            async with asyncio.timeout(config.reducer_timeout_seconds):
                response = await read()
            if response is grpc.aio.EOF or not response.HasField("account"):
                raise ProtocolViolation(
                    ResultCode.BAD_PAYLOAD, f"{owner} sent no account of its part"
                )
            account = verify_account(
                response.account,
                group=group,
                key=self.key,
                part=part,
                numels=numels,
                results=digests,
                contributors=received,
            )
        except TimeoutError:
            self.withheld.add(owner)
            why = f"{owner} sent no account of its part within {config.reducer_timeout_seconds:g} s"
            raise ProtocolViolation(ResultCode.TIMED_OUT, why) from None
        except (grpc.aio.AioRpcError, SwarmgradError):
            self.withheld.add(owner)
            raise
        self.accounts[part] = response.account
        self.verified[part] = account
        for index, contributors in received.items():
            if self.me in contributors and account.chunks[index].payload_sha256[
                list(contributors).index(self.me)
            ] != self.sent_digests.get((part, index)):
                self.excluded_by.add(owner)  # it counted other values as ours
        return received

    def keep(
        self, part: int, received: Received, digests: Mapping[int, bytes], values: torch.Tensor,
        *, ended_by_owner: bool,
    ) -> Received:  # fmt: skip
        """Nothing is applied without an account: what arrived waits for a forwarded one."""
        if ended_by_owner:  # an honest owner ends a stream early only with an error status
            self.withheld.add(self._group.members[part].peer_id)
        if not received:
            return {}
        numels = chunk_sizes(values.numel(), self._config.chunk_values)
        self.pending[part] = PendingPart(
            contributors=dict(received),
            digests=dict(digests),
            values=values.clone(),
            complete=len(received) == len(numels),
        )
        return {}
