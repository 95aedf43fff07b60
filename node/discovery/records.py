"""Peer records: what a node tells the swarm about itself, and what a DHT value must be.

A record is canonical JSON (sorted keys), sealed in an :mod:`.envelope` under its topic's key and
its peer id's slot. :func:`validate` is the one check of a DHT value, run by the DHT nodes before
they store or believe one (both backends) and by readers after a get: the envelope's seal and
filing, then the body: a peer or readiness record must parse into exactly the known fields with
the right types, be its signer's own, belong to the key's run and spec (and a readiness record to
the key's round, and fit :data:`MAX_READY_BYTES`), and carry the envelope's times; a spec must
fit :data:`MAX_SPEC_BYTES`. Anything else is refused, and a reader counts it: a DHT is writable
by anyone.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from typing import Any

from swarmgrad.node.discovery.envelope import (
    MAX_TTL_SECONDS,
    Envelope,
    Kind,
    OverBudget,
    RecordError,
    check_filing,
    open_envelope,
    peek,
    remembered,
)
from swarmgrad.node.kinds import Reach

__all__ = [
    "MAX_AVOIDS",
    "MAX_TTL_SECONDS",
    "PeerRecord",
    "ReadyRecord",
    "RecordError",
    "avoid_tag",
    "check",
    "pack_avoids",
    "validate",
]

MAX_RECORD_BYTES = 4096
#: A readiness record's body: an honest one is ~300-400 bytes (~600 with the longest host name).
#: Padded to :data:`MAX_RECORD_BYTES`, a flood from throwaway keys filled a round key's budget
#: (``budget.py``) with under 300 of them.
MAX_READY_BYTES = 1024
MAX_SPEC_BYTES = 16 * 1024
#: Record bodies whose parse is remembered (:func:`_parse`): at most 4 KiB each.
PARSED_CACHE_ENTRIES = 2048
#: The largest integer a record field may hold: every integer up to it is exact as a float (what
#: readers compute with), and no reader's arithmetic on it overflows.
MAX_RECORD_INT = 2**53
ROLES = ("trainer", "bootstrap", "observer")
#: How peers reach a node's endpoint: not known yet (no peer has dialed it back), directly, through
#: a port its router mapped (UPnP IGD), through a relay peer, or not at all.
REACHABILITY = tuple(Reach)
#: A stage replica's state: catching up with its group, serving, or leaving ("" off pipelines).
STAGE_STATES = ("", "joining", "serving", "draining")


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerRecord:
    peer_id: str
    run_id: str
    spec_hash: str  # hex
    endpoint: str  # host:port of the node's gRPC server ("" if it accepts no connections)
    role: str
    epoch: int
    throughput: float  # samples per second
    bandwidth: float  # relative upload capacity
    weight: float  # samples processed since the last round (what its values count for)
    checksum: str  # fingerprint of its replicated state at ``epoch`` ("" before the first)
    reachability: str  # one of REACHABILITY
    relay: str  # host:port of the relay this node offers to unreachable peers ("" if none)
    via: str  # the peer id of the relay that carries this node's endpoint, when relayed
    punched: int  # peers this node reaches over links it punched through both NATs
    #: A pipeline's stage replica (-1: none): its stage, layer span [start, end), serving state
    #: (one of STAGE_STATES), microbatches queued, and version (inner steps taken).
    stage: int
    span_start: int
    span_end: int
    state: str
    queue_depth: int
    version: int
    issued_at: float  # DHT time, seconds
    expires_at: float

    def body(self) -> bytes:
        """The canonical JSON an envelope seals."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def create(
        cls,
        peer_id: str,
        *,
        run_id: str,
        spec_hash: bytes,
        endpoint: str,
        now: float,
        ttl_seconds: float,
        **details: Any,
    ) -> PeerRecord:
        """A record issued ``now`` for ``ttl_seconds``; ``details`` set the other fields
        (:data:`PEER_DEFAULTS` for those left out)."""
        unknown = set(details) - set(PEER_DEFAULTS)
        if unknown:
            raise TypeError(f"unknown record fields {sorted(unknown)}")
        return cls(
            peer_id=peer_id,
            run_id=run_id,
            spec_hash=spec_hash.hex(),
            endpoint=endpoint,
            issued_at=now,
            expires_at=now + ttl_seconds,
            **(PEER_DEFAULTS | details),
        )

    @classmethod
    def parse(cls, body: bytes) -> PeerRecord:
        """A record from an envelope's body; RecordError unless it has exactly the known fields,
        each of the right type."""
        raw = _fields_of(body, cls)
        _check_endpoint("endpoint", raw["endpoint"])
        _check_endpoint("relay", raw["relay"])
        if raw["role"] not in ROLES:
            raise RecordError(f"unknown role {raw['role']!r}")
        if raw["reachability"] not in REACHABILITY:
            raise RecordError(f"unknown reachability {raw['reachability']!r}")
        if raw["state"] not in STAGE_STATES:
            raise RecordError(f"unknown stage state {raw['state']!r}")
        if min(raw["punched"], raw["queue_depth"], raw["version"], raw["span_start"]) < 0:
            raise RecordError("a record count below zero")
        staged = raw["stage"] >= 0
        if raw["stage"] < -1 or staged != (raw["span_end"] > raw["span_start"]):
            raise RecordError("a stage record needs a stage and a layer span, others neither")
        if staged != (raw["state"] != ""):
            raise RecordError("a stage record needs a state, others none")
        return cls(**raw)


#: What :meth:`PeerRecord.create` fills in for the fields it is not given.
PEER_DEFAULTS: dict[str, Any] = {
    "role": "trainer",
    "epoch": 0,
    "throughput": 0.0,
    "bandwidth": 1.0,
    "weight": 1.0,
    "checksum": "",
    "reachability": Reach.UNKNOWN.value,
    "relay": "",
    "via": "",
    "punched": 0,
    "stage": -1,
    "span_start": 0,
    "span_end": 0,
    "state": "",
    "queue_depth": 0,
    "version": 0,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadyRecord:
    """A peer ready for one round of matchmaking, under ``round/<r>``: where to dial it, the
    share of the vector it offers to own, and what its values count for."""

    peer_id: str
    run_id: str
    spec_hash: str  # hex
    endpoint: str
    round: int
    bandwidth: float  # relative upload capacity it offers as an owner (0: it owns nothing)
    weight: float  # samples since its last round
    issued_at: float
    expires_at: float
    #: The peers it will not be grouped with (its newest bans), as comma-separated
    #: :func:`avoid_tag` s: ``node/averaging/grouping.py``.
    avoids: str = ""

    def body(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, body: bytes) -> ReadyRecord:
        raw = _fields_of(body, cls)
        _check_endpoint("endpoint", raw["endpoint"])
        if not _AVOIDS.fullmatch(raw["avoids"]):
            raise RecordError(f"record field avoids is not up to {MAX_AVOIDS} tags")
        return cls(**raw)

    def avoided(self) -> frozenset[str]:
        """The tags of the peers it avoids."""
        return frozenset(self.avoids.split(",")) if self.avoids else frozenset()


#: Peers a readiness record may name as avoided, and the hex digits of one's tag (48 bits: a
#: key ground to share an honest peer's tag only makes its grinder avoided too).
MAX_AVOIDS = 16
_TAG_DIGITS = 12
_AVOIDS = re.compile(
    rf"(?:[0-9a-f]{{{_TAG_DIGITS}}}(?:,[0-9a-f]{{{_TAG_DIGITS}}}){{0,{MAX_AVOIDS - 1}}})?"
)


@functools.lru_cache(maxsize=1 << 14)
def avoid_tag(peer_id: str) -> str:
    """How a readiness record names a peer it avoids."""
    return hashlib.blake2b(peer_id.encode(), digest_size=_TAG_DIGITS // 2).hexdigest()


def pack_avoids(peer_ids: Iterable[str]) -> str:
    """The ``avoids`` field naming the first :data:`MAX_AVOIDS` of ``peer_ids``."""
    tags: dict[str, None] = {}
    for peer_id in peer_ids:  # a node may hold thousands of bans: tag only the first few
        tags.setdefault(avoid_tag(peer_id))
        if len(tags) == MAX_AVOIDS:
            break
    return ",".join(tags)


#: ``host:port`` as nodes announce it: a DNS name or IPv4 address, or an IPv6 one in brackets.
_ENDPOINT = re.compile(r"(?:\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9][A-Za-z0-9.-]{0,252}):([0-9]{1,5})")


def _check_endpoint(name: str, value: str) -> None:
    """Refuse an endpoint that is not a plain ``host:port``: gRPC would also dial a target
    such as ``unix:/run/some.sock`` or ``dns://resolver/name`` that a peer put in its record."""
    match = _ENDPOINT.fullmatch(value)
    if value and (match is None or not 0 < int(match[1]) < 65536):
        raise RecordError(f"record field {name} is not host:port")


def validate(
    key: str,
    subkey: str,
    value: object,
    expires: float,
    now: float,
    *,
    may_check: Callable[[], bool] | None = None,
) -> Envelope:
    """The sealed value ``value``, if it may live under (``key``, ``subkey``) until ``expires``
    at DHT time ``now`` (see the module docstring); RecordError otherwise. ``may_check``: for
    a value stored on a peer's behalf (:func:`charge`)."""
    charge(value, may_check)
    return open_checked(key, subkey, value, expires, now)[0]


def charge(value: object, may_check: Callable[[], bool] | None) -> None:
    """Ask ``may_check`` (the storing peer's budget: ``check_budget.py``) before any check of
    a value this process has not opened before; OverBudget if it says no. None: a value this
    node asked for, or its own."""
    if may_check is not None and not remembered(value) and not may_check():
        raise OverBudget("too many new values from this peer for now; try again later")


def open_checked(
    key: str, subkey: str, value: object, expires: float, now: float
) -> tuple[Envelope, PeerRecord | ReadyRecord | None]:
    """:func:`validate`'s checks, with the record the value carries (:func:`check`). The
    cheap checks come before the signature: a value filed where it may not live costs none."""
    record = check(peek(value), key=key, subkey=subkey, expires=expires, now=now)
    return open_envelope(value), record


def check(
    envelope: Envelope, *, key: str, subkey: str, expires: float, now: float
) -> PeerRecord | ReadyRecord | None:
    """:func:`validate` for a value already opened (its seal checked); the record it carries,
    for a peer or readiness record (None for other kinds)."""
    check_filing(envelope, key=key, subkey=subkey, expires=expires, now=now)
    record: PeerRecord | ReadyRecord | None = None
    if envelope.kind in (Kind.PEER, Kind.READY):
        kind = PeerRecord if envelope.kind == Kind.PEER else ReadyRecord
        if kind is ReadyRecord and len(envelope.body) > MAX_READY_BYTES:
            raise RecordError(f"a readiness record over {MAX_READY_BYTES} bytes")
        record = _parse(kind, envelope.body)
        parts = key.split("/")  # run/<run id>/<spec hash>/peers, or .../round/<r>
        run_id, spec_hash = parts[1], parts[2]
        if record.peer_id != envelope.signer:
            raise RecordError(f"record of {record.peer_id} sealed by {envelope.signer}")
        if (record.run_id, record.spec_hash) != (run_id, spec_hash):
            raise RecordError(f"record of {record.peer_id} is for another run or spec")
        if (record.issued_at, record.expires_at) != (envelope.issued_at, envelope.expires_at):
            raise RecordError(f"record of {record.peer_id} disagrees with its seal's times")
        if isinstance(record, ReadyRecord) and str(record.round) != parts[-1]:
            raise RecordError(f"readiness of {record.peer_id} for another round")
    elif (
        envelope.kind in (Kind.SPEC, Kind.RUN, Kind.ALLOWLIST, Kind.BANS)
        and len(envelope.body) > MAX_SPEC_BYTES
    ):
        raise RecordError(f"a {envelope.kind.name.lower()} value over the size limit")
    return record


@functools.lru_cache(maxsize=PARSED_CACHE_ENTRIES)
def _parse(kind: type[PeerRecord] | type[ReadyRecord], body: bytes) -> PeerRecord | ReadyRecord:
    # Readers parse the same records at every poll: matchmaking reads a round's readiness ten
    # times a second, and a flood of 320 records there cost each read ~60 ms of parsing on a
    # busy 2-core machine. Records are frozen, so one parse serves every read of the same bytes
    # (a body that fails is parsed again each time it comes, as the envelope cache does).
    return kind.parse(body)


def _fields_of(body: bytes, kind: type[PeerRecord] | type[ReadyRecord]) -> dict[str, Any]:
    """The JSON object in ``body``, if it has exactly ``kind``'s fields, each of its type."""
    if len(body) > MAX_RECORD_BYTES:
        raise RecordError("record too large")
    try:
        raw = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise RecordError("record is not JSON") from None
    except RecursionError:  # 4 KiB of "[[[[..." is deeper than the parser's stack allows
        raise RecordError("record nested too deeply") from None
    if not isinstance(raw, dict):
        raise RecordError("record is not a JSON object")
    names = {f.name: f.type for f in fields(kind)}
    if set(raw) != set(names):
        raise RecordError(f"record fields {sorted(raw)} differ from {sorted(names)}")
    expected: dict[str, type | tuple[type, ...]] = {
        "str": str,
        "int": int,
        "float": (int, float),
        "bool": bool,
    }
    for name, type_name in names.items():
        value = raw[name]
        if isinstance(value, bool) and type_name != "bool":
            raise RecordError(f"record field {name} has the wrong type")
        if not isinstance(value, expected[str(type_name)]):
            raise RecordError(f"record field {name} has the wrong type")
        if str(type_name) == "float":  # JSON's 1e400 is inf, and its 10**400 an int float() refuses
            try:
                raw[name] = float(raw[name])
            except OverflowError:
                raise RecordError(f"record field {name} is not finite") from None
            if not math.isfinite(raw[name]):
                raise RecordError(f"record field {name} is not finite")
        if str(type_name) == "int" and abs(raw[name]) > MAX_RECORD_INT:
            raise RecordError(f"record field {name} is out of range")
        if isinstance(value, str) and len(value) > 256:
            raise RecordError(f"record field {name} is too long")
    return raw
