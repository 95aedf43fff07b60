"""A client without any key, flooding a node's gRPC server with silent calls: run as a script
(a process of its own, as a remote flooder would be, so its event loop is not the server's).

    python tests/integration/grpc_flooder.py ENDPOINT [--width N] [--channels N] \
        [--method /swarmgrad.v1.Averaging/Aggregate] [--unary] [--rate N] [--max-calls N]

It keeps ``width`` calls open at once over ``channels`` connections of its own; each call sends
nothing (a stream no header, a unary call no request) and is opened again as soon as it ends,
at most ``rate`` calls a second after the first ``width`` (a flood of slots, not of CPU: on a
shared test machine a flood as fast as one core goes measures that machine's load).
It prints ``flooding`` once it has opened twice ``width`` calls, floods until a line arrives on
stdin (or ``max-calls`` were opened), and prints one JSON line: the calls' statuses, how many
refusals named OVERLOADED, the median seconds a RESOURCE_EXHAUSTED call lasted, and the longest
any call lasted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
from collections import Counter
from typing import Any

import grpc

AGGREGATE = "/swarmgrad.v1.Averaging/Aggregate"


class Flood:
    def __init__(self, args: argparse.Namespace) -> None:
        # Each channel a connection of its own (gRPC would share one between them otherwise).
        options = [("grpc.use_local_subchannel_pool", 1)]
        self.channels = [
            grpc.aio.insecure_channel(args.endpoint, options=options) for _ in range(args.channels)
        ]
        self.args = args
        self.opened = 0
        self.statuses: Counter[str] = Counter()
        self.overloaded = 0
        self.exhausted_seconds: list[float] = []
        self.longest = 0.0
        self.started = asyncio.Event()
        self.tokens, self.filled = float(args.width), asyncio.get_running_loop().time()

    async def token(self) -> None:
        """Wait for the right to open one more call (a bucket of ``width``, ``rate`` a second)."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            self.tokens = min(self.args.width, self.tokens + (now - self.filled) * self.args.rate)
            self.filled = now
            if self.tokens >= 1:
                self.tokens -= 1
                return
            await asyncio.sleep((1 - self.tokens) / self.args.rate)

    async def worker(self, channel: grpc.aio.Channel) -> None:
        loop = asyncio.get_running_loop()
        while self.opened < self.args.max_calls:
            await self.token()
            self.opened += 1
            if self.opened >= 2 * self.args.width:
                self.started.set()
            began = loop.time()
            try:
                # A call opened without a request iterator sends what it is given: nothing.
                if self.args.unary:
                    await channel.stream_unary(self.args.method)(timeout=60)
                else:
                    async for _ in channel.stream_stream(self.args.method)(timeout=60):
                        pass
                self.statuses["OK"] += 1
            except grpc.aio.AioRpcError as error:
                self.statuses[error.code().name] += 1
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.exhausted_seconds.append(loop.time() - began)
                    self.overloaded += (error.details() or "").startswith("OVERLOADED")
            self.longest = max(self.longest, loop.time() - began)

    def summary(self) -> dict[str, object]:
        return {
            "opened": self.opened,
            "statuses": dict(self.statuses),
            "overloaded": self.overloaded,
            "exhausted_median_seconds": (
                statistics.median(self.exhausted_seconds) if self.exhausted_seconds else None
            ),
            "longest_seconds": self.longest,
        }


async def main(args: argparse.Namespace) -> None:
    flood = Flood(args)
    workers = [
        asyncio.create_task(flood.worker(flood.channels[i % args.channels]))
        for i in range(args.width)
    ]
    stdin = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin
    )
    stop = asyncio.ensure_future(stdin.readline())
    await flood.started.wait()
    print("flooding", flush=True)
    flooding = asyncio.gather(*workers)
    either: list[asyncio.Future[Any]] = [stop, flooding]
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    flooding.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await flooding
    print(json.dumps(flood.summary()), flush=True)
    for channel in flood.channels:
        await channel.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("--width", type=int, default=600)
    parser.add_argument("--channels", type=int, default=6)
    parser.add_argument("--method", default=AGGREGATE)
    parser.add_argument("--unary", action="store_true", help="call the method as a unary one")
    parser.add_argument("--rate", type=float, default=1e9, help="calls a second, at most")
    parser.add_argument("--max-calls", type=int, default=100_000)
    asyncio.run(main(parser.parse_args()))
