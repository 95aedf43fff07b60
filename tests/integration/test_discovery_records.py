"""Signed peer records, without sockets: a sealed record round-trips; forged, misfiled, expired or
malformed values and records with unknown fields or values are refused, each with its reason; a
value checked before is checked again against the clock; hivemind's validator keeps only sealed
values under their own key."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.discovery.envelope import Kind, open_envelope
from swarmgrad.node.discovery.hivemind_dht import SealedValues
from swarmgrad.node.discovery.records import (
    MAX_SPEC_BYTES,
    PeerRecord,
    ReadyRecord,
    RecordError,
    validate,
)
from swarmgrad.node.identity import Identity
from tests.integration.sealed_records import KEY, RUN, SPEC, ready_record, record, sealed


def test_a_sealed_record_validates_and_round_trips() -> None:
    me = Identity.generate()
    original = record(me, epoch=7, throughput=123.5)
    envelope = validate(KEY, me.peer_id, sealed(me, original), 1060.0, now=1001.0)
    assert envelope.signer == me.peer_id
    assert PeerRecord.parse(envelope.body) == original


def tamper(data: bytes, **changes: object) -> bytes:
    """The sealed record ``data`` with its body changed (the seal no longer matches)."""
    opened = open_envelope(data)
    body = json.loads(opened.body)
    body.update(changes)
    new = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    start = data.index(opened.body)  # the body follows its 4-byte length
    end = start + len(opened.body)
    return data[: start - 4] + len(new).to_bytes(4, "little") + new + data[end:]


ME, OTHER = Identity.from_seed("test-discovery/me"), Identity.from_seed("test-discovery/other")


@pytest.mark.parametrize(
    ("value", "subkey", "expires", "match"),
    [
        # The DHT's own attacks: a copy with a later expiry, an unsigned leave, a plain value.
        (lambda: sealed(ME)[:-64] + bytes(64), "me", 1060.0, "bad signature"),
        (lambda: sealed(ME), "me", 1200.0, "another expiry"),
        (lambda: b"", "me", 1060.0, "a value of 0 bytes"),
        (lambda: b"\x00" * 200, "me", 1060.0, "not a sealed"),
        (lambda: tamper(sealed(ME), epoch=99), "me", 1060.0, "bad signature"),
        # Filed where it does not belong.
        (lambda: sealed(ME), "other", 1060.0, "in the slot of"),
        (lambda: sealed(ME, key=KEY.replace("peers", "round/3")), "me", 1060.0, "another key"),
        (lambda: sealed(ME, kind=Kind.SPEC), "me", 1060.0, "does not belong"),
        (lambda: sealed(ME, kind=Kind.LEAVE), "me", 1060.0, "a withdrawal with a body"),
        # Lifetimes.
        (lambda: sealed(ME, record(ME, ttl=600)), "me", 1600.0, "lifetime over"),
        (lambda: sealed(ME, record(ME, now=1100.0)), "me", 1160.0, "issued in the future"),
        (lambda: sealed(ME, record(ME, ttl=0.5)), "me", 1000.5, "expired"),
        # Bodies: someone else's record, another run's, times that disagree, bad fields.
        (lambda: sealed(ME, record(OTHER)), "me", 1060.0, "sealed by"),
        (lambda: sealed(ME, record(ME, run_id="run-b")), "me", 1060.0, "another run"),
        (lambda: sealed(ME, record(ME), issued_at=990.0), "me", 1060.0, "disagrees"),
        (lambda: sealed(ME, body=b"{}"), "me", 1060.0, "fields"),
        (lambda: sealed(ME, body=b"\xff"), "me", 1060.0, "not JSON"),
    ],
)
def test_forged_misfiled_or_malformed_values_are_refused(
    value: Callable[[], bytes], subkey: str, expires: float, match: str
) -> None:
    slot = {"me": ME.peer_id, "other": OTHER.peer_id}[subkey]
    with pytest.raises(RecordError, match=match):
        validate(KEY, slot, value(), expires, now=1001.0)


def test_a_value_checked_before_is_checked_again_against_the_clock_and_its_copies() -> None:
    # Opened values are remembered (the signature check is most of a DHT node's work): what is
    # remembered must be exactly those bytes, and never the verdict on its time.
    value = sealed(ME, record(ME, ttl=30.0))
    first = validate(KEY, ME.peer_id, value, 1030.0, now=1001.0)
    assert validate(KEY, ME.peer_id, bytes(value), 1030.0, now=1002.0) == first
    with pytest.raises(RecordError, match="expired"):
        validate(KEY, ME.peer_id, value, 1030.0, now=1031.0)
    with pytest.raises(RecordError, match="another expiry"):
        validate(KEY, ME.peer_id, value, 1090.0, now=1001.0)
    forged = value[:-1] + bytes([value[-1] ^ 1])
    with pytest.raises(RecordError, match="bad signature"):
        validate(KEY, ME.peer_id, forged, 1030.0, now=1001.0)


def test_a_stage_replicas_record_round_trips() -> None:
    fields = {"stage": 2, "span_start": 4, "span_end": 6, "state": "serving", "version": 40}
    sent = PeerRecord.create(
        ME.peer_id,
        run_id=RUN,
        spec_hash=SPEC,
        endpoint="127.0.0.1:5000",
        now=1000.0,
        ttl_seconds=60.0,
        queue_depth=3,
        **fields,
    )
    assert PeerRecord.parse(sent.body()) == sent


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"epoch": "7"}, "wrong type"),
        ({"reachability": 1}, "wrong type"),
        ({"reachability": "teleported"}, "unknown reachability"),
        ({"role": "admin"}, "unknown role"),
        ({"extra": 1}, "fields"),
        # Stage fields: a state off the list, a stage without a span (and the reverse), a
        # state on a record that serves no stage, counts below zero.
        ({"stage": 1, "span_start": 2, "span_end": 4, "state": "asleep"}, "unknown stage"),
        ({"stage": 1, "state": "serving"}, "a layer span"),
        ({"span_start": 2, "span_end": 4}, "a layer span"),
        ({"state": "serving"}, "a state"),
        ({"stage": -2}, "a layer span"),
        ({"queue_depth": -1}, "below zero"),
        ({"version": -3}, "below zero"),
        # gRPC dials more than host:port: a record must not point a node at a local socket
        # or another resolver.
        ({"endpoint": "unix:/run/some.sock"}, "endpoint is not host:port"),
        ({"endpoint": "dns://203.0.113.7/node.example:443"}, "endpoint is not host:port"),
        ({"endpoint": "127.0.0.1:0"}, "endpoint is not host:port"),
        ({"relay": "ipv4:203.0.113.7:80"}, "relay is not host:port"),
    ],
)
def test_records_with_unknown_fields_or_values_are_refused(
    change: dict[str, object], match: str
) -> None:
    body = json.loads(record(ME).body())
    body.update(change)
    with pytest.raises(RecordError, match=match):
        PeerRecord.parse(json.dumps(body).encode())


def test_a_readiness_record_names_a_plain_host_and_port() -> None:
    body = json.loads(ready_record(ME, 3).body())
    for endpoint in ("[::1]:5000", "node.example.org:443", "203.0.113.7:5000"):
        assert ReadyRecord.parse(json.dumps(body | {"endpoint": endpoint}).encode())
    with pytest.raises(RecordError, match="not host:port"):
        ReadyRecord.parse(json.dumps(body | {"endpoint": "unix:/run/some.sock"}).encode())


def test_readiness_is_only_for_its_own_round_and_specs_fit_the_limit() -> None:
    ready = ready_record(ME, 3)
    key = KEY.replace("peers", "round/3")
    assert validate(key, ME.peer_id, sealed(ME, ready, key=key, kind=Kind.READY), 1060.0, 1001.0)
    wrong = KEY.replace("peers", "round/4")
    with pytest.raises(RecordError, match="another round"):
        validate(wrong, ME.peer_id, sealed(ME, ready, key=wrong, kind=Kind.READY), 1060.0, 1001.0)
    # Each topic takes its own record type: a peer record is no readiness, and the reverse.
    peer = record(ME)
    with pytest.raises(RecordError, match="fields"):
        validate(key, ME.peer_id, sealed(ME, peer, key=key, kind=Kind.READY), 1060.0, 1001.0)
    with pytest.raises(RecordError, match="fields"):
        validate(KEY, ME.peer_id, sealed(ME, ready), 1060.0, 1001.0)
    specs = f"run/{RUN}/specs"
    huge = sealed(ME, key=specs, kind=Kind.SPEC, body=b"x" * (MAX_SPEC_BYTES + 1))
    with pytest.raises(RecordError, match="size limit"):
        validate(specs, ME.peer_id, huge, 1060.0, 1001.0)
    with pytest.raises(RecordError, match="does not belong"):  # not a swarmgrad key at all
        validate("elsewhere", ME.peer_id, sealed(ME, key="elsewhere"), 1060.0, 1001.0)


def test_hivemind_nodes_keep_only_sealed_values_under_their_own_key() -> None:
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer as Pack

    now = dht_time()
    rec = record(ME, now=now)
    value = sealed(ME, rec)
    key_id = DHTID.generate(source=KEY).to_bytes()
    validator = SealedValues()

    def valid(key: bytes, subkey: object, data: object, expires: float) -> bool:
        return bool(
            validator.validate(DHTRecord(key, Pack.dumps(subkey), Pack.dumps(data), expires))
        )

    assert valid(key_id, ME.peer_id, value, rec.expires_at)
    assert not valid(DHTID.generate(source="other").to_bytes(), ME.peer_id, value, rec.expires_at)
    assert not valid(key_id, OTHER.peer_id, value, rec.expires_at)
    assert not valid(key_id, ME.peer_id, b"plain junk", rec.expires_at)
    assert not valid(key_id, ME.peer_id, value, rec.expires_at + 10)
    regular = DHTRecord(key_id, b"", Pack.dumps(value), rec.expires_at)  # a value with no subkey
    assert not validator.validate(regular)
