#!/usr/bin/env python3
"""What one peer can push through a node's relay in a few seconds, and the relay's CPU for it.

    python benchmarks/relay_abuse.py                    # ~25 s: a stranger, then a member
    python benchmarks/relay_abuse.py --seconds 30 --json out.json

The relay (``node/reachability/relay.py``, default ``RelayLimits``) runs in a process of its own,
so its CPU share is its own. It serves the peer ids it is told have a live record in its run,
as a node's admission does (``RelayAdmission``, over the node's directory). In this process the
abuser is both ends: it takes a client slot with a key of its own, dials its own relayed port
and writes as fast as it can for ``--seconds``, while its client end discards what the relay
hands it. Two abusers:
  - ``stranger``: a throwaway key with no record in the run; refused, it says hello again and
    again for ``--seconds`` (what refusing costs the relay);
  - ``member``: a key with a live record (anyone can announce one in an open run): served, held
    to its byte budget (a burst, then a sustained rate).
Printed per abuser: served or refused (how often, and the relay's answer), the bytes that came
through and their rate, and the relay process's CPU over the window (one core = 100%, from
/proc).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import time
from typing import Any

from swarmgrad.node.identity import Identity
from swarmgrad.node.reachability.relay import RelayError
from swarmgrad.node.reachability.relay_client import RelayClient
from swarmgrad.node.reachability.relay_server import RelayServer

_WRITE_BYTES = 1 << 20


def _serve(pipe: multiprocessing.connection.Connection, members: list[str]) -> None:
    """The relay's process: serve until the benchmark closes its end of ``pipe``."""

    async def admit(peer_id: str) -> str | None:
        return None if peer_id in members else "no live record in this run"

    async def relay() -> None:
        server = RelayServer(host="127.0.0.1", admit=admit)
        pipe.send(await server.start())
        with contextlib.suppress(EOFError):
            await asyncio.get_running_loop().run_in_executor(None, pipe.recv)
        await server.close()

    asyncio.run(relay())


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def _sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while await reader.read(1 << 20):
        pass
    writer.close()


async def abuse(port: int, identity: Identity, seconds: float, pid: int) -> dict[str, Any]:
    """Take a slot as ``identity`` and push bytes through it for ``seconds``; refused, say hello
    again and again for ``seconds`` instead."""
    sink = await asyncio.start_server(_sink, "127.0.0.1", 0)
    target = ("127.0.0.1", sink.sockets[0].getsockname()[1])
    relay = f"127.0.0.1:{port}"
    client = RelayClient(relay, identity, target=target)
    result: dict[str, Any] = {"served": True, "bytes": 0, "hellos": 1}
    cpu_before, started = _cpu_seconds(pid), time.monotonic()
    try:
        endpoint = await client.connect()
    except RelayError as error:
        result.update(served=False, answer=str(error).rsplit(": ", 1)[-1])
        while time.monotonic() - started < seconds:
            with contextlib.suppress(RelayError):
                await RelayClient(relay, identity, target=target).connect()
            result["hellos"] += 1
    else:
        payload = os.urandom(_WRITE_BYTES)
        _, writer = await asyncio.open_connection("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))
        try:
            async with asyncio.timeout(seconds):
                while True:
                    writer.write(payload)
                    await writer.drain()
        except TimeoutError:
            pass
        except ConnectionError as error:  # the relay hung up on it
            result["hung_up"] = str(error)
        writer.close()
    finally:
        result["seconds"] = time.monotonic() - started
        result["cpu_share"] = (_cpu_seconds(pid) - cpu_before) / result["seconds"]
        result["bytes"] = client.traffic["in"]
        await client.close()
        sink.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="each abuser's window")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    stranger, member = Identity.generate(), Identity.generate()
    ours, theirs = multiprocessing.Pipe()
    relay = multiprocessing.get_context("spawn").Process(
        target=_serve, args=(theirs, [member.peer_id]), daemon=True
    )
    relay.start()
    results: dict[str, Any] = {}
    try:
        port = ours.recv()
        assert relay.pid is not None
        for name, who in (("stranger", stranger), ("member", member)):
            results[name] = r = asyncio.run(abuse(port, who, args.seconds, relay.pid))
            what = "served" if r["served"] else f"refused {r['hellos']} times ({r['answer']})"
            print(
                f"{name:9s} {what}: {r['bytes'] / 1e6:.1f} MB in {r['seconds']:.1f} s "
                f"({r['bytes'] / 1e6 / r['seconds']:.1f} MB/s), "
                f"relay CPU {100 * r['cpu_share']:.0f}% of a core"
            )
    finally:
        ours.close()
        relay.join(10)
        if relay.is_alive():
            relay.kill()
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
