"""Signed requests, without sockets: what a signature covers, and every way a Verifier refuses."""

from __future__ import annotations

import time

import pytest

from swarmgrad.node.identity import Identity
from swarmgrad.protocol.auth import (
    CLOCK_WINDOW_SECONDS,
    ReplayGuard,
    Verifier,
    sign_request,
    signed_bytes,
)
from swarmgrad.protocol.averaging import AGGREGATE, StreamHeader, header_to_proto
from swarmgrad.protocol.errors import ProtocolViolation
from swarmgrad.protocol.v1 import averaging_pb2
from swarmgrad.protocol.v1.averaging_pb2 import ResultCode

ALICE, BOB = Identity.from_seed("test-auth/alice"), Identity.from_seed("test-auth/bob")


def test_no_two_different_requests_sign_the_same_bytes() -> None:
    cases = [
        ("m", "r", ["ab", "c"]),
        ("m", "r", ["a", "bc"]),  # the same characters, cut elsewhere
        ("m", "r", [b"ab", "c"]),  # the same bytes, another type
        ("m", "r", [1]),
        ("m", "r", [1.0]),
        ("m", "rr", []),
        ("mr", "", []),
    ]
    encoded = [signed_bytes(method, receiver, fields) for method, receiver, fields in cases]
    assert len(set(encoded)) == len(cases)


def test_a_header_verifies_whatever_python_type_its_numbers_had() -> None:
    # The sender's weight may be an int (a sample count); the owner reads the wire's double.
    header = StreamHeader(
        run_id="r",
        spec_hash=b"h",
        round=3,
        group_id=b"g" * 16,
        sender=ALICE.peer_id,
        receiver=BOB.peer_id,
        part=1,
        weight=7,
    )
    wire = averaging_pb2.AggregateRequest.FromString(
        header_to_proto(header, ALICE).SerializeToString()
    ).header
    parsed = StreamHeader(
        run_id=wire.key.run_id,
        spec_hash=wire.key.spec_hash,
        round=wire.key.round,
        group_id=wire.key.group_id,
        sender=wire.sender,
        receiver=wire.receiver,
        part=wire.part,
        weight=wire.weight,
    )
    peer = Verifier(BOB.peer_id).verify(
        AGGREGATE, wire.auth, receiver=wire.receiver, fields=parsed.fields(), sender=wire.sender
    )
    assert peer == ALICE.peer_id


def _refusal(verifier: Verifier, auth: object, **overrides: object) -> str:
    options: dict[str, object] = {
        "receiver": BOB.peer_id,
        "fields": ["x", 1],
        "sender": ALICE.peer_id,
        **overrides,
    }
    with pytest.raises(ProtocolViolation) as refused:
        verifier.verify("M", auth, **options)  # type: ignore[arg-type]
    assert refused.value.code == ResultCode.UNAUTHENTICATED
    return str(refused.value)


def test_every_way_a_request_is_refused() -> None:
    verifier = Verifier(BOB.peer_id)
    good = sign_request(ALICE, "M", BOB.peer_id, ["x", 1])
    assert "not signed" in _refusal(verifier, type(good)())
    assert "key of" in _refusal(verifier, good, sender=BOB.peer_id)  # Alice's key, Bob's name
    assert "meant for" in _refusal(verifier, good, receiver=ALICE.peer_id)
    assert "bad signature" in _refusal(verifier, good, fields=["x", 2])  # a field changed
    stale = sign_request(ALICE, "M", BOB.peer_id, ["x", 1])
    stale.issued_at = time.time() - 2 * CLOCK_WINDOW_SECONDS
    assert "from this peer's clock" in _refusal(verifier, stale)
    assert verifier.verify("M", good, receiver=BOB.peer_id, fields=["x", 1]) == ALICE.peer_id
    assert "replayed" in _refusal(verifier, good)


def test_the_replay_memory_is_bounded_and_forgets_only_the_oldest() -> None:
    guard = ReplayGuard(max_entries=3)
    now = time.time()
    for nonce in (b"1", b"2", b"3", b"4"):
        assert guard.first_time(b"k", nonce, now)
    assert len(guard) == 3
    assert guard.evicted == 1
    assert not guard.first_time(b"k", b"4", now)  # the newest are remembered
    assert guard.first_time(b"k", b"1", now)  # the oldest was forgotten, not refused
    later = now + 3 * CLOCK_WINDOW_SECONDS
    assert guard.first_time(b"k", b"9", later)
    assert len(guard) == 1  # the expired went on their own
