"""The libp2p sidecar's replicas of a key are looked up once and used again for a while (a node
waiting for its group reads the round's key ten times a second), but never once one of them
failed or is slow to answer, nor past ``REPLICAS_SECONDS``."""

from __future__ import annotations

import json
import subprocess
import sys

# libp2p cannot be imported into a process that may hold hivemind: the sidecar's lookups run in
# a process of their own, with the network calls replaced by a counting stand-in.
SCRIPT = """
import json, time, types
import trio
from libp2p.peer.id import ID
from swarmgrad.node.discovery import libp2p_kademlia as kad

me, a, b = (ID(bytes([0x12, 0x20, i]) + bytes(32)) for i in range(3))
host = types.SimpleNamespace(get_id=lambda: me)
routing = types.SimpleNamespace(remove_peer=lambda peer: None)
sidecar = kad.Sidecar(host=host, dht=types.SimpleNamespace(routing_table=routing))
lookups = []

async def lookup(key):  # as the real one: peers that failed lately are not asked
    lookups.append(key)
    return [p for p in (me, a, b) if p == me or sidecar._usable(p)]

sidecar._lookup = lookup
seen = {}

async def main():
    key = "run/r/abc/round/7"
    first = await sidecar.closest(key)
    seen["again"] = [await sidecar.closest(key) == first for _ in range(20)]
    seen["lookups while fresh"] = len(lookups)
    await sidecar.closest("run/r/abc/peers")
    seen["another key"] = len(lookups)
    sidecar.penalize(a, "timed out")  # a replica failed: look up again, and keep that
    await sidecar.closest(key)
    await sidecar.closest(key)
    seen["after a failure"] = len(lookups)
    sidecar.penalized.clear()
    sidecar.querying[b] = time.monotonic() - kad.SLOW_SECONDS - 1  # b is slow to answer
    await sidecar.closest(key)
    seen["with a slow replica"] = len(lookups)
    sidecar.querying.clear()
    sidecar.replicas = {k: (t - kad.REPLICAS_SECONDS, p) for k, (t, p) in sidecar.replicas.items()}
    await sidecar.closest(key)
    seen["once expired"] = len(lookups)
    for i in range(2 * kad.REPLICAS_KEPT):  # many keys: the remembered stay bounded
        await sidecar.closest(f"key {i}")
    seen["kept"] = len(sidecar.replicas) <= kad.REPLICAS_KEPT

trio.run(main)
print(json.dumps(seen))
"""


def test_a_keys_replicas_are_looked_up_again_only_when_stale_failed_or_slow() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["again"] == [True] * 20
    assert seen["lookups while fresh"] == 1
    assert seen["another key"] == 2
    assert seen["after a failure"] == 3
    assert seen["with a slow replica"] == 4
    assert seen["once expired"] == 5
    assert seen["kept"]
