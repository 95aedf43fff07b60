"""A peer's download per round against group size, with the ``sparse`` codec: real rounds and the
discrete-event model's count, against an all-gather of everyone's payloads.

Each part's owner merges its members' sparse values and returns one sparse part, so a member
downloads the owners' results (one payload of its vector, in pieces) and, as an owner, the other
members' values of its own part (about one more): near two payloads whatever the group's size.
SparseLoCo's all-gather downloads every other peer's payload: N - 1.

* real: N averagers of one run (``Averager`` with its gRPC services, on the in-memory transport:
  every message serialized and parsed as on the wire) average one vector of random values; the
  bytes are what each counted as received (payloads, as the node's metrics count them);
* model: ``simulations/des/traffic.py`` (the node's own partition, chunking and codec) for the
  same vector, and for a 1B-parameter vector.

    .venv/bin/python benchmarks/sparse_download.py              # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time

import torch

from swarmgrad.compression import get_codec
from swarmgrad.node.averaging.allreduce import AllReduceConfig
from swarmgrad.node.averaging.averager import standalone
from swarmgrad.node.averaging.group import Group, Member
from swarmgrad.node.identity import Identity
from swarmgrad.node.transport.memory import MemoryNetwork
from swarmgrad.simulations.des.traffic import part_bytes, round_traffic

ONE_B = 974_086_144  # the 1B what-if model's parameters (benchmarks/des.py)


def _config(options: dict[str, float]) -> AllReduceConfig:
    return AllReduceConfig(
        run_id="download",
        spec_hash=bytes(32),
        codec="sparse",
        codec_options=options,
        round_timeout_seconds=120.0,
        sender_timeout_seconds=30.0,
        reducer_timeout_seconds=60.0,
    )


def _group(n: int) -> Group:
    return Group(round=0, members=tuple(Member(peer_id=f"p{i}", endpoint="") for i in range(n)))


async def real(n: int, numel: int, options: dict[str, float]) -> list[int]:
    """What each of ``n`` members received in one round of ``numel`` values."""
    config, network = _config(options), MemoryNetwork()
    async with contextlib.AsyncExitStack() as stack:
        peers = [
            await stack.enter_async_context(
                standalone(Identity.from_seed(f"download/{i}"), config, network=network)
            )
            for i in range(n)
        ]
        group = Group(
            round=0, members=tuple(Member(peer_id=p.peer_id, endpoint=p.endpoint) for p in peers)
        )
        g = torch.Generator().manual_seed(n)
        vectors = [torch.randn(numel, generator=g) for _ in peers]
        results = await asyncio.gather(
            *(p.all_reduce(v, group) for p, v in zip(peers, vectors, strict=True))
        )
        assert all(r.complete for r in results)
        assert all(torch.equal(results[0].averaged, r.averaged) for r in results[1:])
        return [p.traffic["received"] for p in peers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=1 << 22, help="the vector's length")
    parser.add_argument("--real", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--model", type=int, nargs="+", default=[4, 8, 16, 64, 256])
    parser.add_argument("--bits", type=int, default=2)
    args = parser.parse_args()
    options = {"bits": float(args.bits)}
    payload = len(get_codec("sparse", **options).encode(torch.randn(args.values))[0])
    config = _config(options)
    print(f"sparse {args.bits}-bit, {args.values:,} values: one payload {payload:,} bytes")
    print(f"{'source':<8}{'N':>5}{'download, max':>16}{'x payload':>11}{'all-gather x':>14}")
    began = time.monotonic()
    for n in args.real:
        received = asyncio.run(real(n, args.values, options))
        top = max(received)
        print(f"{'real':<8}{n:>5}{top:>16,}{top / payload:>11.2f}{n - 1:>14}", flush=True)
    for n in args.model:
        traffic = round_traffic(_group(n), args.values, config)
        top = max(t.received for t in traffic.values())
        print(f"{'model':<8}{n:>5}{top:>16,}{top / payload:>11.2f}{n - 1:>14}")
    whole = part_bytes(config, ONE_B)
    for n in args.model:
        traffic = round_traffic(_group(n), ONE_B, config)
        downloads = [t.received for t in traffic.values()]
        print(
            f"{'1B':<8}{n:>5}{max(downloads):>16,}{max(downloads) / whole:>11.2f}{n - 1:>14}"
            f"   (median {statistics.median(downloads) / 2**20:,.1f} MiB; one payload "
            f"{whole / 2**20:,.1f} MiB)"
        )
    print(f"({time.monotonic() - began:.0f} s)")


if __name__ == "__main__":
    main()
