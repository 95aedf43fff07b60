"""Peer values nested thousands deep (``[[[[...``) are refused like any other malformed value."""

from __future__ import annotations

import asyncio
import struct
import time
from types import SimpleNamespace
from typing import Any

import pytest

from swarmgrad.node import published
from swarmgrad.node.discovery.envelope import Envelope, Kind, RecordError, open_envelope, seal
from swarmgrad.node.discovery.libp2p_directory import Entry, merge
from swarmgrad.node.discovery.records import PeerRecord, validate
from swarmgrad.node.identity import Identity
from swarmgrad.node.reachability.relay import RelayError, read_frame
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.trust.allowlist import Allowlist, AllowlistError

#: 4 KiB: within every size limit, deeper than the JSON parser's stack.
NESTED = b"[" * 2040 + b"]" * 2040
SPEC = '[run]\nid = "demo"\n'


async def test_a_relay_frame_nested_too_deeply_is_a_relay_error() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(struct.pack(">I", len(NESTED)) + NESTED)
    reader.feed_eof()
    with pytest.raises(RelayError, match="nested too deeply"):
        await read_frame(reader, 1.0)


def test_a_peer_record_nested_too_deeply_is_refused_and_dropped_from_a_get() -> None:
    mallory, alice = Identity.from_seed("mallory"), Identity.from_seed("alice")
    spec_hash = bytes.fromhex("ab" * 32)
    key = f"run/demo/{spec_hash.hex()}/peers"
    now = time.time()
    expires = now + 60
    hostile = seal(mallory, key=key, kind=Kind.PEER, body=NESTED, issued_at=now, expires_at=expires)
    with pytest.raises(RecordError, match="nested too deeply"):
        validate(key, mallory.peer_id, hostile, expires, now)

    record = PeerRecord.create(
        alice.peer_id, run_id="demo", spec_hash=spec_hash, endpoint="127.0.0.1:1", now=now,
        ttl_seconds=60,
    )  # fmt: skip
    genuine = seal(alice, key=key, kind=Kind.PEER, body=record.body(), issued_at=now,
                   expires_at=record.expires_at)  # fmt: skip
    found: dict[str, Entry] = {}
    answer = {
        mallory.peer_id: Entry(hostile, expires),
        alice.peer_id: Entry(genuine, record.expires_at),
    }
    assert merge(key, found, answer, now) == 1  # one replica's bad entry costs only that entry
    assert list(found) == [alice.peer_id]


def _published(signer: Identity, body: bytes) -> Envelope:
    now = time.time()
    value = seal(signer, key="runs", kind=Kind.RUN, body=body, issued_at=now, expires_at=now + 60)
    return open_envelope(value)


async def test_a_published_run_nested_too_deeply_does_not_hide_the_genuine_one() -> None:
    organizer, mallory = Identity.from_seed("organizer"), Identity.from_seed("mallory")
    spec = RunSpec.from_toml(SPEC)

    def body(spec_toml: str) -> bytes:
        run = published.PublishedRun(
            run_id="demo", spec_hash=spec.hash.hex(), spec_toml=spec_toml, published_at=1.0
        )
        return run.body()

    values = [
        _published(mallory, NESTED),
        _published(mallory, body("x = " + "[" * 3000 + "]" * 3000)),  # tomllib recurses too
        _published(organizer, body(SPEC)),
    ]

    async def find_runs() -> list[Envelope]:
        return values

    dht: Any = SimpleNamespace(find_runs=find_runs)
    assert [listing.run_key_id for listing in published.listings(values)] == [organizer.peer_id]
    listing = await published.fetch(dht, "demo", organizer.peer_id)
    assert listing.spec.hash == spec.hash


def test_an_allowlist_nested_too_deeply_does_not_parse() -> None:
    with pytest.raises(AllowlistError, match="nested too deeply"):
        Allowlist.parse(NESTED)


def test_a_peers_spec_nested_too_deeply_is_named_unreadable_not_a_crash() -> None:
    spec = RunSpec.from_toml(SPEC)
    assert spec.differences(NESTED) == ["the other spec is not readable"]
    deep_object = b'{"a":' * 4000 + b"1" + b"}" * 4000
    assert spec.differences(deep_object) == ["the other spec is not readable"]
