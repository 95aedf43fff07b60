"""Signed peer and readiness records of one run for discovery tests, sealed as a peer puts them in
the DHT."""

from __future__ import annotations

from typing import Any

from swarmgrad.node.discovery.envelope import Kind, seal
from swarmgrad.node.discovery.records import PeerRecord, ReadyRecord
from swarmgrad.node.identity import Identity

RUN, SPEC = "run-a", b"\x07" * 32


def record(
    identity: Identity, *, ttl: float = 60.0, now: float = 1000.0, **changes: object
) -> PeerRecord:
    fields: dict[str, object] = {
        "run_id": RUN,
        "spec_hash": SPEC,
        "endpoint": "127.0.0.1:5000",
        "now": now,
        "ttl_seconds": ttl,
    }
    fields.update(changes)
    return PeerRecord.create(identity.peer_id, **fields)  # type: ignore[arg-type]


KEY = f"run/{RUN}/{SPEC.hex()}/peers"


def sealed(
    identity: Identity, rec: PeerRecord | ReadyRecord | None = None, **options: Any
) -> bytes:
    rec = rec if rec is not None else record(identity)
    fields: dict[str, Any] = {
        "key": KEY,
        "kind": Kind.PEER,
        "body": rec.body(),
        "issued_at": rec.issued_at,
        "expires_at": rec.expires_at,
    }
    fields.update(options)
    return seal(identity, **fields)


def ready_record(
    identity: Identity, round_: int, *, ttl: float = 60.0, now: float = 1000.0
) -> ReadyRecord:
    return ReadyRecord(
        peer_id=identity.peer_id,
        run_id=RUN,
        spec_hash=SPEC.hex(),
        endpoint="127.0.0.1:5000",
        round=round_,
        bandwidth=1.0,
        weight=16.0,
        issued_at=now,
        expires_at=now + ttl,
    )
