"""Latency and jitter for ``simulate --netem``, in user space: this kernel has no netem qdisc.

One proxy runs in each node's namespace. nftables redirects the TCP connections the node makes
to other nodes' gRPC port (on ``wan0``) to the proxy, which finds where each was going
(``SO_ORIGINAL_DST``), connects there itself (its packets marked, so they are not redirected
again) and relays both directions, holding each chunk until ``now + delay + jitter``: the delay
is the sum of both ends' one-way ``latency_ms`` (this node's, plus the other's, looked up by its
address in the peers file the simulation keeps), the jitter uniform in +-``jitter_ms``, and a
chunk never overtakes the one before (TCP keeps order: jitter shows as variance, not
reordering). Redirecting on the caller's side keeps the caller's own address on the connection
the other node accepts (the dial-back checks rely on it). The node knows nothing of the proxy.
The DHT's own connections are not delayed. ``--target`` relays to one fixed address instead
(for tests on loopback).

    python -m swarmgrad.simulations.delay_proxy --listen 0.0.0.0:7071 --mark 0x5347 \\
        --latency-ms 20 --jitter-ms 5 --peers peers.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024
#: Bytes held per direction before the reader waits (the proxy's own "queue").
BUFFER_BYTES = 8 * 1024 * 1024
CONNECT_TIMEOUT_SECONDS = 10.0
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h


@dataclass(frozen=True, slots=True, kw_only=True)
class DelayConfig:
    latency_ms: float = 0.0  # this node's one-way latency to the core
    jitter_ms: float = 0.0
    peers: Path | None = None  # JSON {address: latency_ms} of the other nodes
    seed: int = 0

    def __post_init__(self) -> None:
        if self.latency_ms < 0 or self.jitter_ms < 0:
            raise ValueError("latency_ms and jitter_ms must be >= 0")


class Delays:
    """The one-way delay of a connection from ``address``, and each chunk's release time."""

    def __init__(self, config: DelayConfig) -> None:
        self.config = config
        self._random = random.Random(config.seed)
        self._peers: dict[str, float] = {}
        self._peers_mtime = -1.0

    def of(self, address: str) -> float:
        """Seconds each way: the other end's latency plus this node's."""
        return (self._peer_latency(address) + self.config.latency_ms) / 1000.0

    def jitter(self) -> float:
        spread = self.config.jitter_ms / 1000.0
        return self._random.uniform(-spread, spread) if spread else 0.0

    def _peer_latency(self, address: str) -> float:
        path = self.config.peers
        if path is None:
            return 0.0
        with contextlib.suppress(OSError, ValueError):
            mtime = path.stat().st_mtime
            if mtime != self._peers_mtime:  # the simulation adds hosts as it makes them
                loaded = json.loads(path.read_text())
                self._peers = {str(k): float(v) for k, v in loaded.items()}
                self._peers_mtime = mtime
        return self._peers.get(address, 0.0)


async def _relay(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    delay: float,
    delays: Delays,
) -> None:
    """Copy ``reader`` to ``writer``, each chunk released ``delay`` (+ jitter) after it came,
    in order; the end of the stream follows the last chunk."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    held = asyncio.Semaphore(max(1, BUFFER_BYTES // CHUNK_BYTES))

    async def pump() -> None:
        release = 0.0
        while True:
            await held.acquire()
            data = await reader.read(CHUNK_BYTES)
            release = max(release, loop.time() + delay + delays.jitter())
            await queue.put((release, data))
            if not data:
                return

    async def deliver() -> None:
        while True:
            release, data = await queue.get()
            wait = release - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            held.release()
            if not data:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(pump())
        tasks.create_task(deliver())


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where a redirected connection was going (Linux ``SO_ORIGINAL_DST``, IPv4)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port = int.from_bytes(raw[2:4], "big")
    return socket.inet_ntoa(raw[4:8]), port


async def _connect(address: tuple[str, int], mark: int) -> tuple[asyncio.StreamReader, Any]:
    """A connection to ``address``, its packets marked ``mark`` (0: unmarked)."""
    if not mark:
        return await asyncio.open_connection(*address)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock)


async def serve(
    listen: tuple[str, int], target: tuple[str, int] | None, config: DelayConfig, mark: int = 0
) -> None:
    """Relay each accepted connection to ``target`` (delayed by the caller's latency and this
    node's), or, without one, to where it was going before nftables redirected it (delayed by
    this node's latency and the destination's)."""
    delays = Delays(config)

    async def accepted(client_reader: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        if target is None:
            destination = original_destination(client.get_extra_info("socket"))
            other = destination[0]
        else:
            destination = target
            peer = client.get_extra_info("peername")
            other = peer[0] if peer else ""
        delay = delays.of(other)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_SECONDS):
                node_reader, node = await _connect(destination, mark)
        except (OSError, TimeoutError) as error:
            log.warning("cannot reach %s:%d: %s", *destination, error)
            client.close()
            return
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(_relay(client_reader, node, delay, delays))
                tasks.create_task(_relay(node_reader, client, delay, delays))
        except* (OSError, ConnectionError) as errors:
            log.debug("connection from %s ended: %s", peer, errors.exceptions[0])
        finally:
            for writer in (client, node):
                writer.close()

    server = await asyncio.start_server(accepted, *listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        print(f"listening {server.sockets[0].getsockname()[1]}", flush=True)
        await stop.wait()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--listen", type=_address, required=True, help="host:port (port 0: any)")
    parser.add_argument(
        "--target", type=_address, help="relay to host:port (default: where each was going)"
    )
    parser.add_argument(
        "--mark", type=lambda text: int(text, 0), default=0, help="mark outgoing packets"
    )
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--peers", type=Path, help="JSON {address: latency_ms} of the others")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    config = DelayConfig(
        latency_ms=args.latency_ms, jitter_ms=args.jitter_ms, peers=args.peers, seed=args.seed
    )
    asyncio.run(serve(args.listen, args.target, config, args.mark))


if __name__ == "__main__":
    main()
