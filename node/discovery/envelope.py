"""Signed DHT values: every value a swarmgrad node stores is sealed by its signer to one key, one
subkey, one kind and one lifetime, so that no other key can take its place.

A DHT stores what anyone sends, and keeps one value per (key, subkey): the latest expiry wins. A
value readers merely verify can still be *replaced* by a forgery with a later expiry (hiding the
peer), by an unsigned empty "leave", or by a plain value over the whole key. So the DHT nodes
themselves refuse what is not a sealed value filed where its seal says (:func:`check_filing`, run
by both backends: hivemind's record validator in its DHT process, the libp2p sidecar's
directory), and readers check again.

Layout (all integers little-endian)::

    b"sgv1" | public key (32) | issued_at, expires_at (2 x f64) | kind (u8)
            | key length (u16) | key (UTF-8) | body length (u32) | body | signature (64)

The signature covers everything before it, prefixed with ``b"swarmgrad/dht/v1\\0"``. The subkey
of a sealed value must be its signer's peer id: nobody can write another peer's slot. A value
lives at most :data:`MAX_TTL_SECONDS` and must be stored with exactly the expiry it was sealed
with: a replayed value cannot be made to live longer. Pure (no hivemind, no libp2p, no gRPC): both
backends' processes import it.
"""

from __future__ import annotations

import enum
import math
import re
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from swarmgrad.protocol.keys import KEY_BYTES, SIGNATURE_BYTES, peer_id_of, verify_signature

MAGIC = b"sgv1"
_DOMAIN = b"swarmgrad/dht/v1\0"
_HEAD = struct.Struct("<4s32sddBH")
MAX_VALUE_BYTES = 24 * 1024
MAX_KEY_CHARS = 256
#: No value lives longer than this: peers re-announce every 15 s (records live 60 s by default).
MAX_TTL_SECONDS = 180.0
#: How far ahead of a DHT node's clock a value may say it was issued.
CLOCK_SKEW_SECONDS = 60.0

_RUN = r"[A-Za-z0-9._-]{1,64}"
_PEERS = re.compile(rf"run/{_RUN}/[0-9a-f]{{64}}/peers")
_ROUND = re.compile(rf"run/{_RUN}/[0-9a-f]{{64}}/round/(0|[1-9][0-9]{{0,18}})")
_SPECS = re.compile(rf"run/{_RUN}/specs")
_ALLOWLIST = re.compile(rf"run/{_RUN}/[0-9a-f]{{64}}/allowlist")
_BANS = re.compile(rf"run/{_RUN}/[0-9a-f]{{64}}/bans")
#: Where organizers publish their runs: one slot per run key.
RUNS_KEY = "runs"


class RecordError(ValueError):
    """A DHT value that must not be stored or believed; the message says why."""


class Kind(enum.IntEnum):
    PEER = 1  # a peer record, under .../peers
    READY = 2  # readiness for a round, under .../round/<r>
    SPEC = 3  # a canonical run spec, under run/<id>/specs
    LEAVE = 4  # a withdrawal (tombstone) of the signer's value under any of those keys
    RUN = 5  # a run published by its organizer's run key, under "runs"
    ALLOWLIST = 6  # a private run's allowlist, signed by its run key, under .../allowlist
    BANS = 7  # an open run's ban records with their evidence, by the node that holds them


def allowed_kinds(key: str) -> tuple[Kind, ...]:
    """The kinds of value that may be filed under ``key`` (none: not a swarmgrad key)."""
    if _PEERS.fullmatch(key):
        return (Kind.PEER, Kind.LEAVE)
    if _ROUND.fullmatch(key):
        return (Kind.READY, Kind.LEAVE)
    if _SPECS.fullmatch(key):
        return (Kind.SPEC, Kind.LEAVE)
    if key == RUNS_KEY:
        return (Kind.RUN, Kind.LEAVE)
    if _ALLOWLIST.fullmatch(key):
        return (Kind.ALLOWLIST, Kind.LEAVE)
    if _BANS.fullmatch(key):
        return (Kind.BANS, Kind.LEAVE)
    return ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Envelope:
    key: str
    kind: Kind
    public_key: bytes
    issued_at: float
    expires_at: float
    body: bytes

    @property
    def signer(self) -> str:
        """The peer id of the key that sealed it."""
        return peer_id_of(self.public_key)


class Sealer(Protocol):
    """What seals values: a node's :class:`~swarmgrad.node.identity.Identity`."""

    @property
    def public_key(self) -> bytes: ...

    def sign(self, message: bytes) -> bytes: ...


def seal(
    identity: Sealer, *, key: str, kind: Kind, body: bytes, issued_at: float, expires_at: float
) -> bytes:
    """``body`` sealed by ``identity`` for ``key`` as ``kind``, living until ``expires_at``."""
    raw_key = key.encode()
    if len(raw_key) > MAX_KEY_CHARS:
        raise ValueError(f"a DHT key of {len(raw_key)} bytes")
    unsigned = b"".join(
        (
            _HEAD.pack(MAGIC, identity.public_key, issued_at, expires_at, kind, len(raw_key)),
            raw_key,
            struct.pack("<I", len(body)),
            body,
        )
    )
    value = unsigned + identity.sign(_DOMAIN + unsigned)
    if len(value) > MAX_VALUE_BYTES:
        raise ValueError(f"a DHT value of {len(value)} bytes (at most {MAX_VALUE_BYTES})")
    return value


class OverBudget(RecordError):
    """A value new to this DHT node from a storer that has used up its checks for now
    (``check_budget.py``): refused before any of them."""


def peek(value: object) -> Envelope:
    """A sealed value's fields, its signature NOT checked: for the checks cheaper than the
    signature's, made first (a value they refuse costs no signature check). Never believe what
    it returns before :func:`open_envelope`. RecordError for anything malformed."""
    if not isinstance(value, bytes):
        raise RecordError("not a byte string")
    if not _HEAD.size + 4 + SIGNATURE_BYTES <= len(value) <= MAX_VALUE_BYTES:
        raise RecordError(f"a value of {len(value)} bytes")
    magic, public_key, issued_at, expires_at, kind, key_length = _HEAD.unpack_from(value)
    if magic != MAGIC:
        raise RecordError("not a sealed swarmgrad value")
    body_start = _HEAD.size + key_length + 4
    if body_start > len(value) - SIGNATURE_BYTES:
        raise RecordError("a value whose lengths do not add up")
    (body_length,) = struct.unpack_from("<I", value, body_start - 4)
    if body_start + body_length + SIGNATURE_BYTES != len(value):
        raise RecordError("a value whose lengths do not add up")
    if len(public_key) != KEY_BYTES:
        raise RecordError("a bad signature")
    try:
        key = value[_HEAD.size : _HEAD.size + key_length].decode()
        kind = Kind(kind)
    except (UnicodeDecodeError, ValueError):
        raise RecordError("an unknown kind or a key that is not UTF-8") from None
    if not (math.isfinite(issued_at) and math.isfinite(expires_at)):
        raise RecordError("a time that is not finite")
    return Envelope(
        key=key,
        kind=kind,
        public_key=public_key,
        issued_at=issued_at,
        expires_at=expires_at,
        body=value[body_start : body_start + body_length],
    )


def open_envelope(value: object) -> Envelope:
    """Parse a sealed value and check its signature; RecordError for anything else. The same
    bytes opened again are not checked again (:class:`_Opened`)."""
    if not isinstance(value, bytes):
        raise RecordError("not a byte string")
    value = bytes(value)
    opened = _OPENED.get(value)
    if opened is not None:
        return opened
    envelope = peek(value)
    if not verify_signature(
        envelope.public_key, value[-SIGNATURE_BYTES:], _DOMAIN + value[:-SIGNATURE_BYTES]
    ):
        raise RecordError("a bad signature")
    _OPENED.put(value, envelope)
    return envelope


def remembered(value: object) -> bool:
    """Whether this process opened these very bytes lately (:func:`open_envelope` would not
    check them again): a DHT node charges a storer only for values it has not met."""
    return isinstance(value, bytes) and _OPENED.get(value) is not None


#: What :data:`_OPENED` remembers: values at most, and their bytes in all.
OPENED_CACHE_ENTRIES = 16384
OPENED_CACHE_BYTES = 8 << 20


class _Opened:
    """The values whose signatures this process checked, least recently used first out.

    A DHT node and its readers meet the same values over and over (every poll of a round's
    readiness returns the same records, and every replica's answer to a get), and the signature
    check was a third of a DHT process's time in an 8-node swarm. Keyed on the whole value:
    only the very same bytes pass as checked, and a value that fails is checked again each
    time it comes. Bounded in bytes too: a flood of the largest values holds 8 MiB, not 16,384
    of them. Threads share it (readers in worker threads), under a lock."""

    def __init__(self, most_entries: int, most_bytes: int) -> None:
        self._held: OrderedDict[bytes, Envelope] = OrderedDict()
        self._most_entries, self._most_bytes, self._bytes = most_entries, most_bytes, 0
        self._lock = threading.Lock()

    def get(self, value: bytes) -> Envelope | None:
        with self._lock:
            opened = self._held.get(value)
            if opened is not None:
                self._held.move_to_end(value)
            return opened

    def put(self, value: bytes, envelope: Envelope) -> None:
        with self._lock:
            if value in self._held:
                return
            self._held[value] = envelope
            self._bytes += len(value)
            while len(self._held) > self._most_entries or self._bytes > self._most_bytes:
                old, _ = self._held.popitem(last=False)
                self._bytes -= len(old)

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self._bytes = 0


_OPENED = _Opened(OPENED_CACHE_ENTRIES, OPENED_CACHE_BYTES)


def check_filing(envelope: Envelope, *, key: str, subkey: str, expires: float, now: float) -> None:
    """Whether ``envelope`` may live under (``key``, ``subkey``) until ``expires`` at DHT time
    ``now``: its own key, its signer's slot, a kind the key takes, the expiry it was sealed
    with, and a bounded lifetime. RecordError otherwise."""
    if envelope.key != key:
        raise RecordError("sealed for another key")
    if envelope.kind not in allowed_kinds(key):
        raise RecordError(f"a {envelope.kind.name} value where it does not belong")
    if subkey != envelope.signer:
        raise RecordError(f"in the slot of {subkey[:64]!r}, signed by {envelope.signer}")
    if expires != envelope.expires_at:
        raise RecordError("stored with another expiry than it was sealed with")
    if envelope.expires_at <= now:
        raise RecordError("expired")
    if envelope.expires_at - envelope.issued_at > MAX_TTL_SECONDS:
        raise RecordError(f"claims a lifetime over {MAX_TTL_SECONDS:g} s")
    if envelope.issued_at > now + CLOCK_SKEW_SECONDS:
        raise RecordError("issued in the future")
    if envelope.kind == Kind.LEAVE and envelope.body:
        raise RecordError("a withdrawal with a body")
