"""Signed requests: how a receiver knows which peer sent a request, and that it is fresh.

Every RPC that acts for a peer (an all-reduce stream in its name, a state download, a dial-back,
a punch) carries an :class:`Auth`: the sender's Ed25519 public key, its clock, a random nonce and
a signature. The signature is not over the message's protobuf encoding (which is not canonical)
but over :func:`signed_bytes`: the method's name, the receiver's peer id, the auth fields and the
request's own fields, each typed and length-prefixed, so one signature is good for one method,
one receiver and one request. A :class:`Verifier` checks, cheapest first: sizes, that the key
hashes to the claimed sender, the receiver, the clock window, the signature, and last that the
(key, nonce) pair is new (a :class:`ReplayGuard`, bounded in memory). Any failure is a
``ProtocolViolation(UNAUTHENTICATED)``.

What this does not give: confidentiality or integrity against someone on the path (there is no
TLS; a relay carries plain HTTP/2). The threat it stops is the one a DHT invites: anyone can read
every endpoint, round number and group id, so without signatures anyone could speak for anyone.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from swarmgrad.protocol.errors import ProtocolViolation, quote
from swarmgrad.protocol.keys import KEY_BYTES, SIGNATURE_BYTES, peer_id_of, verify_signature
from swarmgrad.protocol.v1.auth_pb2 import Auth
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

NONCE_BYTES = 16
#: How far a request's clock may be from the receiver's, either way. Peers' clocks must already
#: agree to well within a DHT record's lifetime (60 s by default) for records to be believed.
CLOCK_WINDOW_SECONDS = 60.0
#: (key, nonce) pairs a receiver remembers. When full, the oldest go first: a flood of fresh
#: requests can shorten the memory (never refuse an honest request); replaying a request needs
#: its bytes, which only someone on the path has.
REPLAY_MEMORY = 1 << 16

Field = str | bytes | int | float


class Signer(Protocol):
    """What signs requests: a node's :class:`swarmgrad.node.identity.Identity`."""

    @property
    def peer_id(self) -> str: ...

    @property
    def public_key(self) -> bytes: ...

    def sign(self, message: bytes) -> bytes: ...


def signed_bytes(method: str, receiver: str, fields: Sequence[Field]) -> bytes:
    """The bytes a request's signature covers: each value typed and length-prefixed, so no two
    different requests encode alike."""
    parts = [b"swarmgrad/v1\0", _field(method), _field(receiver)]
    parts += [_field(value) for value in fields]
    return b"".join(parts)


def _field(value: Field) -> bytes:
    if isinstance(value, bool):  # a bool is an int to Python; no request field is one
        raise TypeError("bool is not a signed field type")
    if isinstance(value, str):
        data = value.encode()
        return b"s" + struct.pack("<I", len(data)) + data
    if isinstance(value, bytes):
        return b"b" + struct.pack("<I", len(value)) + value
    if isinstance(value, int):  # request fields are unsigned, up to 64 bits
        return b"i" + struct.pack("<Q", value)
    return b"f" + struct.pack("<d", value)


def sign_request(signer: Signer, method: str, receiver: str, fields: Sequence[Field]) -> Auth:
    """The :class:`Auth` for a request of ``method`` to ``receiver`` with ``fields``."""
    auth = Auth(
        public_key=signer.public_key, issued_at=time.time(), nonce=secrets.token_bytes(NONCE_BYTES)
    )
    auth.signature = signer.sign(signed_bytes(method, receiver, _with_auth(auth, fields)))
    return auth


def _with_auth(auth: Auth, fields: Sequence[Field]) -> list[Field]:
    return [auth.public_key, auth.issued_at, auth.nonce, *fields]


class ReplayGuard:
    """The (key, nonce) pairs seen within the clock window, at most ``max_entries``."""

    def __init__(self, max_entries: int = REPLAY_MEMORY) -> None:
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # key + nonce -> forget after
        self._max = max_entries
        #: Pairs forgotten before their time because the memory was full.
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._seen)

    def first_time(self, public_key: bytes, nonce: bytes, now: float) -> bool:
        """Remember the pair; whether it was new."""
        while self._seen and next(iter(self._seen.values())) <= now:
            self._seen.popitem(last=False)
        pair = public_key + nonce
        if pair in self._seen:
            return False
        if len(self._seen) >= self._max:
            self._seen.popitem(last=False)
            self.evicted += 1
        # Kept for two windows: a request issued a window ahead of our clock stays valid that long.
        self._seen[pair] = now + 2 * CLOCK_WINDOW_SECONDS
        return True


class Verifier:
    """Checks the requests this node (``me``) receives."""

    def __init__(
        self,
        me: str,
        *,
        replay: ReplayGuard | None = None,
        admit: Callable[[str], bool] | None = None,
    ) -> None:
        """``admit``: whether an authenticated peer may be served at all (a private run's
        allowlist); refused peers get NOT_ALLOWED."""
        self.me = me
        self._replay = replay or ReplayGuard()
        self.admit = admit

    @property
    def replay(self) -> ReplayGuard:
        return self._replay

    def verify(
        self,
        method: str,
        auth: Auth,
        *,
        receiver: str,
        fields: Sequence[Field],
        sender: str | None = None,
    ) -> str:
        """The sender's peer id, once ``auth`` proves it sent this request to this node now;
        ``sender`` is the peer id the request claims, if it names one."""

        def refuse(why: str) -> ProtocolViolation:
            return ProtocolViolation(ResultCode.UNAUTHENTICATED, why)

        if (
            len(auth.public_key) != KEY_BYTES
            or len(auth.signature) != SIGNATURE_BYTES
            or len(auth.nonce) != NONCE_BYTES
        ):
            raise refuse("the request is not signed (key, nonce or signature missing)")
        peer = peer_id_of(auth.public_key)
        if sender is not None and sender != peer:
            raise refuse(f"signed with the key of {peer}, not of {quote(sender)}")
        if receiver != self.me:
            raise refuse(f"meant for {quote(receiver)}, not for this peer ({self.me})")
        now = time.time()
        if not math.isfinite(auth.issued_at) or abs(now - auth.issued_at) > CLOCK_WINDOW_SECONDS:
            raise refuse(
                f"issued at {auth.issued_at:.0f}, {now - auth.issued_at:+.0f} s from this peer's "
                f"clock (the window is {CLOCK_WINDOW_SECONDS:g} s)"
            )
        message = signed_bytes(method, receiver, _with_auth(auth, fields))
        if not verify_signature(auth.public_key, auth.signature, message):
            raise refuse(f"bad signature from {peer}")
        if not self._replay.first_time(auth.public_key, auth.nonce, now):
            raise refuse(f"a replayed request from {peer}")
        if self.admit is not None and not self.admit(peer):
            raise ProtocolViolation(
                ResultCode.NOT_ALLOWED, f"{peer} is not on this private run's allowlist"
            )
        return peer


def signature_holds(
    auth: Auth, method: str, receiver: str, fields: Sequence[Field], *, signer: str
) -> bool:
    """Whether ``auth`` is ``signer``'s signature of a request (``method`` to ``receiver`` with
    ``fields``), whenever it was sent: for a third party checking a forwarded request, not for
    its receiver (no clock window, no replay memory)."""
    if len(auth.public_key) != KEY_BYTES or peer_id_of(auth.public_key) != signer:
        return False
    message = signed_bytes(method, receiver, _with_auth(auth, fields))
    return verify_signature(auth.public_key, auth.signature, message)


# -- statements: signed for anyone ------------------------------------------------------------

#: What a statement's receiver is: nobody in particular (any member may check it, or forward it).
ANYONE = ""


def sign_statement(signer: Signer, kind: str, body: bytes) -> Auth:
    """Sign ``body`` (a serialized message) as a statement of ``kind`` that anyone can check:
    the signature covers the kind and the body's SHA-256, not a receiver or a clock window."""
    return sign_request(signer, kind, ANYONE, [hashlib.sha256(body).digest()])


def verify_statement(auth: Auth, kind: str, body: bytes) -> str:
    """The peer id that signed ``body`` as a statement of ``kind``; ProtocolViolation
    (UNAUTHENTICATED) if the signature does not hold."""
    if (
        len(auth.public_key) != KEY_BYTES
        or len(auth.signature) != SIGNATURE_BYTES
        or len(auth.nonce) != NONCE_BYTES
    ):
        raise ProtocolViolation(ResultCode.UNAUTHENTICATED, f"the {kind} is not signed")
    message = signed_bytes(kind, ANYONE, _with_auth(auth, [hashlib.sha256(body).digest()]))
    if not verify_signature(auth.public_key, auth.signature, message):
        peer = peer_id_of(auth.public_key)
        raise ProtocolViolation(ResultCode.UNAUTHENTICATED, f"bad signature on {peer}'s {kind}")
    return peer_id_of(auth.public_key)
