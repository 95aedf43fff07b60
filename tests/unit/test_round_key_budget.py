"""What a DHT node keeps under a round key against a flood from throwaway keys (issue 42,
finding 4), in both backends' storage (no DHT nodes here): readiness records are small, and a
fresh one takes the place of the stalest rather than being refused."""

from __future__ import annotations

import pytest
from hivemind.dht.routing import DHTID
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarmgrad.node.discovery import budget
from swarmgrad.node.discovery.budget import MAX_BYTES_PER_KEY, BudgetFull, entry_bytes
from swarmgrad.node.discovery.envelope import Kind, seal
from swarmgrad.node.discovery.hivemind_dht import BoundedStorage
from swarmgrad.node.discovery.libp2p_directory import Directory
from swarmgrad.node.discovery.records import (
    MAX_READY_BYTES,
    PeerRecord,
    ReadyRecord,
    RecordError,
    validate,
)
from swarmgrad.node.identity import Identity

RUN, SPEC = "run-budget", b"\x0c" * 32
PREFIX = f"run/{RUN}/{SPEC.hex()}"
NOW = 1000.0


def readiness(
    identity: Identity, round_: int = 7, *, issued: float, life: float = 170.0, pad: int = 0,
    endpoint: str = "127.0.0.1:9",
) -> tuple[str, bytes, float]:  # fmt: skip
    """``identity``'s sealed readiness for ``round_`` (padded with ``pad`` spaces): its key,
    value and expiry."""
    record = ReadyRecord(
        peer_id=identity.peer_id, run_id=RUN, spec_hash=SPEC.hex(), endpoint=endpoint,
        round=round_, bandwidth=1.0, weight=1.0, issued_at=issued, expires_at=issued + life,
    )  # fmt: skip
    key = f"{PREFIX}/round/{round_}"
    value = seal(identity, key=key, kind=Kind.READY, body=record.body() + b" " * pad,
                 issued_at=issued, expires_at=record.expires_at)  # fmt: skip
    return key, value, record.expires_at


def peer_record(identity: Identity, *, issued: float) -> tuple[str, bytes, float]:
    record = PeerRecord.create(identity.peer_id, run_id=RUN, spec_hash=SPEC, endpoint="x:1",
                               now=issued, ttl_seconds=60)  # fmt: skip
    key = f"{PREFIX}/peers"
    value = seal(identity, key=key, kind=Kind.PEER, body=record.body(), issued_at=issued,
                 expires_at=record.expires_at)  # fmt: skip
    return key, value, record.expires_at


def test_a_padded_readiness_record_is_refused_and_an_honest_one_fits() -> None:
    me = Identity.generate()
    key, value, expires = readiness(me, issued=NOW, pad=3700)  # the flood's: ~4 KB
    with pytest.raises(RecordError, match=f"over {MAX_READY_BYTES} bytes"):
        validate(key, me.peer_id, value, expires, NOW)
    longest = "h" * 249 + ":65535"  # the longest endpoint a record may hold
    key, value, expires = readiness(me, issued=NOW, endpoint=longest)
    validate(key, me.peer_id, value, expires, NOW)


def test_a_fresh_readiness_record_takes_the_place_of_the_stalest() -> None:
    # A flood stored ahead fills a round key; every record claims to be issued 60 s in the
    # future (the clock skew a DHT node allows), which must not make it look fresher than the
    # honest records that come when matchmaking starts.
    directory = Directory()
    probe = Identity.generate()
    one = entry_bytes(probe.peer_id, readiness(probe, issued=NOW + 60)[1])
    fits = MAX_BYTES_PER_KEY // one
    flood = [Identity.generate() for _ in range(fits)]
    for sybil in flood:
        key, value, expires = readiness(sybil, issued=NOW + 60)
        assert directory.store(key, sybil.peer_id, value, expires, NOW)
    late = Identity.generate()
    key, value, expires = readiness(late, issued=NOW + 60)
    with pytest.raises(BudgetFull):  # no fresher than the flood: no room for it
        directory.store(key, late.peer_id, value, expires, NOW)
    honest = [Identity.generate() for _ in range(3)]
    for i, peer in enumerate(honest):
        key, value, expires = readiness(peer, issued=NOW + 5 + i)
        assert directory.store(key, peer.peer_id, value, expires, NOW + 5 + i)
    held = directory.get(key, NOW + 8)
    assert {p.peer_id for p in honest} <= set(held)
    assert not {s.peer_id for s in flood[:3]} & set(held)  # the first arrivals went
    assert len(held) == fits
    assert sum(entry_bytes(s, e.value) for s, e in held.items()) <= MAX_BYTES_PER_KEY
    # A record staler than everything held is refused, as before.
    old = Identity.generate()
    key, value, expires = readiness(old, issued=NOW - 150)
    with pytest.raises(BudgetFull):
        directory.store(key, old.peer_id, value, expires, NOW + 9)


def test_a_full_node_makes_room_from_the_stalest_round_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(budget, "MAX_ENTRIES", 10)
    directory = Directory()
    flood = [Identity.generate() for _ in range(10)]
    for i, sybil in enumerate(flood):
        key, value, expires = readiness(sybil, round_=100 + i, issued=NOW + i)
        assert directory.store(key, sybil.peer_id, value, expires, NOW + i)
    member = Identity.generate()
    # A long-lived key's record (here: a peer record) takes the stalest round record's room.
    key, value, expires = peer_record(member, issued=NOW + 20)
    assert directory.store(key, member.peer_id, value, expires, NOW + 20)
    assert flood[0].peer_id not in directory.get(f"{PREFIX}/round/100", NOW + 20)
    # A readiness record, only that of one staler than itself.
    key, value, expires = readiness(member, round_=7, issued=NOW + 21)
    assert directory.store(key, member.peer_id, value, expires, NOW + 21)
    assert flood[1].peer_id not in directory.get(f"{PREFIX}/round/101", NOW + 21)
    stale = Identity.generate()
    key, value, expires = readiness(stale, round_=8, issued=NOW - 100)
    with pytest.raises(BudgetFull, match="directory is full"):
        directory.store(key, stale.peer_id, value, expires, NOW + 22)


def test_hivemind_storage_makes_room_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    now = get_dht_time()
    storage = BoundedStorage()
    sybils = [Identity.generate() for _ in range(4)]
    key, value, expires = readiness(sybils[0], issued=now - 20)
    size = entry_bytes(sybils[0].peer_id, value)
    monkeypatch.setattr(budget, "MAX_BYTES_PER_KEY", 4 * size + size // 2)  # four fit
    key_id = DHTID.generate(source=key)
    for i, sybil in enumerate(sybils):
        key, value, expires = readiness(sybil, issued=now - 20 + i)
        assert storage.store_subkey(key_id, sybil.peer_id, MSGPackSerializer.dumps(value), expires)
    honest = Identity.generate()
    key, value, expires = readiness(honest, issued=now)
    assert storage.store_subkey(key_id, honest.peer_id, MSGPackSerializer.dumps(value), expires)
    held = storage.get(key_id)
    assert held is not None
    assert {subkey for subkey, _ in held.value.items()} == {
        honest.peer_id,
        *(s.peer_id for s in sybils[1:]),
    }
    # Under a long-lived key the holders keep their slots: a newcomer is refused.
    entries = [peer_record(sybil, issued=now - 20 + i) for i, sybil in enumerate(sybils[:3])]
    size = entry_bytes(sybils[0].peer_id, entries[0][1])
    monkeypatch.setattr(budget, "MAX_BYTES_PER_KEY", 2 * size + size // 2)
    peers_id = DHTID.generate(source=f"{PREFIX}/peers")
    stored = [
        storage.store_subkey(peers_id, sybil.peer_id, MSGPackSerializer.dumps(value), expires)
        for sybil, (_, value, expires) in zip(sybils, entries, strict=False)
    ]
    assert stored == [True, True, False]
