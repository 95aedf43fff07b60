"""State sync between real processes: a donor that serves a known state (honestly or not), and a
joiner that finds donors through the DHT and downloads it. For tests and benchmarks::

    python -m swarmgrad.simulations.state_peer --run-spec run.toml --values 1000000 \\
        [--bootstrap MADDR ...] [--corrupt-chunk 3] [--upload-bytes-per-second 2e7]
    python -m swarmgrad.simulations.state_peer --join 3 --run-spec run.toml --values 1000000 \\
        --bootstrap MADDR [--first ENDPOINT]

A donor prints one JSON line once it serves (``{"event": "ready", "maddrs", "endpoint",
"checksum"}``), then serves until its standard input closes. The state is
``torch.randn(values)`` from ``--seed``, at ``--epoch``. ``--corrupt-chunk K`` serves chunk K
with one value changed while announcing the true state's checksum and manifest: a lying donor
that only the chunk digests catch. A joiner waits for ``--join`` donors, downloads (asking
``--first`` first, if given) and prints whether it got exactly the known state, and the failures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import torch

from swarmgrad.node import Swarm, SwarmConfig
from swarmgrad.node.identity import Identity
from swarmgrad.node.runspec import RunSpec
from swarmgrad.protocol import state


def known_state(values: int, *, seed: int, epoch: int) -> state.Snapshot:
    return state.Snapshot.of(
        epoch, torch.randn(values, generator=torch.Generator().manual_seed(seed))
    )


async def serve(args: argparse.Namespace) -> None:
    spec = RunSpec.load(args.run_spec)
    config = SwarmConfig(
        bootstrap=tuple(args.bootstrap),
        upload_bytes_per_second=args.upload_bytes_per_second,
    )
    snapshot = known_state(args.values, seed=args.seed, epoch=args.epoch)
    async with Swarm(spec, Identity.generate(), config) as swarm:
        swarm.publish(snapshot, throughput=1.0)
        if args.corrupt_chunk is not None:  # serve other values under the true manifest
            values = snapshot.values.clone()
            values[args.corrupt_chunk * snapshot.chunk_values] += 1.0
            lie = dataclasses.replace(snapshot, values=values)
            swarm.state.servicer.lookup = {snapshot.checksum: lie}.get
        async with asyncio.timeout(30):  # until its record, with the checksum, can be read back
            while True:
                peers = await swarm.refresh_peers()
                if any(p.checksum == snapshot.checksum for p in peers):
                    break
                await asyncio.sleep(0.2)
        ready = {
            "event": "ready",
            "maddrs": swarm.visible_maddrs(),
            "endpoint": swarm.endpoint,
            "checksum": snapshot.checksum,
        }
        print(json.dumps(ready), flush=True)
        await asyncio.to_thread(sys.stdin.read)


async def join(args: argparse.Namespace) -> dict[str, object]:
    spec = RunSpec.load(args.run_spec)
    config = SwarmConfig(bootstrap=tuple(args.bootstrap))
    async with Swarm(spec, Identity.generate(), config) as swarm:
        async with asyncio.timeout(30):  # until the donors' records can be read
            while True:
                donors = await swarm.find_donors(0, "")
                if len(donors) >= args.join:
                    break
                await asyncio.sleep(0.2)
        donors.sort(key=lambda p: p.endpoint != args.first)
        snapshot = await swarm.download_state(donors, args.values)
        expected = known_state(args.values, seed=args.seed, epoch=args.epoch)
        return {
            "event": "done",
            "exact": snapshot is not None and bool(torch.equal(snapshot.values, expected.values)),
            "epoch": snapshot.epoch if snapshot is not None else None,
            "failures": dict(swarm.failures),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-spec", type=Path, required=True)
    parser.add_argument("--values", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epoch", type=int, default=5)
    parser.add_argument("--bootstrap", nargs="*", default=[])
    parser.add_argument("--corrupt-chunk", type=int)
    parser.add_argument("--upload-bytes-per-second", type=float)
    parser.add_argument("--join", type=int, help="be a joiner: wait for this many donors")
    parser.add_argument("--first", default="", help="joiner: ask this endpoint first")
    args = parser.parse_args()
    if args.join:
        print(json.dumps(asyncio.run(join(args))), flush=True)
    else:
        asyncio.run(serve(args))


if __name__ == "__main__":
    main()
