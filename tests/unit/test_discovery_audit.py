"""Discovery's limits against a hostile DHT (no DHT nodes here): record fields out of range, one
key's entries bounded in number and bytes, and the node's line to its libp2p sidecar surviving
a reply too long to read (a fake sidecar: libp2p itself is never imported in this process)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from swarmgrad.node.discovery import libp2p_dht
from swarmgrad.node.discovery.base import DiscoveryError
from swarmgrad.node.discovery.budget import (
    MAX_BYTES_PER_KEY,
    MAX_ENTRIES_PER_KEY,
    BudgetFull,
    entry_bytes,
)
from swarmgrad.node.discovery.envelope import RUNS_KEY, Kind, seal
from swarmgrad.node.discovery.libp2p_directory import Directory, Entry, bound, encode_entries
from swarmgrad.node.discovery.records import PeerRecord, RecordError, validate
from swarmgrad.node.identity import Identity
from swarmgrad.protocol.errors import BindError

RUN, SPEC = "run-audit", b"\x03" * 32
PEERS = f"run/{RUN}/{SPEC.hex()}/peers"
NOW = 1000.0


def test_record_numbers_a_reader_cannot_compute_with_are_refused() -> None:
    # JSON allows any integer: 10**309 as a float field passed, then crashed `swarmgrad status`
    # and the pipeline's stage choice (OverflowError converting it to a float).
    me = Identity.generate()
    record = PeerRecord.create(
        me.peer_id, run_id=RUN, spec_hash=SPEC, endpoint="127.0.0.1:1", now=NOW, ttl_seconds=60
    )
    for change in ({"throughput": 10**309}, {"epoch": 10**400}, {"queue_depth": 2**64}):
        body = json.loads(record.body()) | change
        value = seal(me, key=PEERS, kind=Kind.PEER, body=json.dumps(body).encode(),
                     issued_at=record.issued_at, expires_at=record.expires_at)  # fmt: skip
        with pytest.raises(RecordError, match=r"not finite|out of range"):
            validate(PEERS, me.peer_id, value, record.expires_at, NOW + 1)
    # An integer where a float belongs is still a float, within range.
    body = json.loads(record.body()) | {"throughput": 12}
    parsed = PeerRecord.parse(json.dumps(body).encode())
    assert isinstance(parsed.throughput, float)
    assert parsed.throughput == 12.0


def run_value(identity: Identity, size: int, *, expires: float = NOW + 100) -> bytes:
    return seal(identity, key=RUNS_KEY, kind=Kind.RUN, body=bytes(size),
                issued_at=expires - 100, expires_at=expires)  # fmt: skip


def test_a_flood_of_large_values_cannot_push_out_a_keys_records() -> None:
    directory = Directory()
    genuine = Identity.generate()
    assert directory.store(RUNS_KEY, genuine.peer_id, run_value(genuine, 100), NOW + 100, NOW)
    fits = (MAX_BYTES_PER_KEY - entry_bytes(genuine.peer_id, run_value(genuine, 100))) // (
        entry_bytes(genuine.peer_id, run_value(genuine, 16 * 1024))
    )
    for _ in range(fits):  # what fits is taken
        stranger = Identity.generate()
        value = run_value(stranger, 16 * 1024)
        assert directory.store(RUNS_KEY, stranger.peer_id, value, NOW + 100, NOW + 1)
    stranger = Identity.generate()  # the rest is refused
    value = run_value(stranger, 16 * 1024)
    with pytest.raises(BudgetFull, match="would take over"):
        directory.store(RUNS_KEY, stranger.peer_id, value, NOW + 100, NOW + 1)
    # The genuine signer keeps its slot and may renew it; the answer fits what readers read.
    newer = run_value(genuine, 100, expires=NOW + 150)
    assert directory.store(RUNS_KEY, genuine.peer_id, newer, NOW + 150, NOW + 2)
    held = directory.get(RUNS_KEY, NOW + 2)
    assert held[genuine.peer_id].value == newer
    assert len(json.dumps({"entries": encode_entries(held)})) < max_message_bytes()
    # Once the flood expires, new signers get in again.
    late = Identity.generate()
    value = run_value(late, 16 * 1024, expires=NOW + 200)
    assert directory.store(RUNS_KEY, late.peer_id, value, NOW + 200, NOW + 101)
    assert set(directory.get(RUNS_KEY, NOW + 101)) == {genuine.peer_id, late.peer_id}


def max_message_bytes() -> int:
    # libp2p cannot be imported into a process that may hold hivemind: read it in another.
    code = "from swarmgrad.node.discovery.libp2p_framing import MAX_MESSAGE_BYTES as m; print(m)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout)


def test_a_get_merged_from_replicas_is_cut_to_one_keys_limits() -> None:
    # Replicas that filled up at different times hold different entries: their union must
    # still fit the line to the node, keeping what most replicas hold.
    entries = {f"s{i}": Entry(bytes(16 * 1024), NOW + 100) for i in range(200)}
    held_by = {s: 1 for s in entries} | {"s150": 5, "s199": 3}
    kept = bound(entries, held_by)
    assert {"s150", "s199"} <= set(kept)
    assert sum(entry_bytes(s, e.value) for s, e in kept.items()) <= MAX_BYTES_PER_KEY
    small = {f"s{i}": Entry(b"x", NOW + 100) for i in range(MAX_ENTRIES_PER_KEY + 10)}
    assert len(bound(small, {})) == MAX_ENTRIES_PER_KEY


# -- the node's line to its sidecar --------------------------------------------------------------

FAKE_SIDECAR = textwrap.dedent(
    """
    import json, os, socket, sys
    args = sys.argv[1:]
    sock = socket.socket(fileno=int(args[args.index("--fd") + 1]))
    sys.stdin.readline(), sys.stdin.readline()
    out, inp = sock.makefile("wb"), sock.makefile("rb")
    mode, runs = sys.argv[1], sys.argv[2]
    first = not os.path.exists(runs)
    open(runs, "a").write("x")
    maddrs = [] if mode == "no-address" else ["/ip4/127.0.0.1/tcp/4001/p2p/QmFake"]
    out.write(json.dumps({"event": "ready", "maddrs": maddrs}).encode() + b"\\n")
    out.flush()
    for line in inp:
        request = json.loads(line)
        if mode == "flood" and first:  # a reply over the node's line limit, then a good one
            out.write(b'{"id": %d, "entries": "' % request["id"] + b"A" * (9 << 20) + b'"}\\n')
        out.write(json.dumps({"id": request["id"], "entries": []}).encode() + b"\\n")
        out.flush()
    """
)


@pytest.fixture
def fake_sidecar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Start ``Sidecar`` on a fake sidecar script run in ``mode``; it counts its starts."""
    script = tmp_path / "fake_sidecar.py"
    script.write_text(FAKE_SIDECAR)
    runs = tmp_path / "runs"
    real = asyncio.create_subprocess_exec

    def use(mode: str) -> Path:
        async def fake(program: str, *args: str, **kwargs: Any) -> Any:
            assert args[:2] == ("-m", "swarmgrad.node.discovery.libp2p_sidecar")
            return await real(program, str(script), mode, str(runs), *args[2:], **kwargs)

        monkeypatch.setattr(asyncio, "create_subprocess_exec", fake)
        return runs

    return use


def sidecar() -> libp2p_dht.Sidecar:
    return libp2p_dht.Sidecar(
        Identity.generate(),
        initial_peers=[],
        host="127.0.0.1",
        port=0,
        network_secret="",
        start_timeout_seconds=10.0,
    )


async def test_a_reply_over_the_line_limit_restarts_the_sidecar(fake_sidecar: Any) -> None:
    # The reader used to die on the long line while the sidecar lived on: no restart, and every
    # later call timed out, for good.
    runs = fake_sidecar("flood")
    side = sidecar()
    await side.start()
    try:
        with pytest.raises(DiscoveryError):
            await side.get("k", timeout_seconds=5.0)
        async with asyncio.timeout(10):
            await side.restarted.wait()
        assert side.restarts == 1
        assert runs.read_text() == "xx"  # started twice
        assert await side.get("k", timeout_seconds=5.0) == {}
    finally:
        await side.close()


async def test_a_sidecar_with_no_listen_address_fails_the_start(fake_sidecar: Any) -> None:
    # py-libp2p reports a port it could not bind by listing no address: that was an IndexError;
    # it is the node's setup to fix (the CLI's exit 2).
    fake_sidecar("no-address")
    side = sidecar()
    with pytest.raises(BindError, match="no address to listen on"):
        await side.start()
    await side.close()
