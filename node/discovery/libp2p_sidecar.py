"""The py-libp2p discovery sidecar: a trio process that holds a libp2p host, its Kademlia DHT
and a directory of signed records, and serves the node over a local socket.

Run by :mod:`swarmgrad.node.discovery.libp2p_dht` (never imported by the node: libp2p and hivemind
cannot share a process)::

    python -m swarmgrad.node.discovery.libp2p_sidecar --fd 3 --listen /ip4/127.0.0.1/tcp/0 \\
        [--bootstrap MADDR ...] [--network-key HEX]

The node's Ed25519 private key (32 bytes, hex) comes on standard input, so the DHT peer id and
multiaddr stay the same across restarts. The node talks over the inherited socket ``--fd``: one
JSON object per line each way. First the sidecar says ``{"event": "ready", "maddrs": [...]}`` or
``{"event": "failed", "error": ...}``; then it answers requests ``{"id", "op", ...}`` with
``{"id", ...}`` or ``{"id", "error"}``. Ops: ``store`` (key, subkey, value (base64), expires),
``get`` (key), ``closest`` (key: the peers holding it), ``maddrs``, ``stats``. It exits when
that socket closes (the node died or left).

Where records live: Kademlia's routing finds the ``REPLICAS`` peers closest to SHA-256(key);
each keeps, per key, one entry per subkey (the latest expiry wins), like hivemind's dictionary
values, served by this module's own protocol (``DIRECTORY_PROTOCOL``). py-libp2p's own values
hold one value per key, which cannot list a swarm's peers. Storers keep only swarmgrad's sealed
values filed where their seal says (``records.validate``: signature, key, the signer's own slot,
expiry), and a get drops any entry another peer returns that fails the same check before it can
shadow a genuine one; the node checks again.

What this contains of py-libp2p 0.8.1's defects (measured, ../DESIGN.md section 5):
- plaintext and SECIO are offered by default: the host offers Noise only, under a pre-shared
  key (libp2p private networks): the public swarmgrad key, or a run's own for a private run, so
  no other libp2p network merges with ours;
- an exception in a stream handler kills the host: every handler here catches and resets;
- ``connect()`` to a silent peer blocks for 120 s, and a lookup waits for its slowest peer: every
  connect, stream and query here runs under a deadline;
- frozen peers are never evicted: a peer that misses a deadline leaves the routing table and is
  skipped by lookups for a while (longer with each failure in a row);
- AutoNAT always says "reachable": not used (the node's own reachability check decides).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import itertools
import json
import logging
import math
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_noise_key_pair
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.routing_table import KBucket
from libp2p.kad_dht.utils import sort_peer_ids_by_distance
from libp2p.network import swarm as libp2p_swarm
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.tools.anyio_service import background_trio_service

from swarmgrad.node.discovery.envelope import RecordError
from swarmgrad.node.discovery.records import validate

log = logging.getLogger("swarmgrad.libp2p_sidecar")
LOG_EVERY_SECONDS = 10.0


DIRECTORY_PROTOCOL = TProtocol("/swarmgrad/directory/1.0.0")
REPLICAS = 5  # peers that hold each key's entries
ALPHA = 3  # queries in flight at once in a lookup
PING_SECONDS = 0.5  # a routing table's liveness check
SLOW_SECONDS = 0.5  # a query open this long no longer holds a lookup up
QUERY_SECONDS = 3.0  # a query that has not answered by now failed: its peer is evicted
LOOKUP_SECONDS = 1.5  # a whole lookup; then the closest peers that answered are used
CONNECT_SECONDS = 5.0
PENALTY_SECONDS = (10.0, 300.0)  # after a first failure; the cap after many in a row
REFRESH_SECONDS = (2.0, 5.0, 15.0, 30.0)  # after joining, then every 30 s
MAX_MESSAGE_BYTES = 1 << 20
MAX_KEY_CHARS, MAX_SUBKEY_CHARS = 512, 128
MAX_ENTRIES_PER_KEY, MAX_ENTRIES = 4096, 65536

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


def network_key(secret: str = "") -> str:
    """The libp2p pre-shared key (64 hex digits): swarmgrad's public network, or a private
    run's own if ``secret`` is given."""
    return hashlib.sha256(f"swarmgrad/dht/v1\0{secret}".encode()).hexdigest()


# -- the directory: entries by key and subkey ---------------------------------------------------


@dataclass(slots=True)
class Entry:
    value: bytes
    expires: float


class Directory:
    """What this peer stores for others, bounded in entries, sizes and lifetimes."""

    def __init__(self) -> None:
        self.keys: dict[str, dict[str, Entry]] = {}

    def store(self, key: str, subkey: str, value: bytes, expires: float, now: float) -> bool:
        check_entry(key, subkey, value, expires, now)
        self._purge(now)
        entries = self.keys.setdefault(key, {})
        old = entries.get(subkey)
        if old is not None and old.expires >= expires:
            return False  # a newer value (or this one) is already held
        if old is None and (
            len(entries) >= MAX_ENTRIES_PER_KEY
            or sum(len(e) for e in self.keys.values()) >= MAX_ENTRIES
        ):
            raise ValueError("this peer's directory is full")
        entries[subkey] = Entry(value, expires)
        return True

    def get(self, key: str, now: float) -> dict[str, Entry]:
        return {s: e for s, e in self.keys.get(key, {}).items() if e.expires > now}

    def _purge(self, now: float) -> None:
        for key in list(self.keys):
            live = {s: e for s, e in self.keys[key].items() if e.expires > now}
            if live:
                self.keys[key] = live
            else:
                del self.keys[key]


def check_entry(key: str, subkey: str, value: bytes, expires: float, now: float) -> None:
    """ValueError (RecordError) unless ``value`` is a sealed value that may live under (key,
    subkey) until ``expires``."""
    if not 0 < len(key) <= MAX_KEY_CHARS or not 0 < len(subkey) <= MAX_SUBKEY_CHARS:
        raise ValueError("key or subkey empty or too long")
    validate(key, subkey, value, expires, now)


def merge(key: str, into: dict[str, Entry], entries: dict[str, Entry], now: float) -> int:
    """Merge another peer's ``entries`` for ``key`` (the latest expiry wins); how many it
    returned that were not valid (dropped: they must not shadow a genuine entry)."""
    dropped = 0
    for subkey, entry in entries.items():
        try:
            check_entry(key, subkey, entry.value, entry.expires, now)
        except RecordError:
            dropped += 1
            continue
        if subkey not in into or into[subkey].expires < entry.expires:
            into[subkey] = entry
    return dropped


def encode_entries(entries: dict[str, Entry]) -> list[dict[str, Any]]:
    return [
        {"subkey": s, "value": base64.b64encode(e.value).decode(), "expires": e.expires}
        for s, e in entries.items()
    ]


def decode_entries(raw: object) -> dict[str, Entry]:
    """Entries from a peer's answer; raises ValueError on anything malformed."""
    if not isinstance(raw, list) or len(raw) > MAX_ENTRIES_PER_KEY:
        raise ValueError("entries must be a list")
    entries = {}
    for item in raw:
        if not isinstance(item, dict) or set(item) != {"subkey", "value", "expires"}:
            raise ValueError("malformed entry")
        subkey, value, expires = item["subkey"], item["value"], item["expires"]
        if not isinstance(subkey, str) or not isinstance(value, str):
            raise ValueError("malformed entry")
        if not isinstance(expires, int | float) or isinstance(expires, bool):
            raise ValueError("malformed entry")
        entries[subkey] = Entry(base64.b64decode(value, validate=True), float(expires))
    return entries


# -- framing on libp2p streams -------------------------------------------------------------------


async def read_message(stream: INetStream) -> dict[str, Any]:
    header = await _read_exactly(stream, 4)
    size = int.from_bytes(header, "big")
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"a message of {size} bytes")
    message = json.loads(await _read_exactly(stream, size))
    if not isinstance(message, dict):
        raise ValueError("a message that is not an object")
    return message


async def write_message(stream: INetStream, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    await stream.write(len(data).to_bytes(4, "big") + data)


async def _read_exactly(stream: INetStream, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = await stream.read(size - len(data))
        if not chunk:
            raise EOFError("the stream ended early")
        data += chunk
    return data


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

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def maddrs(self) -> list[str]:
        return [str(a) for a in self.host.get_addrs()]

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
        """``call()`` with the per-peer deadline; None (and the peer penalized) if it fails."""
        try:
            with trio.fail_after(QUERY_SECONDS):
                result = await call()
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
        is among them): an iterative Kademlia lookup, ``ALPHA`` queries in flight.

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
                    with trio.CancelScope(deadline=soft if answers else math.inf) as scope:
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
                self.directory.store(key, subkey, value, expires, time.time())
            except ValueError as error:  # refused here, as the other replicas refuse it
                return {"error": str(error)[:200]}
            return {"ok": True}

        answers = await self.on_replicas(key, local, request)
        return sum("error" not in a for a in answers)

    async def get(self, key: str) -> dict[str, Entry]:
        """The key's unexpired entries, merged from its replicas (the latest expiry wins)."""
        found: dict[str, Entry] = {}
        local = lambda: {"entries": encode_entries(self.directory.get(key, time.time()))}  # noqa: E731
        for answer in await self.on_replicas(key, local, {"op": "get", "key": key}):
            try:
                dropped = merge(key, found, decode_entries(answer.get("entries")), time.time())
            except ValueError:
                self.count("malformed answers")
                continue
            if dropped:
                self.count("invalid entries dropped")
        return found

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
                    self.directory.store(
                        str(request.get("key")), str(request.get("subkey")), value, expires, now
                    )
                    await write_message(stream, {"ok": True})
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
            raise ConnectionError("no bootstrap peer answered (" + "; ".join(errors) + ")")
        await self.refresh()

    async def refresh(self) -> None:
        """Look up this peer's own neighbourhood: the peers asked enter the routing table, and
        peers near this one learn of it."""
        await self.closest(str(self.host.get_id()))

    async def refresh_forever(self) -> None:
        for delay in itertools.chain(REFRESH_SECONDS, itertools.repeat(REFRESH_SECONDS[-1])):
            await trio.sleep(delay)
            await self.refresh()


# -- the local socket ---------------------------------------------------------------------------


async def serve_node(sidecar: Sidecar, stream: trio.SocketStream) -> None:
    """Answer the node's requests (concurrently) until it closes the socket."""
    send_lock = trio.Lock()

    async def send(message: dict[str, Any]) -> None:
        async with send_lock:
            await stream.send_all(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    async def answer(request: dict[str, Any]) -> None:
        reply: dict[str, Any] = {"id": request.get("id")}
        try:
            op = request.get("op")
            if op == "store":
                value = base64.b64decode(str(request["value"]), validate=True)
                reply["stored"] = await sidecar.store(
                    str(request["key"]), str(request["subkey"]), value, float(request["expires"])
                )
            elif op == "get":
                reply["entries"] = encode_entries(await sidecar.get(str(request["key"])))
            elif op == "closest":  # the peers that hold a key's entries (diagnostics)
                reply["peers"] = [str(p) for p in await sidecar.closest(str(request["key"]))]
            elif op == "maddrs":
                reply["maddrs"] = sidecar.maddrs()
            elif op == "stats":
                reply["stats"] = {
                    **sidecar.counts,
                    "routing_table": sidecar.dht.routing_table.size(),
                    "entries": sum(len(e) for e in sidecar.directory.keys.values()),
                    "connected": len(sidecar.host.get_connected_peers()),
                }
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as error:  # reported to the node, which raises DiscoveryError
            reply["error"] = f"{type(error).__name__}: {error}"
        await send(reply)

    await send({"event": "ready", "maddrs": sidecar.maddrs()})
    buffer = b""
    async with trio.open_nursery() as nursery:
        while True:
            data = await stream.receive_some(1 << 16)
            if not data:  # the node closed its end (or died): this process is done
                nursery.cancel_scope.cancel()
                return
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                nursery.start_soon(answer, json.loads(line))


def contain_handlers(host: IHost, sidecar: Sidecar) -> None:
    """Wrap every stream handler the host has (py-libp2p's DHT, identify and ping, and ours):
    py-libp2p awaits a handler unguarded, so one that raises on a peer's bad input would take
    the whole host down. Wrapped, it costs that peer its stream."""
    mux = host.get_mux()

    def contained(protocol: TProtocol, handler: Any) -> Any:
        async def guarded(stream: INetStream) -> None:
            try:
                await handler(stream)
            except Exception as error:  # a peer's bad input: its stream ends, the host lives
                sidecar.count("handler errors")
                log.debug("%s handler: %s: %s", protocol, type(error).__name__, error)
                with contextlib.suppress(Exception):
                    await stream.reset()

        return guarded

    for protocol, handler in list(mux.handlers.items()):
        if protocol is not None and handler is not None:
            host.set_stream_handler(protocol, contained(protocol, handler))


async def run(args: argparse.Namespace, seed: bytes) -> None:
    sock = trio.socket.from_stdlib_socket(socket.socket(fileno=args.fd))
    stream = trio.SocketStream(sock)
    key_pair = create_new_key_pair(seed)
    noise = NoiseTransport(key_pair, noise_privkey=create_noise_key_pair().private_key)
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},  # Noise only: no plaintext, no SECIO, no TLS
        psk=args.network_key,
        connection_config=ConnectionConfig(
            dial_timeout=CONNECT_SECONDS,
            # py-libp2p finishes a new connection's handshakes in a scope shielded from the
            # caller's deadline, bounded by this alone (10 s by default).
            outbound_upgrade_timeout=QUERY_SECONDS,
            outbound_stream_protocol_negotiation_timeout=QUERY_SECONDS,
            inbound_upgrade_timeout=CONNECT_SECONDS,
            inbound_stream_protocol_negotiation_timeout=CONNECT_SECONDS,
        ),
    )
    dht = KadDHT(host, DHTMode.SERVER)
    sidecar = Sidecar(host, dht)
    host.set_stream_handler(DIRECTORY_PROTOCOL, sidecar.serve_directory)
    async with AsyncExitStack() as stack:
        try:
            await stack.enter_async_context(host.run([multiaddr.Multiaddr(args.listen)]))
            await stack.enter_async_context(background_trio_service(dht))
            contain_handlers(host, sidecar)
            background = await stack.enter_async_context(trio.open_nursery())
            sidecar.background = background
            await sidecar.join(args.bootstrap)
        except Exception as error:
            failed = {"event": "failed", "error": f"{type(error).__name__}: {error}"}
            await stream.send_all(json.dumps(failed).encode() + b"\n")
            if sidecar.background is not None:
                sidecar.background.cancel_scope.cancel()
            return
        try:
            background.start_soon(sidecar.refresh_forever)
            await serve_node(sidecar, stream)
        finally:
            background.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fd", type=int, required=True, help="the node's end of a socket pair")
    parser.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    parser.add_argument("--bootstrap", nargs="*", default=[])
    parser.add_argument("--network-key", default=network_key())
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args()
    # py-libp2p logs every failed dial (routine in a swarm) as an error, some through the root
    # logger: only this module's own messages are shown.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("dht sidecar %(levelname)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(args.log_level)
    log.propagate = False
    logging.getLogger().handlers[:] = [logging.NullHandler()]
    logging.getLogger().setLevel(logging.CRITICAL)
    logging.getLogger("libp2p").handlers[:] = [logging.NullHandler()]
    seed = bytes.fromhex(sys.stdin.readline().strip())
    if len(seed) != 32:
        sys.exit("expected the 32-byte Ed25519 private key (hex) on standard input")
    trio.run(run, args, seed)


if __name__ == "__main__":
    main()
