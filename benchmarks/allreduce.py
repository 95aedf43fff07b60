#!/usr/bin/env python3
"""Group all-reduce on loopback: swarmgrad vs hivemind's DecentralizedAverager, in one run.

    python benchmarks/allreduce.py                          # 25M fp32 (100 MB) per peer, N=2,4,8
    python benchmarks/allreduce.py --sizes-m 5 --peers 2,4 --rounds 3 --json out.json

Every peer is its own process. For each N and codec (none / fp16 / 8-bit): one warm-up round,
then ``--rounds`` timed rounds; a round's time is the slowest member's all-reduce time, and the
table shows the median and [min-max]. Both sides are timed the same way: every peer gets ready
first (swarmgrad: draws its vector; hivemind: matchmakes, ``step(require_trigger=True)``), then
the parent starts them all and each times its own all-reduce. Like hivemind, which averages its
tensors in place, swarmgrad's peers reuse one result buffer across rounds. Bytes are the codec
payload bytes a member sent (its chunks to the owners plus, as an owner, the averages it
streamed back).

Then kill-recovery: a 4-peer group where one member SIGKILLs itself mid-stream; the time from
its death to the survivors' next completed full round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CODECS = {"none": "NoCompression", "fp16": "Float16Compression", "int8": "Uniform8BitQuantization"}


# -- hivemind side (own process per peer; never imports swarmgrad) ------------------------------


def hivemind_peer(args: argparse.Namespace) -> None:
    import hivemind
    import torch
    from hivemind.averaging.control import AveragingStage

    torch.set_num_threads(1)
    initial = json.loads(args.initial_peers)
    dht = hivemind.DHT(start=True, initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    tensor = torch.randn(args.size, generator=torch.Generator().manual_seed(args.seed))
    averager = hivemind.averaging.DecentralizedAverager(
        [tensor],
        dht,
        prefix="bench",
        target_group_size=args.n,
        min_group_size=args.n,
        min_matchmaking_time=2.0,
        request_timeout=1.0,
        compression=getattr(hivemind.compression, CODECS[args.codec])(),
        sender_timeout=10.0,
        reducer_timeout=30.0,
        start=True,
    )
    maddrs = [str(a) for a in dht.get_visible_maddrs()]
    print(json.dumps({"event": "ready", "maddrs": maddrs}), flush=True)
    control = None
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "arm":
            control = averager.step(wait=False, require_trigger=True, timeout=120)
            deadline = time.monotonic() + 120
            while control.stage != AveragingStage.AWAITING_TRIGGER:
                if control.done() or time.monotonic() > deadline:
                    print(json.dumps({"event": "failed", "error": repr(control.exception())}))
                    break
                time.sleep(0.01)
            else:
                print(json.dumps({"event": "armed"}), flush=True)
        elif command["cmd"] == "go" and control is not None:
            start = time.perf_counter()
            control.allow_allreduce()
            control.result(timeout=300)
            print(json.dumps({"event": "done", "seconds": time.perf_counter() - start}), flush=True)
        elif command["cmd"] == "exit":
            break
    averager.shutdown()
    dht.shutdown()


class LineProcess:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, *cmd: str) -> LineProcess:
        # hivemind's 8-bit codec warns on every call that torch deprecates quantize_per_tensor.
        env = {**os.environ, "PYTHONWARNINGS": "ignore::UserWarning"}
        process = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env
        )
        return cls(process)

    async def send(self, command: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        await self.process.stdin.drain()

    async def event(self, timeout_seconds: float = 300) -> dict[str, Any]:
        assert self.process.stdout is not None
        async with asyncio.timeout(timeout_seconds):
            while True:
                line = await self.process.stdout.readline()
                if not line:
                    raise EOFError(f"process exited with {await self.process.wait()}")
                if line.startswith(b"{"):
                    return dict(json.loads(line))

    async def close(self) -> None:
        if self.process.returncode is None:
            try:
                await self.send({"cmd": "exit"})
                async with asyncio.timeout(20):
                    await self.process.wait()
            except (TimeoutError, ConnectionError):
                self.process.kill()
                await self.process.wait()


async def bench_hivemind(n: int, codec: str, size: int, rounds: int) -> list[float]:
    peers: list[LineProcess] = []
    me = [sys.executable, __file__, "--hivemind-peer", "--n", str(n), "--codec", codec]
    me += ["--size", str(size)]
    try:
        first = await LineProcess.start(*me, "--seed", "0", "--initial-peers", "[]")
        peers.append(first)
        maddrs = (await first.event(120))["maddrs"]
        for i in range(1, n):
            peers.append(
                await LineProcess.start(
                    *me, "--seed", str(i), "--initial-peers", json.dumps(maddrs)
                )
            )
        for peer in peers[1:]:
            await peer.event(120)
        times = []
        for _ in range(rounds + 1):
            for peer in peers:
                await peer.send({"cmd": "arm"})
            armed = [await peer.event(180) for peer in peers]
            if any(e["event"] != "armed" for e in armed):
                raise RuntimeError(f"hivemind matchmaking failed: {armed}")
            for peer in peers:
                await peer.send({"cmd": "go"})
            done = [await peer.event(300) for peer in peers]
            times.append(max(e["seconds"] for e in done))
        return times[1:]
    finally:
        await asyncio.gather(*(p.close() for p in peers))


# -- swarmgrad side -------------------------------------------------------------------------------


async def bench_swarmgrad(
    n: int, codec: str, size: int, rounds: int, out_dir: Path
) -> tuple[list[float], list[int]]:
    from swarmgrad.simulations.allreduce_peer import PeerProcess

    args = ("--codecs", codec, "--threads", "1", "--round-timeout", "120")
    args += ("--reducer-timeout", "60", "--sender-timeout", "30")
    peers = list(
        await asyncio.gather(*(PeerProcess.start(f"b{i}", out_dir, *args) for i in range(n)))
    )
    try:
        members = [p.member(codec) for p in peers]
        times, sent = [], []
        for r in range(rounds + 1):
            # Like hivemind's arm/go: draw the vectors first, then start every member at once.
            for i, peer in enumerate(peers):
                await peer.send({"cmd": "prepare", "seed": 100 * r + i, "size": size})
            for peer in peers:
                await peer.event(300)
            for i, peer in enumerate(peers):
                await peer.send(
                    {
                        "cmd": "round",
                        "codec": codec,
                        "round": r,
                        "members": members,
                        "seed": 100 * r + i,
                        "size": size,
                        "save": False,
                    }
                )
            events = [await peer.event(300) for peer in peers]
            if any(e["event"] != "done" or e["missing"] for e in events):
                raise RuntimeError(f"swarmgrad round failed: {events}")
            times.append(max(e["seconds"] for e in events))
            sent.append(int(statistics.mean(e["bytes_sent"] for e in events)))
        return times[1:], sent[1:]
    finally:
        await asyncio.gather(*(p.stop() for p in peers))


async def bench_kill_recovery(size: int, trials: int, out_dir: Path) -> list[float]:
    """Seconds from a member's SIGKILL (mid-stream) to the survivors' next complete round."""
    from swarmgrad.simulations.allreduce_peer import PeerProcess

    args = ("--codecs", "int8", "--threads", "1", "--round-timeout", "60")
    args += ("--sender-timeout", "5", "--reducer-timeout", "30")
    recoveries = []
    for trial in range(trials):
        peers = list(
            await asyncio.gather(
                *(PeerProcess.start(f"k{trial}-{i}", out_dir, *args) for i in range(4))
            )
        )
        try:
            members = [p.member("int8") for p in peers]
            for i, peer in enumerate(peers):
                fault = {"kind": "kill", "after_chunks": 4} if i == 0 else None
                await peer.send(
                    {
                        "cmd": "round",
                        "codec": "int8",
                        "round": 0,
                        "members": members,
                        "seed": i,
                        "size": size,
                        "save": False,
                        "fault": fault,
                    }
                )
            await peers[0].process.wait()
            killed_at = time.monotonic()
            for peer in peers[1:]:
                await peer.event(120)
            survivors = peers[1:]
            members = [p.member("int8") for p in survivors]
            for i, peer in enumerate(survivors):
                await peer.send(
                    {
                        "cmd": "round",
                        "codec": "int8",
                        "round": 1,
                        "members": members,
                        "seed": i,
                        "size": size,
                        "save": False,
                    }
                )
            events = [await peer.event(120) for peer in survivors]
            if any(e["event"] != "done" or e["missing"] or e["partial"] for e in events):
                raise RuntimeError(f"round after the kill was not complete: {events}")
            recoveries.append(time.monotonic() - killed_at)
        finally:
            await asyncio.gather(*(p.stop() for p in peers))
    return recoveries


def fmt(times: list[float]) -> str:
    return f"{statistics.median(times):.2f} [{min(times):.2f}-{max(times):.2f}]"


async def main_async(args: argparse.Namespace) -> None:
    size = int(args.sizes_m * 1_000_000)
    ns = [int(x) for x in args.peers.split(",")]
    rows = []
    print(
        f"all-reduce benchmark: {size / 1e6:g}M fp32 ({size * 4 / 1e6:.0f} MB) per peer, "
        f"{args.rounds} timed rounds after a warm-up, median [min-max] seconds per round\n"
    )
    header = (
        f"{'N':>2} {'codec':<5} {'swarmgrad s':>18} {'hivemind s':>18} {'ratio':>6} "
        f"{'algbw GB/s':>10} {'MB sent/peer':>12}"
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for n in ns:
            for codec in args.codecs.split(","):
                ours, sent = await bench_swarmgrad(n, codec, size, args.rounds, Path(tmp))
                theirs = (
                    [] if args.no_hivemind else await bench_hivemind(n, codec, size, args.rounds)
                )
                ratio = statistics.median(ours) / statistics.median(theirs) if theirs else None
                row = {
                    "n": n,
                    "codec": codec,
                    "swarmgrad_s": ours,
                    "hivemind_s": theirs,
                    "ratio": ratio,
                    "algbw_gbps": size * 4 / statistics.median(ours) / 1e9,
                    "bytes_sent_per_peer": statistics.median(sent),
                }
                rows.append(row)
                print(
                    f"{n:>2} {codec:<5} {fmt(ours):>18} {fmt(theirs) if theirs else '-':>18} "
                    f"{f'{ratio:.2f}x' if ratio else '-':>6} {row['algbw_gbps']:>10.2f} "
                    f"{row['bytes_sent_per_peer'] / 1e6:>12.1f}",
                    flush=True,
                )
        if args.kill_trials:
            recoveries = await bench_kill_recovery(size, args.kill_trials, Path(tmp))
            print(
                f"\nkill-recovery (4 peers, int8, one SIGKILLed mid-stream, {args.kill_trials} "
                f"trials): kill -> survivors' next complete round {fmt(recoveries)} s"
            )
            rows.append({"kill_recovery_s": recoveries})
    if args.json:
        with open(args.json, "w") as f:  # noqa: ASYNC230 - once, at the end
            json.dump(rows, f, indent=2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-m", type=float, default=25.0, help="million fp32 values per peer")
    parser.add_argument("--peers", default="2,4,8", help="group sizes, comma-separated")
    parser.add_argument("--codecs", default="none,fp16,int8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kill-trials", type=int, default=3)
    parser.add_argument("--no-hivemind", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--hivemind-peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--codec", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hivemind_peer:
        hivemind_peer(args)
        return 0
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
