"""The two workarounds the libp2p sidecar needs in py-libp2p 0.8.1, applied on import (by
``libp2p_kademlia.py``): a dial delay every new connection paid, and an unbounded ping under a
routing table bucket's lock. Each checks that what it replaces is still there."""

from __future__ import annotations

import trio
from libp2p.kad_dht.routing_table import KBucket
from libp2p.network import swarm as libp2p_swarm
from libp2p.peer.id import ID

PING_SECONDS = 0.5  # a routing table's liveness check

# py-libp2p 0.8.1 dials a peer's addresses "happy eyeballs" style, but waits out the whole 250 ms
# head start even when the first dial has already succeeded: every new connection costs 250 ms
# (measured: connect 0.252 s, a query on an open connection 5-9 ms). Our peers are dialed at one
# address each, where the head start buys nothing.
if not hasattr(libp2p_swarm, "_HAPPY_EYEBALLS_DELAY"):
    raise ImportError("py-libp2p changed: review the dial-delay workaround in this module")
libp2p_swarm._HAPPY_EYEBALLS_DELAY = 0.0

# When a k-bucket is full, py-libp2p pings its oldest peer before admitting a new one, with no
# deadline, holding the bucket's lock, from inside the DHT's stream handler: one frozen peer and
# the host stops answering lookups (its 12 handler slots fill up behind the lock). Bounded here:
# a peer that does not answer a ping in time is the one replaced.
_unbounded_ping = KBucket._ping_peer


async def _bounded_ping(bucket: KBucket, peer: ID) -> bool:
    with trio.move_on_after(PING_SECONDS):
        return bool(await _unbounded_ping(bucket, peer))
    return False


KBucket._ping_peer = _bounded_ping  # type: ignore[method-assign,assignment]
