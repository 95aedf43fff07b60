"""The py-libp2p discovery sidecar: a trio process that holds a libp2p host, its Kademlia DHT
and a directory of signed records, and serves the node over a local socket.

Run by :mod:`swarmgrad.node.discovery.libp2p_dht` (never imported by the node: libp2p and hivemind
cannot share a process)::

    python -m swarmgrad.node.discovery.libp2p_sidecar --fd 3 --listen /ip4/127.0.0.1/tcp/0 \\
        [--bootstrap MADDR ...]

Two lines come on standard input, never on the command line (which any local user can read in
``/proc``): the node's Ed25519 private key (32 bytes, hex), so the DHT peer id and multiaddr stay
the same across restarts, and the network's pre-shared key (64 hex digits: a private run's is
derived from its secret). The sidecar ignores SIGINT: a Ctrl-C in the node's terminal reaches
every process of the group, and the node, which leaves the swarm through this sidecar, stops it.

The node talks over the inherited socket ``--fd``: one JSON object per line each way. First the
sidecar says ``{"event": "ready", "maddrs": [...]}`` or ``{"event": "failed", "error": ...}``;
then it answers requests ``{"id", "op", ...}`` with ``{"id", ...}`` or ``{"id", "error"}``. Ops:
``store`` (key, subkey, value (base64), expires), ``get`` (key), ``closest`` (key: the peers
holding it), ``maddrs``, ``stats``. Unasked, whenever they change (checked every
``PEERS_SECONDS``), it tells ``{"event": "peers", "peers": [...]}``: the addresses of peers it
knows, through which the node restarts it if it dies after the bootstrap peers left. It exits
when that socket closes (the node died or left).

Where records live: Kademlia's routing finds the ``REPLICAS`` peers closest to SHA-256(key);
each keeps, per key, one entry per subkey (the latest expiry wins), like hivemind's dictionary
values (``libp2p_directory.py``), served by our own protocol (``DIRECTORY_PROTOCOL``,
``libp2p_kademlia.py``). py-libp2p's own values
hold one value per key, which cannot list a swarm's peers. Storers keep only swarmgrad's sealed
values filed where their seal says (``records.validate``: signature, key, the signer's own slot,
expiry), and a get drops any entry another peer returns that fails the same check before it can
shadow a genuine one; the node checks again.

What this contains of py-libp2p 0.8.1's defects (measured, ../DESIGN.md section 5):
- plaintext and SECIO are offered by default: the host offers Noise only, under a pre-shared
  key (libp2p private networks): the public swarmgrad key, or a run's own for a private run, so
  no other libp2p network merges with ours;
- an exception in a stream handler kills the host: every handler catches and resets;
- ``connect()`` to a silent peer blocks for 120 s, and a lookup waits for its slowest peer: every
  connect, stream and query runs under a deadline;
- frozen peers are never evicted: a peer that misses a deadline leaves the routing table and is
  skipped by lookups for a while (longer with each failure in a row);
- AutoNAT always says "reachable": not used (the node's own reachability check decides).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import logging
import signal
import socket
import sys
from contextlib import AsyncExitStack
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_noise_key_pair
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.network.config import ConnectionConfig
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.tools.anyio_service import background_trio_service

from swarmgrad.node.discovery.libp2p_directory import encode_entries
from swarmgrad.node.discovery.libp2p_kademlia import (
    CONNECT_SECONDS,
    DIRECTORY_PROTOCOL,
    QUERY_SECONDS,
    Sidecar,
)

log = logging.getLogger("swarmgrad.libp2p_sidecar")
PEERS_SECONDS = 1.0


def network_key(secret: str = "") -> str:
    """The libp2p pre-shared key (64 hex digits): swarmgrad's public network, or a private
    run's own if ``secret`` is given."""
    return hashlib.sha256(f"swarmgrad/dht/v1\0{secret}".encode()).hexdigest()


# -- the local socket ---------------------------------------------------------------------------


async def serve_node(sidecar: Sidecar, stream: trio.SocketStream) -> None:
    """Answer the node's requests (concurrently) until it closes the socket."""
    send_lock = trio.Lock()

    async def send(message: dict[str, Any]) -> None:
        # The node may be gone (it closed its end): the receive loop below then ends this.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
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

    async def tell_peers() -> None:
        told: list[str] = []
        while True:
            peers = sorted(sidecar.known_peers())
            if peers and peers != told:
                await send({"event": "peers", "peers": peers})
                told = peers
            await trio.sleep(PEERS_SECONDS)

    await send({"event": "ready", "maddrs": sidecar.maddrs()})
    buffer = b""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tell_peers)
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
            if not sidecar.maddrs():  # py-libp2p reports a port it could not bind by no address
                raise OSError(f"could not listen on {args.listen} (is the port in use?)")
            await stack.enter_async_context(background_trio_service(dht))
            contain_handlers(host, sidecar)
            background = await stack.enter_async_context(trio.open_nursery())
            sidecar.background = background
            await sidecar.join(args.bootstrap)
        except Exception as error:
            failed = {
                "event": "failed",
                "error": f"{type(error).__name__}: {error}",
                "bind": not sidecar.maddrs(),  # it could not listen: the node's setup, not the DHT
            }
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
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # before trio.run, which then leaves it be
    try:
        seed = bytes.fromhex(sys.stdin.readline().strip())
        args.network_key = sys.stdin.readline().strip()
        psk_ok = len(bytes.fromhex(args.network_key)) == 32
    except ValueError:
        seed, psk_ok = b"", False
    if len(seed) != 32 or not psk_ok:
        sys.exit("expected the Ed25519 private key and the network key (hex) on standard input")
    trio.run(run, args, seed)


if __name__ == "__main__":
    main()
