"""The delay proxy that stands in for netem: a connection through it takes both ends' one-way
latency each way, jitter never reorders or corrupts the bytes, and the end of a stream gets
through."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


async def _echo_server() -> tuple[asyncio.Server, int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _stop(proxy: subprocess.Popen[str], server: asyncio.Server) -> None:
    proxy.terminate()
    proxy.wait(10)
    assert proxy.stdout is not None
    proxy.stdout.close()
    server.close()
    await server.wait_closed()


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


def _proxy(target: int, peers: Path, *extra: str) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(
        [sys.executable, "-m", "swarmgrad.simulations.delay_proxy", "--listen", "127.0.0.1:0",
         "--target", f"127.0.0.1:{target}", "--peers", str(peers), *extra],
        stdout=subprocess.PIPE, text=True, env=os.environ.copy(),
    )  # fmt: skip
    assert process.stdout is not None
    line = process.stdout.readline()  # "listening PORT", once it is
    assert line.startswith("listening"), line
    return process, int(line.split()[1])


@pytest.mark.asyncio
async def test_a_connection_through_the_proxy_takes_both_ends_latency(tmp_path: Path) -> None:
    server, port = await _echo_server()
    peers = tmp_path / "peers.json"
    peers.write_text(json.dumps({"127.0.0.1": 30.0}))  # the caller's one-way latency
    proxy, proxy_port = _proxy(port, peers, "--latency-ms", "20")
    try:
        async with asyncio.timeout(20):
            for target, least in ((port, 0.0), (proxy_port, 0.100)):  # 2 x (30 + 20) ms
                reader, writer = await asyncio.open_connection("127.0.0.1", target)
                rtts = []
                for _ in range(5):
                    started = time.perf_counter()
                    writer.write(b"ping")
                    await writer.drain()
                    assert await reader.readexactly(4) == b"ping"
                    rtts.append(time.perf_counter() - started)
                await _close(writer)
                if least:
                    assert min(rtts) >= least
                    assert min(rtts) < least + 0.1  # and not much more
                else:
                    assert max(rtts) < 0.05  # direct: no delay
    finally:
        await _stop(proxy, server)


@pytest.mark.asyncio
async def test_jitter_keeps_every_byte_in_order_and_the_end_gets_through(tmp_path: Path) -> None:
    server, port = await _echo_server()
    peers = tmp_path / "peers.json"
    peers.write_text("{}")
    proxy, proxy_port = _proxy(port, peers, "--latency-ms", "5", "--jitter-ms", "5")
    payload = os.urandom(3 * 1024 * 1024)
    try:
        async with asyncio.timeout(30):
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)

            async def send() -> None:
                for start in range(0, len(payload), 100_000):
                    writer.write(payload[start : start + 100_000])
                    await writer.drain()
                writer.write_eof()

            sending = asyncio.create_task(send())
            received = await reader.read(-1)  # until the echo's end of stream
            await sending
            await _close(writer)
        assert received == payload
    finally:
        await _stop(proxy, server)
