"""What error feedback costs a round: inside the sender (one encode per chunk) vs the old detour.

    .venv/bin/python benchmarks/feedback.py                 # 25M fp32, 2 members, int8, 7 rounds
    .venv/bin/python benchmarks/feedback.py --values-m 5 --codec int4 --rounds 5

Two averagers in this process (real gRPC on 127.0.0.1) average one vector each, three ways,
alternating round by round so that drift hits all three alike:

- ``plain``: the all-reduce alone, no feedback (what a lossless codec needs);
- ``in sender``: ``all_reduce(keep_sent=True)``, this tree's error feedback: each chunk is
  encoded once, and the decoded copy the residual is computed from is made in the same worker
  call, overlapped with the wire;
- ``detour``: what the trainer did before the house split (0cb8011 ``_with_feedback``): every
  chunk another member owns is encoded and decoded in a worker thread before the round starts,
  chunk by chunk as the all-reduce cuts it, then the all-reduce encodes it again.

Printed: median [min-max] seconds per round for each, and the ratios to ``plain``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from swarmgrad.compression import decode
from swarmgrad.node.averaging.allreduce import AllReduceConfig
from swarmgrad.node.averaging.averager import Averager, standalone
from swarmgrad.node.averaging.group import Group, Member, chunk_sizes
from swarmgrad.node.identity import Identity


def detour(vector: torch.Tensor, group: Group, me: str, config: AllReduceConfig) -> torch.Tensor:
    """The pre-split trainer's feedback: each other member's chunk through the codec, first."""
    codec = config.make_codec()
    sent = vector.clone()
    mine = group.index(me)
    for part, (start, end) in enumerate(group.partition(vector.numel())):
        if part == mine:
            continue
        offset = start
        for size in chunk_sizes(end - start, config.chunk_values):
            piece = vector[offset : offset + size]
            sent[offset : offset + size] = decode(*codec.encode(piece))
            offset += size
    return sent


async def one_round(
    averagers: list[Averager], vectors: list[torch.Tensor], group: Group, mode: str
) -> float:
    config = averagers[0].config

    async def member(averager: Averager, vector: torch.Tensor) -> None:
        if mode == "detour":
            sent = await asyncio.to_thread(detour, vector, group, averager.peer_id, config)
            await averager.all_reduce(sent, group)
        else:
            await averager.all_reduce(vector, group, keep_sent=mode == "in sender")

    started = time.perf_counter()
    await asyncio.gather(*(member(a, v) for a, v in zip(averagers, vectors, strict=True)))
    return time.perf_counter() - started


async def main(args: argparse.Namespace) -> None:
    config = AllReduceConfig(run_id="bench", spec_hash=bytes(32), codec=args.codec)
    keys = [Identity.from_seed(f"feedback-bench/{i}") for i in range(args.members)]
    size = int(args.values_m * 1e6)
    generator = torch.Generator().manual_seed(0)
    vectors = [torch.randn(size, generator=generator) for _ in keys]
    modes = ("plain", "in sender", "detour")
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    averager_contexts = [standalone(key, config) for key in keys]
    averagers = [await context.__aenter__() for context in averager_contexts]
    try:
        members = tuple(Member(peer_id=a.peer_id, endpoint=a.endpoint) for a in averagers)
        round_ = 0

        async def run(mode: str) -> float:
            nonlocal round_
            round_ += 1
            return await one_round(averagers, vectors, Group(round=round_, members=members), mode)

        for mode in modes:  # warm-up
            await run(mode)
        for _ in range(args.rounds):
            for mode in modes:
                times[mode].append(await run(mode))
    finally:
        for context in reversed(averager_contexts):
            await context.__aexit__(None, None, None)
    print(
        f"error feedback, {args.members} members in one process, {args.values_m:g}M fp32 each, "
        f"{args.codec}, {args.rounds} rounds, median [min-max] seconds per round"
    )
    plain = statistics.median(times["plain"])
    for mode in modes:
        values = times[mode]
        median = statistics.median(values)
        print(
            f"  {mode:<10} {median:6.3f} [{min(values):.3f}-{max(values):.3f}]"
            f"  {median / plain:5.2f}x plain"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--values-m", type=float, default=25.0, help="million fp32 per member")
    parser.add_argument("--members", type=int, default=2)
    parser.add_argument("--codec", default="int8")
    parser.add_argument("--rounds", type=int, default=7)
    asyncio.run(main(parser.parse_args()))
