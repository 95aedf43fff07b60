"""The libp2p sidecar's DHT: a py-libp2p host and Kademlia routing, with our own lookups,
replication and directory protocol on top, every call under a deadline.

With the workarounds it needs in py-libp2p 0.8.1 applied on import (``libp2p_patches.py``).
Imported only in the sidecar process (``libp2p_sidecar.py``): libp2p and hivemind cannot share
a process.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.kad_dht.utils import sort_peer_ids_by_distance
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.peer.peerstore import PeerStoreError

from swarmgrad.node.discovery import libp2p_patches  # noqa: F401  (applied on import)
from swarmgrad.node.discovery.envelope import RecordError
from swarmgrad.node.discovery.libp2p_directory import (
    Directory,
    Entry,
    bound,
    decode_entries,
    encode_entries,
    merge,
)
from swarmgrad.node.discovery.libp2p_framing import Oversize, read_message, write_message

log = logging.getLogger("swarmgrad.libp2p_sidecar")
LOG_EVERY_SECONDS = 10.0

DIRECTORY_PROTOCOL = TProtocol("/swarmgrad/directory/1.0.0")
REPLICAS = 5  # peers that hold each key's entries
ALPHA = 3  # queries in flight at once in a lookup
SLOW_SECONDS = 0.5  # a query open this long no longer holds a lookup up
QUERY_SECONDS = 3.0  # a query that has not answered by now failed: its peer is evicted
LOOKUP_SECONDS = 1.5  # a whole lookup; then the closest peers that answered are used
#: A key's replicas, once looked up, are used again for this long while none of them failed:
#: a node waiting for its group reads the round's key ten times a second, and a lookup for each
#: read was most of the sidecars' CPU (with 4 nodes on 2 cores, ~0.3 core each).
REPLICAS_SECONDS = 1.0
REPLICAS_KEPT = 256  # keys whose replicas are remembered at most
CONNECT_SECONDS = 5.0
PENALTY_SECONDS = (10.0, 300.0)  # after a first failure; the cap after many in a row
REFRESH_SECONDS = (2.0, 5.0, 15.0, 30.0)  # after joining, then every 30 s
# -- the node: host, DHT, lookups ----------------------------------------------------------------


@dataclass
class Sidecar:
    host: IHost
    dht: KadDHT
    directory: Directory = field(default_factory=Directory)
    #: Peers that failed: (consecutive failures, skipped until this monotonic time).
    penalized: dict[ID, tuple[int, float]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    #: Queries in flight (any lookup's), by peer: since when. One open longer than
    #: ``SLOW_SECONDS`` marks its peer slow for every lookup until it resolves.
    querying: dict[ID, float] = field(default_factory=dict)
    #: Where queries run: a lookup that meets its deadline leaves its stragglers here to finish
    #: (py-libp2p shields a new connection's handshakes from cancellation).
    background: trio.Nursery | None = None
    #: Refused directory requests are logged once per ``LOG_EVERY_SECONDS`` (and counted).
    quiet_until: float = 0.0
    #: Each key's last lookup: when, and the replicas it found (``REPLICAS_SECONDS``).
    replicas: dict[str, tuple[float, list[ID]]] = field(default_factory=dict)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def maddrs(self) -> list[str]:
        return [str(a) for a in self.host.get_addrs()]

    def known_peers(self, limit: int = 16) -> list[str]:
        """Multiaddrs (with peer id) of up to ``limit`` peers this one knows: the node joins
        through them when its sidecar is restarted after the bootstrap peers are gone."""
        found: list[str] = []
        peers = [*self.host.get_connected_peers(), *self.dht.routing_table.get_peer_ids()]
        for peer in dict.fromkeys(peers):
            if not self._usable(peer):
                continue
            try:
                addrs = self.host.get_peerstore().addrs(peer)
            except PeerStoreError:  # gone from the peerstore since (it forgets expired addresses)
                continue
            if addrs:
                address = str(addrs[0])
                found.append(address if "/p2p/" in address else f"{address}/p2p/{peer}")
            if len(found) == limit:
                break
        return found

    def _usable(self, peer: ID) -> bool:
        until = self.penalized.get(peer, (0, 0.0))[1]
        return peer != self.host.get_id() and until < time.monotonic()

    def penalize(self, peer: ID, why: str) -> None:
        """A peer that missed a deadline or failed: out of the routing table (it comes back
        when it answers again), and skipped by lookups for a time that doubles with each
        failure in a row, from ``PENALTY_SECONDS[0]`` to ``[1]``. A busy peer is skipped
        briefly; a frozen one soon costs nothing."""
        failures = self.penalized.get(peer, (0, 0.0))[0] + 1
        seconds = min(PENALTY_SECONDS[0] * 2 ** (failures - 1), PENALTY_SECONDS[1])
        log.debug("evicting %s for %g s: %s", peer, seconds, why)
        self.penalized[peer] = (failures, time.monotonic() + seconds)
        self.dht.routing_table.remove_peer(peer)
        self.count("evicted")

    async def bounded(self, peer: ID, call: Callable[[], Awaitable[Any]], what: str) -> Any:
        """``call()`` with the per-peer deadline; None (and the peer penalized) if it fails.
        An answer too large to read is no sign of a failing peer (a directory that anyone
        writes to holds what it was given, and a peer of another version may allow more):
        it is counted, not penalized."""
        try:
            with trio.fail_after(QUERY_SECONDS):
                result = await call()
        except Oversize as error:
            self.count("oversize answers")
            log.debug("%s from %s refused: %s", what, peer, error)
        except trio.TooSlowError:
            self.penalize(peer, f"{what} timed out after {QUERY_SECONDS:g} s")
        except Exception as error:  # any failure of a remote peer: drop it, carry on
            self.penalize(peer, f"{what} failed: {type(error).__name__}: {error}")
        else:
            self.penalized.pop(peer, None)
            return result
        return None

    async def closest(self, key: str) -> list[ID]:
        """The ``REPLICAS`` peers closest to ``key`` that answered (this one included when it
        is among them): the last lookup's, if it is under ``REPLICAS_SECONDS`` old and none of
        them has failed or is slow to answer since, else a new lookup."""
        now, me = time.monotonic(), self.host.get_id()
        last = self.replicas.get(key)
        if last is not None and now - last[0] < REPLICAS_SECONDS:
            slow = {p for p, since in self.querying.items() if now - since > SLOW_SECONDS}
            if all(p == me or (self._usable(p) and p not in slow) for p in last[1]):
                return last[1]
        found = await self._lookup(key)
        if len(self.replicas) >= REPLICAS_KEPT:  # the expired go; all, if none has yet
            fresh = {k: v for k, v in self.replicas.items() if now - v[0] < REPLICAS_SECONDS}
            self.replicas = fresh if len(fresh) < REPLICAS_KEPT else {}
        self.replicas[key] = (time.monotonic(), found)
        return found

    async def _lookup(self, key: str) -> list[ID]:
        """An iterative Kademlia lookup of ``key``'s closest peers, ``ALPHA`` queries in flight.

        A query still open after ``SLOW_SECONDS`` no longer holds the lookup up: the next-
        closest peer is asked in its place (it still counts if it answers in time). The whole
        lookup ends within ``LOOKUP_SECONDS``; a query fails (and its peer is evicted) only after
        ``QUERY_SECONDS``, long enough for a new connection over a slow link."""
        target = hashlib.sha256(key.encode()).digest()
        me = self.host.get_id()
        known = {
            *self.dht.routing_table.find_local_closest_peers(target, 20),
            *self.host.get_connected_peers(),  # right after joining, the table is empty
        }
        answered: set[ID] = {me}
        asked: set[ID] = {me}
        pending: dict[ID, float] = {}  # asked, not answered: when
        send, receive = trio.open_memory_channel[tuple[ID, list[ID] | None]](math.inf)

        async def ask(peer: ID) -> None:
            self.querying.setdefault(peer, time.monotonic())
            try:
                found = await self.bounded(
                    peer,
                    lambda: self.dht.peer_routing._query_peer_for_closest(peer, target),
                    "a lookup",
                )
            finally:
                self.querying.pop(peer, None)
            # The lookup may be over (it met its deadline): then nobody listens.
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                send.send_nowait((peer, found))

        async with receive:
            with trio.move_on_after(LOOKUP_SECONDS):
                while True:
                    now = time.monotonic()
                    slow = {
                        p
                        for p, since in (*pending.items(), *self.querying.items())
                        if now - since > SLOW_SECONDS
                    }
                    candidates = [p for p in known if p not in slow and self._usable(p)]
                    top = sort_peer_ids_by_distance(target, [me, *candidates])[:REPLICAS]
                    waiting = len(pending.keys() - slow)
                    for peer in [p for p in top if p not in asked][: max(0, ALPHA - waiting)]:
                        asked.add(peer)
                        pending[peer] = now
                        waiting += 1
                        self._spawn(ask, peer)
                    if waiting == 0 and all(p in answered for p in top):
                        break  # the closest known have all answered
                    if not pending:
                        break  # nobody left to ask
                    with trio.move_on_after(SLOW_SECONDS / 2):
                        peer, found = await receive.receive()
                        del pending[peer]
                        if found is not None:
                            answered.add(peer)
                            known.update(p for p in found if p != me and self._usable(p))
        return sort_peer_ids_by_distance(target, list(answered))[:REPLICAS]

    def _spawn(self, task: Callable[[ID], Awaitable[None]], peer: ID) -> None:
        assert self.background is not None, "the sidecar's nursery is not running"
        self.background.start_soon(task, peer)

    async def remote(self, peer: ID, request: dict[str, Any]) -> dict[str, Any] | None:
        async def call() -> dict[str, Any]:
            stream = await self.host.new_stream(peer, [DIRECTORY_PROTOCOL])
            try:
                await write_message(stream, request)
                return await read_message(stream)
            finally:
                await stream.close()

        answer: dict[str, Any] | None = await self.bounded(peer, call, request["op"])
        return answer

    async def on_replicas(
        self, key: str, local: Callable[[], Any], request: dict[str, Any]
    ) -> list[Any]:
        """``request`` sent to the peers that hold ``key`` (``local()`` for this one): their
        answers, once all have answered, or once ``SLOW_SECONDS`` have passed with at least one
        answer in (a slow replica is not waited for; the others hold the same entries)."""
        replicas = await self.closest(key)
        answers: list[Any] = []
        send, receive = trio.open_memory_channel[Any](math.inf)

        async def one(peer: ID) -> None:
            answer = await self.remote(peer, request)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                send.send_nowait(answer)

        remote = [p for p in replicas if p != self.host.get_id()]
        if len(remote) < len(replicas):
            answers.append(local())
        for peer in remote:
            self._spawn(one, peer)
        async with receive:
            soft = trio.current_time() + SLOW_SECONDS
            with trio.move_on_after(QUERY_SECONDS):
                for _ in remote:
                    # Only an answer holds the entries: a replica that failed at once (None)
                    # does not end the wait for the others.
                    answered = any(a is not None for a in answers)
                    with trio.CancelScope(deadline=soft if answered else math.inf) as scope:
                        answers.append(await receive.receive())
                    if scope.cancelled_caught:
                        break
        return [a for a in answers if a is not None]

    async def store(self, key: str, subkey: str, value: bytes, expires: float) -> int:
        """Store on the key's replicas; how many took it. Each replica checks the value itself
        (this one too, when it is a replica): a value none may hold is stored nowhere."""
        request = {
            "op": "store",
            "key": key,
            "subkey": subkey,
            "value": base64.b64encode(value).decode(),
            "expires": expires,
        }

        def local() -> dict[str, Any]:
            try:
                stored = self.directory.store(key, subkey, value, expires, time.time())
            except ValueError as error:  # refused here, as the other replicas refuse it
                return {"error": str(error)[:200]}
            return {"ok": stored}

        answers = await self.on_replicas(key, local, request)
        # Only a replica that says it stored the value counts (not one that holds a newer one).
        return sum(a.get("ok") is True for a in answers)

    async def get(self, key: str) -> dict[str, Entry]:
        """The key's unexpired entries, merged from its replicas (the latest expiry wins)."""
        found: dict[str, Entry] = {}
        held_by: dict[str, int] = {}
        local = lambda: {"entries": encode_entries(self.directory.get(key, time.time()))}  # noqa: E731
        for answer in await self.on_replicas(key, local, {"op": "get", "key": key}):
            try:
                entries = decode_entries(answer.get("entries"))
                dropped = merge(key, found, entries, time.time())
            except ValueError:
                self.count("malformed answers")
                continue
            if dropped:
                self.count("invalid entries dropped")
            for subkey in entries:
                held_by[subkey] = held_by.get(subkey, 0) + 1
        # Replicas that filled up at different times hold different entries: their union, cut
        # to one key's limits, is what fits the answer to the node.
        return bound(found, held_by)

    async def serve_directory(self, stream: INetStream) -> None:
        """Another peer's store or get. Any failure resets this stream, never the host."""
        try:
            with trio.fail_after(QUERY_SECONDS * 2):
                request = await read_message(stream)
                now = time.time()
                if request.get("op") == "store":
                    value = base64.b64decode(str(request.get("value")), validate=True)
                    expires = request.get("expires")
                    if not isinstance(expires, int | float) or isinstance(expires, bool):
                        raise ValueError("malformed expiry")
                    stored = self.directory.store(
                        str(request.get("key")),
                        str(request.get("subkey")),
                        value,
                        expires,
                        now,
                        storer=stream.muxed_conn.peer_id.to_bytes(),
                    )
                    await write_message(stream, {"ok": stored})  # False: a newer one is held
                elif request.get("op") == "get":
                    entries = self.directory.get(str(request.get("key")), now)
                    await write_message(stream, {"entries": encode_entries(entries)})
                else:
                    raise ValueError(f"unknown op {request.get('op')!r}")
            await stream.close()
        except Exception as error:  # a bad or slow peer: its stream ends, the host stays up
            self.count("refused values" if isinstance(error, RecordError) else "bad requests")
            if time.monotonic() >= self.quiet_until:  # one line per LOG_EVERY_SECONDS at most
                self.quiet_until = time.monotonic() + LOG_EVERY_SECONDS
                log.info(
                    "directory request refused: %s: %s (so far: %d refused values, %d bad "
                    "requests)",
                    type(error).__name__,
                    str(error)[:200],
                    self.counts.get("refused values", 0),
                    self.counts.get("bad requests", 0),
                )
            with contextlib.suppress(Exception):  # the stream may be gone: nothing to tell
                await write_message(stream, {"error": str(error)[:200]})
            await stream.reset()

    async def join(self, bootstrap: list[str]) -> None:
        """Connect to the bootstrap peers (at least one must answer), then fill the routing
        table by looking up this peer's own neighbourhood."""
        reached: list[str] = []
        errors: list[str] = []

        async def connect(address: str) -> None:
            try:
                info = info_from_p2p_addr(multiaddr.Multiaddr(address))
                with trio.fail_after(CONNECT_SECONDS):
                    await self.host.connect(info)
                reached.append(address)
            except trio.TooSlowError:
                errors.append(f"{address}: no answer in {CONNECT_SECONDS:g} s")
            except Exception as error:  # bad address, refused, wrong network key
                errors.append(f"{address}: {type(error).__name__}: {error}")

        async with trio.open_nursery() as nursery:
            for address in bootstrap:
                nursery.start_soon(connect, address)
        if bootstrap and not reached:
            raise ConnectionError(
                f"no bootstrap peer answered ({'; '.join(errors)}), or this node's --dht-secret"
                " differs from the bootstrap's"
            )
        await self.refresh()

    async def refresh(self) -> None:
        """Look up this peer's own neighbourhood: the peers asked enter the routing table, and
        peers near this one learn of it."""
        await self._lookup(str(self.host.get_id()))

    async def refresh_forever(self) -> None:
        for delay in itertools.chain(REFRESH_SECONDS, itertools.repeat(REFRESH_SECONDS[-1])):
            await trio.sleep(delay)
            await self.refresh()
