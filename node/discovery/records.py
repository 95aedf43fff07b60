"""Signed peer records: what a node tells the swarm about itself, and how readers check it.

A record is canonical JSON (sorted keys) followed by the 64-byte Ed25519 signature of that JSON.
A reader accepts it only if it parses into exactly the known fields with the right types, its
public key hashes to its peer id, the signature verifies, it belongs to the reader's run and spec,
and it has not expired (nor claims to live longer than ``MAX_TTL_SECONDS``). Anything else is
dropped and counted by the caller: a DHT is writable by anyone.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

from swarmgrad.node.identity import Identity, peer_id_of, verify

MAX_RECORD_BYTES = 4096
MAX_TTL_SECONDS = 600.0
_SIGNATURE_BYTES = 64
ROLES = ("trainer", "bootstrap", "observer")
#: How peers reach a node's endpoint: not known yet (no peer has dialed it back), directly, through
#: a port its router mapped (UPnP / NAT-PMP), through a relay peer, or not at all.
REACHABILITY = ("unknown", "direct", "upnp", "relayed", "unreachable")


class RecordError(ValueError):
    """A record that must not be believed; the message says why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerRecord:
    peer_id: str
    public_key: str  # hex of the raw Ed25519 public key
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
    issued_at: float  # DHT time, seconds
    expires_at: float

    def sign(self, identity: Identity) -> bytes:
        if identity.peer_id != self.peer_id:
            raise ValueError("a record must be signed by the key of its own peer id")
        body = _canonical(self)
        return body + identity.sign(body)

    @classmethod
    def create(
        cls,
        identity: Identity,
        *,
        run_id: str,
        spec_hash: bytes,
        endpoint: str,
        now: float,
        ttl_seconds: float,
        role: str = "trainer",
        epoch: int = 0,
        throughput: float = 0.0,
        bandwidth: float = 1.0,
        weight: float = 1.0,
        checksum: str = "",
        reachability: str = "unknown",
        relay: str = "",
        via: str = "",
        punched: int = 0,
    ) -> PeerRecord:
        return cls(
            peer_id=identity.peer_id,
            public_key=identity.public_key.hex(),
            run_id=run_id,
            spec_hash=spec_hash.hex(),
            endpoint=endpoint,
            role=role,
            epoch=epoch,
            throughput=throughput,
            bandwidth=bandwidth,
            weight=weight,
            checksum=checksum,
            reachability=reachability,
            relay=relay,
            via=via,
            punched=punched,
            issued_at=now,
            expires_at=now + ttl_seconds,
        )

    @classmethod
    def verify(cls, data: bytes, *, run_id: str, spec_hash: bytes, now: float) -> PeerRecord:
        """Parse and check a record from the DHT; raises RecordError if it must be ignored."""
        if not isinstance(data, bytes) or not _SIGNATURE_BYTES < len(data) <= MAX_RECORD_BYTES:
            raise RecordError("record missing, too small or too large")
        body, signature = data[:-_SIGNATURE_BYTES], data[-_SIGNATURE_BYTES:]
        try:
            raw = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise RecordError("record is not JSON") from None
        record = _from_dict(raw)
        try:
            public_key = bytes.fromhex(record.public_key)
            claimed = peer_id_of(public_key)
        except ValueError:
            raise RecordError("record has a malformed public key") from None
        if claimed != record.peer_id:
            raise RecordError(f"record of {record.peer_id} carries the key of {claimed}")
        if not verify(public_key, signature, body):
            raise RecordError(f"bad signature on the record of {record.peer_id}")
        if record.run_id != run_id or record.spec_hash != spec_hash.hex():
            raise RecordError(
                f"record of {record.peer_id} is for run {record.run_id} spec "
                f"{record.spec_hash[:12]}, not {run_id} spec {spec_hash.hex()[:12]}"
            )
        if record.expires_at <= now:
            raise RecordError(f"record of {record.peer_id} has expired")
        if record.expires_at - record.issued_at > MAX_TTL_SECONDS:
            raise RecordError(f"record of {record.peer_id} claims a lifetime over the maximum")
        return record


def _canonical(record: PeerRecord) -> bytes:
    return json.dumps(asdict(record), sort_keys=True, separators=(",", ":")).encode()


def _from_dict(raw: object) -> PeerRecord:
    if not isinstance(raw, dict):
        raise RecordError("record is not a JSON object")
    names = {f.name: f.type for f in fields(PeerRecord)}
    if set(raw) != set(names):
        raise RecordError(f"record fields {sorted(raw)} differ from {sorted(names)}")
    expected: dict[str, type | tuple[type, ...]] = {
        "str": str,
        "int": int,
        "float": (int, float),
        "bool": bool,
    }
    for name, kind in names.items():
        value = raw[name]
        if isinstance(value, bool) and kind != "bool":
            raise RecordError(f"record field {name} has the wrong type")
        if not isinstance(value, expected[str(kind)]):
            raise RecordError(f"record field {name} has the wrong type")
        if isinstance(value, float) and not math.isfinite(value):
            raise RecordError(f"record field {name} is not finite")
        if isinstance(value, str) and len(value) > 256:
            raise RecordError(f"record field {name} is too long")
    if raw["role"] not in ROLES:
        raise RecordError(f"unknown role {raw['role']!r}")
    if raw["reachability"] not in REACHABILITY:
        raise RecordError(f"unknown reachability {raw['reachability']!r}")
    return PeerRecord(**raw)
