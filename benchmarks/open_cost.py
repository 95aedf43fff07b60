"""Open mode's round cost, for ``byzantine.py`` (run alone: ``byzantine.py --round-cost-only``).

Two ways: the swarm (``swarm_cost``: N real node processes on 127.0.0.1, trusted and open runs of
the demo spec alternating, ABBA), and one all-reduce of N members in one process over gRPC
(``round_cost``: the CPU each spends, the bytes it uploads).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from swarmgrad.node.averaging.allreduce import AllReduceConfig
from swarmgrad.node.averaging.averager import standalone
from swarmgrad.node.averaging.group import Group, Member
from swarmgrad.node.identity import Identity
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.training.model import build_model, flatten
from swarmgrad.node.trust.aggregate import Aggregator, aggregate
from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate


async def round_cost(n: int, repeats: int) -> None:
    """Median seconds of a real all-reduce round over gRPC for the demo model, trusted vs open,
    and the bytes each member uploads."""
    spec = RunSpec.from_toml(DEMO_SPEC)
    size = flatten(list(build_model(spec.model, seed=0).parameters())).numel()
    base = {"run_id": "cost", "spec_hash": bytes(32), "codec": spec.averaging.codec}
    configs = {
        "trusted": AllReduceConfig(**base),  # type: ignore[arg-type]
        "open": AllReduceConfig(
            **base,  # type: ignore[arg-type]
            aggregator="centered_clip",
            uniform_weights=True,
            result_codec="fp16",
            observe=True,
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    cpu: dict[str, list[float]] = {name: [] for name in configs}  # process CPU per member
    sent: dict[str, list[float]] = {name: [] for name in configs}  # upload bytes per member
    round_ = 0
    for name, config in configs.items():
        async with contextlib.AsyncExitStack() as stack:
            peers = [
                await stack.enter_async_context(
                    standalone(Identity.from_seed(f"cost/{name}/{i}"), config)
                )
                for i in range(n)
            ]
            members = tuple(Member(peer_id=p.peer_id, endpoint=p.endpoint) for p in peers)
            for _ in range(repeats + 1):
                group = Group(round=round_, members=members)
                # Fresh updates each round, alike as honest ones are (else they look replayed).
                g = torch.Generator().manual_seed(round_)
                common = torch.randn(size, generator=g)
                vectors = [common + torch.randn(size, generator=g) for _ in range(n)]
                round_ += 1
                began, cpu_began = time.perf_counter(), time.process_time()
                bytes_began = sum(p.traffic["sent"] for p in peers)
                await asyncio.gather(  # keep_sent: a node's int8 rounds keep it (error feedback)
                    *(
                        p.all_reduce(v, group, keep_sent=True)
                        for p, v in zip(peers, vectors, strict=True)
                    )
                )
                times[name].append(time.perf_counter() - began)
                cpu[name].append((time.process_time() - cpu_began) / n)
                sent[name].append((sum(p.traffic["sent"] for p in peers) - bytes_began) / n)
    print(f"\nround time, {n} members in one process over gRPC, {size:,} values (demo model), "
          f"{repeats} rounds after a warm-up:")  # fmt: skip
    medians = {}
    for name, seconds in times.items():
        kept = seconds[1:]
        medians[name] = statistics.median(kept)
        print(f"  {name:<8} median {medians[name]:.3f} s [{min(kept):.3f}, {max(kept):.3f}], "
              f"CPU per member {statistics.median(cpu[name][1:]) * 1e3:.0f} ms, "
              f"upload per member {statistics.median(sent[name][1:]) / 1e6:.2f} MB")  # fmt: skip
    upload = statistics.median(sent["open"][1:]) / statistics.median(sent["trusted"][1:])
    print(f"  open / trusted: {medians['open'] / medians['trusted']:.2f}x (one process); "
          f"upload {upload:.2f}x (results return in fp16: a round bound by upload bandwidth "
          f"costs about that)")  # fmt: skip
    extra = statistics.median(cpu["open"][1:]) - statistics.median(cpu["trusted"][1:])
    print(
        f"  open mode's CPU per member and round: +{extra * 1e3:.0f} ms; a node in a swarm "
        f"pays that on its own cores: {(medians['trusted'] + extra) / medians['trusted']:.2f}x "
        f"a trusted round of this length"
    )
    # In one process all N owners aggregate on the same cores; in a swarm each node does only
    # its own part. What one owner adds, on one thread, for its part of the demo model:
    torch.set_num_threads(1)
    part = torch.stack(vectors)[:, : size // n].contiguous()
    cost = {}
    for name, combine in (
        ("mean", lambda: part.mean(0)),
        ("centered_clip", lambda: aggregate(part, Aggregator.CENTERED_CLIP)),
    ):
        combine()
        began = time.perf_counter()
        for _ in range(20):
            combine()
        cost[name] = (time.perf_counter() - began) / 20
    print(
        f"  one owner's part ({size // n:,} values x {n}), 1 thread: mean "
        f"{cost['mean'] * 1e3:.2f} ms, centered_clip {cost['centered_clip'] * 1e3:.2f} ms "
        f"(+{(cost['centered_clip'] - cost['mean']) * 1e3:.1f} ms a round per node, "
        f"{(cost['centered_clip'] - cost['mean']) / medians['trusted']:.1%} of a trusted round)"
    )


#: Landed rounds each node skips before timing (discovery, the first groups, warm-up).
SWARM_WARMUP_ROUNDS = 2


def swarm_run(
    work: Path, *, mode: str, nodes: int, rounds: int, seed: int, upload: float
) -> dict[str, Any]:
    """One real-process run of the demo spec (one group of ``nodes``) in ``mode``, every node's
    upload capped at ``upload`` bytes/s (0: no cap): medians over nodes and timed rounds of the
    time between rounds, the averaging round and the all-reduce, and the bytes a node sends a
    round."""
    spec = work / f"{mode}.toml"
    text = DEMO_SPEC.replace("group_size = 256", f"group_size = {nodes}")
    spec.write_text(text + ('\n[trust]\nmode = "open"\n' if mode == "open" else ""))
    profile = None
    if upload:
        profile = work / "peers.toml"
        profile.write_text(f"[[peer]]\nupload_bytes_per_second = {upload}\n")
    out = work / f"sim-{mode}"
    summary = simulate(
        SimulationConfig(
            nodes=nodes, rounds=rounds, spec_path=spec, profile_path=profile, out_dir=out,
            seed=seed, timeout_seconds=1800,
        )
    )  # fmt: skip
    periods: list[float] = []
    averaging: list[float] = []
    allreduce: list[float] = []
    sent: list[float] = []
    for path in sorted(out.glob("node-*.json")):
        landed = [
            e for e in json.loads(path.read_text())["history"]
            if e["outcome"] in ("averaged", "partial")
        ][SWARM_WARMUP_ROUNDS:]  # fmt: skip
        periods += [b["time"] - a["time"] for a, b in itertools.pairwise(landed)]
        averaging += [e["round_seconds"] for e in landed]
        allreduce += [e["allreduce_seconds"] for e in landed]
        sent += [b["bytes_sent"] - a["bytes_sent"] for a, b in itertools.pairwise(landed)]
    return {
        "ok": summary["ok"],
        "round_period": statistics.median(periods),
        "averaging": statistics.median(averaging),
        "allreduce": statistics.median(allreduce),
        "sent_per_round": statistics.median(sent),
    }


def swarm_cost(nodes: int, rounds: int, repeats: int, upload: float) -> None:
    """Trusted vs open runs of the demo spec as real node processes, alternating."""
    runs: dict[str, list[dict[str, Any]]] = {"trusted": [], "open": []}
    capped = f"uploads capped at {upload / 1e6:g} MB/s" if upload else "no upload cap"
    print(f"\nthe swarm: {nodes} node processes on 127.0.0.1 ({capped}), the demo spec in one "
          f"group of {nodes}, {rounds} rounds (the first {SWARM_WARMUP_ROUNDS} untimed), "
          f"{repeats} repeats alternating (trusted first, then open first):")  # fmt: skip
    for repeat in range(repeats):
        for mode in list(runs)[:: 1 if repeat % 2 == 0 else -1]:  # ABBA: no side always first
            with tempfile.TemporaryDirectory() as folder:
                run = swarm_run(
                    Path(folder), mode=mode, nodes=nodes, rounds=rounds, seed=repeat, upload=upload
                )
            runs[mode].append(run)
            print(f"  #{repeat} {mode:<8} between rounds {run['round_period']:.2f} s, averaging "
                  f"round {run['averaging']:.2f} s (all-reduce {run['allreduce']:.2f} s), "
                  f"{run['sent_per_round'] / 1e6:.2f} MB sent a round, ok {run['ok']}",
                  flush=True)  # fmt: skip
    for key, what in (
        ("round_period", "time between rounds (the run's pace)"),
        ("averaging", "averaging round"),
        ("allreduce", "all-reduce"),
        ("sent_per_round", "bytes sent a round"),
    ):
        ratios = [o[key] / t[key] for t, o in zip(runs["trusted"], runs["open"], strict=True)]
        print(f"  open / trusted, {what}: {statistics.median(ratios):.2f}x "
              f"[{min(ratios):.2f}, {max(ratios):.2f}]")  # fmt: skip
