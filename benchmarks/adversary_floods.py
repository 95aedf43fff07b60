#!/usr/bin/env python3
"""The adversary suite's outside attackers, each a process of its own (as a remote one would be):
floods of a node's gRPC server, a look-alike spec's announcer, and a stranger pushing bytes
through a node's relay (the flood of the DHT's round keys is ``readiness_flood.py --flood``).

    python benchmarks/adversary_floods.py streams --endpoint HOST:PORT --seconds 60
    python benchmarks/adversary_floods.py early --endpoint HOST:PORT --receiver PEER_ID \\
        --spec run.toml --seconds 60
    python benchmarks/adversary_floods.py announce --bootstrap-file boot.json --spec look.toml \\
        --seconds 300
    python benchmarks/adversary_floods.py relay --relay HOST:PORT --pid NODE_PID --seconds 20

Each prints ``attacking`` when its attack begins, runs for ``--seconds`` (or until its stdin
closes), then prints one JSON line: what it did, what the node answered, and its own CPU
seconds. With ``--wait`` it first waits (imports done) for one JSON line on stdin with the
options it does not know yet (a node's endpoint, which exists only once the swarm runs).
``benchmarks/adversaries.py`` starts them against a swarm under way; they import only what
every tree since 38f1593 has, so the same attacker runs against the code before and after
issue 42's fixes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from swarmgrad.node import config as node_config
from swarmgrad.node.discovery.base import dht_time
from swarmgrad.node.discovery.start import start_reader
from swarmgrad.node.identity import Identity
from swarmgrad.node.runspec import RunSpec
from swarmgrad.protocol.averaging import StreamHeader, header_to_proto
from swarmgrad.protocol.v1 import averaging_pb2

AGGREGATE = "/swarmgrad.v1.Averaging/Aggregate"


def attacking() -> None:
    """Tell whoever started this process that the attack itself begins now (set-up done)."""
    print("attacking", flush=True)


async def until(seconds: float, stop: asyncio.Event) -> None:
    """Wait ``seconds``, or until ``stop`` (stdin closed) is set."""
    attacking()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()


async def flood_streams(args: argparse.Namespace, stop: asyncio.Event) -> dict[str, Any]:
    """Keep ``width`` silent Aggregate streams open over ``channels`` connections, opening a
    new one as each ends: a keyless client (issue 42, finding 6)."""
    options = [("grpc.use_local_subchannel_pool", 1)]  # each channel its own connection
    channels = [
        grpc.aio.insecure_channel(args.endpoint, options=options) for _ in range(args.channels)
    ]
    statuses: Counter[str] = Counter()

    async def worker(channel: grpc.aio.Channel) -> None:
        while True:
            # Opened without a request iterator, a call sends what it is given: nothing.
            call = channel.stream_stream(AGGREGATE)(timeout=args.call_seconds)
            try:
                async for _ in call:
                    pass
                statuses["OK"] += 1
            except grpc.aio.AioRpcError as error:
                statuses[error.code().name] += 1

    workers = [asyncio.create_task(worker(channels[i % len(channels)])) for i in range(args.width)]
    await until(args.seconds, stop)
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    for channel in channels:
        await channel.close()
    return {"width": args.width, "channels": args.channels, "ended": dict(statuses)}


async def flood_early(args: argparse.Namespace, stop: asyncio.Event) -> dict[str, Any]:
    """Keep ``width`` streams waiting for rounds that never start, each from a fresh key with
    a well-signed header (issue 42, finding 7): the early-stream slots."""
    spec = RunSpec.load(args.spec)
    channel = grpc.aio.insecure_channel(args.endpoint)
    statuses: Counter[str] = Counter()
    keys = 0

    async def worker() -> None:
        nonlocal keys
        while True:
            key = Identity.generate()
            keys += 1
            header = StreamHeader(
                run_id=spec.run.id,
                spec_hash=spec.hash,
                round=10**6 + secrets.randbelow(10**6),  # a round that never comes
                group_id=secrets.token_bytes(32),
                sender=key.peer_id,
                receiver=args.receiver,
                part=0,
                weight=1.0,
            )
            call = channel.stream_stream(
                AGGREGATE,
                request_serializer=averaging_pb2.AggregateRequest.SerializeToString,
                response_deserializer=averaging_pb2.AggregateResponse.FromString,
            )(timeout=args.call_seconds)
            try:
                await call.write(header_to_proto(header, key))  # the header, then silence
                async for _ in call:
                    pass
                statuses["OK"] += 1
            except grpc.aio.AioRpcError as error:
                details = (error.details() or "").split(":", 1)[0][:40]
                statuses[f"{error.code().name} {details}".strip()] += 1
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # Every slot is held: try again soon, without burning the CPU both sides
                    # share here (a remote attacker would not care; this one is on loopback).
                    await asyncio.sleep(0.1)

    workers = [asyncio.create_task(worker()) for _ in range(args.width)]
    await until(args.seconds, stop)
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    await channel.close()
    return {"width": args.width, "keys": keys, "ended": dict(statuses)}


async def announce_look_alike(args: argparse.Namespace, stop: asyncio.Event) -> dict[str, Any]:
    """A stranger's node announcing ``spec`` under its run id, renewed every minute (issue 42,
    finding 5: one node renewing one value)."""
    spec = RunSpec.load(args.spec)
    maddrs = node_config.bootstrap_addresses((), (), bootstrap_file=args.bootstrap_file)
    dht = await start_reader(
        maddrs, backend="hivemind", network_secret="", timeout_seconds=30,
        run_id=spec.run.id, spec_hash=spec.hash,
    )  # fmt: skip
    renewals = 0

    async def renew() -> None:
        nonlocal renewals
        while True:
            await dht.announce_spec(spec.canonical(), expires_at=dht_time() + 150)
            renewals += 1
            if renewals == 1:
                print("announced", flush=True)
            await asyncio.sleep(60)

    task = asyncio.create_task(renew())
    await until(args.seconds, stop)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await dht.close()
    return {"spec_hash": spec.hash.hex(), "renewals": renewals}


async def abuse_relay(args: argparse.Namespace, stop: asyncio.Event) -> dict[str, Any]:
    """A stranger (a throwaway key, no record in the run) pushing bytes through a node's relay
    as fast as it can: ``benchmarks/relay_abuse.py``'s abuser, aimed at a real node."""
    from relay_abuse import abuse  # a sibling script

    host, port = args.relay.rsplit(":", 1)
    if host != "127.0.0.1":
        raise SystemExit("relay_abuse.py's abuser dials 127.0.0.1 only")
    attacking()
    result: dict[str, Any] = await abuse(int(port), Identity.generate(), args.seconds, args.pid)
    return result


ATTACKS: dict[str, Callable[[argparse.Namespace, asyncio.Event], Awaitable[dict[str, Any]]]] = {
    "streams": flood_streams,
    "early": flood_early,
    "announce": announce_look_alike,
    "relay": abuse_relay,
}


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    if args.wait:  # ready (imports done); the target's details come with the word to go
        line = await reader.readline()
        if not line:
            return {"attack": args.attack, "error": "stopped before the word to go"}
        for name, value in json.loads(line).items():
            setattr(args, name, value)

    async def watch_stdin() -> None:
        await reader.read()  # EOF: whoever started it is done with it
        stop.set()

    watcher = asyncio.create_task(watch_stdin())
    began, cpu = time.monotonic(), time.process_time()
    try:
        result = await ATTACKS[args.attack](args, stop)
    finally:
        watcher.cancel()
    return result | {
        "attack": args.attack,
        "seconds": time.monotonic() - began,
        "own_cpu_seconds": time.process_time() - cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("attack", choices=sorted(ATTACKS))
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--endpoint", help="streams, early: the node's gRPC endpoint")
    parser.add_argument("--receiver", help="early: the node's peer id")
    parser.add_argument("--spec", type=Path, help="early, announce: the run spec")
    parser.add_argument("--bootstrap-file", type=Path, help="announce: the DHT")
    parser.add_argument("--width", type=int, default=600, help="streams, early: calls at once")
    parser.add_argument("--channels", type=int, default=4, help="streams: connections")
    parser.add_argument("--call-seconds", type=float, default=60.0, help="a call's deadline")
    parser.add_argument("--relay", help="relay: the node's relay endpoint")
    parser.add_argument("--pid", type=int, help="relay: the node's process (for its CPU)")
    parser.add_argument(
        "--wait", action="store_true",
        help="wait for one JSON line on stdin (options, e.g. the endpoint), then attack",
    )  # fmt: skip
    args = parser.parse_args()
    print(json.dumps(asyncio.run(_run(args))), flush=True)
    # Done and reported: gRPC's teardown of calls cancelled mid-stream can hang at exit.
    os._exit(0)


if __name__ == "__main__":
    main()
