#!/usr/bin/env python3
"""Discovery on loopback: the hivemind backend and the py-libp2p backend, side by side.

    python benchmarks/discovery.py                      # 32 nodes; then 16 with 3 frozen
    python benchmarks/discovery.py --nodes 8 --frozen-nodes 8 --frozen 2 --json out.json

For each backend, in one run:
  start:   a bootstrap node, then the other nodes all at once, joining through it; the time until
           every one is up (hivemind: its DHT process and go-libp2p daemon; libp2p: the sidecar);
  visible: from then, every node announces its signed record, in rounds (as running nodes do,
           every ``announce_interval``; here every 2 s) until every node's lookup returns all
           of them: the seconds until then, and the rounds it took;
  lookups: every node announces its signed record, then each reads the swarm's record set
           (``find``) --lookups times; latency median / p90 / max, and the share of the swarm's
           records each lookup returned;
  memory:  per node, the processes its DHT adds (hivemind: the DHT process and its p2pd daemon;
           libp2p: the sidecar), as PSS (shared pages split among their users) and USS (pages
           only that node's processes hold), median over nodes;
  frozen:  a fresh swarm of --frozen-nodes with --frozen of them stopped (SIGSTOP: they accept
           connections and never answer, like a hung peer); lookups from the live ones. With
           libp2p the frozen ones are the peers that hold the swarm's records (the worst case);
           hivemind's replicas are not visible from here, so its frozen peers are any three.
The node side of both backends runs in this process (asyncio); it imports hivemind but never
libp2p, which lives only in the sidecars.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from swarmgrad.node.discovery.base import BACKENDS, Discovery, dht_time
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.discovery.start import DiscoveryConfig, start_discovery
from swarmgrad.node.identity import Identity

RUN, SPEC = "discovery-bench", b"\x0b" * 32
ANNOUNCE_INTERVAL_SECONDS = 2.0  # between announce rounds while a swarm converges


def dht_pids(node: Any) -> list[int]:
    """The processes that make up ``node``'s DHT, children included."""
    root = node._dht.pid if hasattr(node, "_dht") else node.sidecar.pid
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        todo.extend(int(c) for c in children)
    return pids


def memory_mib(pids: list[int]) -> tuple[float, float]:
    """(PSS, USS) of ``pids`` together, MiB."""
    pss = uss = 0
    for pid in pids:
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        fields = {line.split(":")[0]: int(line.split()[1]) for line in rollup[1:]}
        pss += fields.get("Pss", 0)
        uss += fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return pss / 1024, uss / 1024


async def start_swarm(backend: str, count: int) -> tuple[list[Discovery], list[Identity], float]:
    ids = [Identity.generate() for _ in range(count)]
    started = time.perf_counter()

    async def one(identity: Identity, peers: list[str]) -> Discovery:
        config = DiscoveryConfig(backend=backend, initial_peers=tuple(peers))
        return await start_discovery(config, identity, run_id=RUN, spec_hash=SPEC)

    boot = await one(ids[0], [])
    rest = await asyncio.gather(*(one(i, boot.visible_maddrs()) for i in ids[1:]))
    return [boot, *rest], ids, time.perf_counter() - started


async def announce_all(nodes: list[Discovery], ids: list[Identity]) -> None:
    async def one(node: Discovery, identity: Identity) -> None:
        record = PeerRecord.create(
            identity.peer_id,
            run_id=RUN,
            spec_hash=SPEC,
            endpoint="127.0.0.1:1",
            now=dht_time(),
            ttl_seconds=300,
        )
        await node.announce(record)

    await asyncio.gather(*(one(n, i) for n, i in zip(nodes, ids, strict=True)))


async def lookups(
    nodes: list[Discovery], total: int, repeats: int
) -> tuple[list[float], list[float]]:
    """Latency (s) and completeness (share of ``total`` records) of each lookup, one node at a
    time (lookups at once would measure this machine's two cores, not the DHT)."""
    seconds, shares = [], []
    for _ in range(repeats):
        for node in nodes:
            started = time.perf_counter()
            try:
                found = len(await node.find())
            except Exception:  # a failed lookup counts as slow and empty
                found = 0
            seconds.append(time.perf_counter() - started)
            shares.append(found / total)
    return seconds, shares


async def pick_victims(nodes: list[Any], count: int) -> list[Any]:
    """The peers to freeze: with libp2p, the ones that hold the swarm's records (the worst
    case: every lookup must get past them); with hivemind (whose replicas are not visible from
    here), the first ones after the bootstrap."""
    if hasattr(nodes[0], "_dht"):
        return list(nodes[1 : 1 + count])
    key = f"run/{RUN}/{SPEC.hex()}/peers"
    holders = (await nodes[0].sidecar.request("closest", 10, key=key))["peers"]
    by_peer = {n.visible_maddrs()[0].rsplit("/p2p/", 1)[1]: n for n in nodes}
    chosen = [by_peer[p] for p in holders if p in by_peer and by_peer[p] is not nodes[0]]
    others = [n for n in nodes[1:] if n not in chosen]
    return (chosen + others)[:count]


async def converge(
    nodes: list[Discovery], ids: list[Identity], deadline_seconds: float
) -> tuple[float | None, int]:
    """Announce every record (again, as running nodes do every ``announce_interval``) until
    each node's lookup returns all of them: (seconds from the first announce, or None if not
    within the deadline; announce rounds)."""
    started = time.perf_counter()
    for rounds in itertools.count(1):
        await announce_all(nodes, ids)
        _, shares = await lookups(nodes, len(nodes), 1)
        if min(shares) == 1.0:
            return time.perf_counter() - started, rounds
        if time.perf_counter() - started > deadline_seconds:
            return None, rounds
        await asyncio.sleep(ANNOUNCE_INTERVAL_SECONDS)
    raise AssertionError("unreachable")


async def close_all(nodes: list[Discovery]) -> None:
    await asyncio.gather(*(n.close() for n in nodes), return_exceptions=True)


async def measure(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    nodes, ids, start_seconds = await start_swarm(backend, args.nodes)
    try:
        converge_seconds, rounds = await converge(nodes, ids, args.converge_seconds)
        seconds, shares = await lookups(nodes, args.nodes, args.lookups)
        memory = [memory_mib(dht_pids(n)) for n in nodes]
    finally:
        await close_all(nodes)
    frozen_nodes, frozen_ids, _ = await start_swarm(backend, args.frozen_nodes)
    stopped: list[int] = []
    try:
        await converge(frozen_nodes, frozen_ids, args.converge_seconds)
        victims = await pick_victims(frozen_nodes, args.frozen)
        stopped = [pid for node in victims for pid in dht_pids(node)]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        live = [n for n in frozen_nodes if n not in victims]
        frozen_seconds, frozen_shares = await lookups(live, args.frozen_nodes, args.lookups)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        await close_all(frozen_nodes)
    return {
        "backend": backend,
        "nodes": args.nodes,
        "start_seconds": start_seconds,
        "converge_seconds": converge_seconds,
        "announce_rounds": rounds,
        "lookup_seconds": seconds,
        "lookup_share": shares,
        "pss_mib": [m[0] for m in memory],
        "uss_mib": [m[1] for m in memory],
        "frozen": {
            "nodes": args.frozen_nodes,
            "stopped": args.frozen,
            "lookup_seconds": frozen_seconds,
            "lookup_share": frozen_shares,
        },
    }


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f}"


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(result: dict[str, Any]) -> str:
    s, f = result["lookup_seconds"], result["frozen"]["lookup_seconds"]
    return (
        f"{result['backend']:<9} {result['start_seconds']:>8.1f}"
        f" {_seconds(result['converge_seconds']):>9} {result['announce_rounds']:>6}"
        f" {statistics.median(s) * 1e3:>9.0f} {quantile(s, 0.9) * 1e3:>7.0f}"
        f" {statistics.mean(result['lookup_share']):>6.0%}"
        f" {statistics.median(result['pss_mib']):>8.0f}"
        f" {statistics.median(result['uss_mib']):>8.0f}"
        f" {statistics.median(f) * 1e3:>9.0f} {quantile(f, 0.9) * 1e3:>7.0f} {max(f) * 1e3:>7.0f}"
        f" {statistics.mean(result['frozen']['lookup_share']):>6.0%}"
    )


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    print(
        f"{args.nodes} nodes on loopback, {args.lookups} lookup(s) per node; then "
        f"{args.frozen_nodes} nodes with {args.frozen} frozen (SIGSTOP)"
    )
    print(
        f"{'backend':<9} {'start s':>8} {'visible s':>9} {'rounds':>6}"
        f" {'lookup ms':>9} {'p90':>7} {'found':>6}"
        f" {'PSS MiB':>8} {'USS MiB':>8} {'frozen ms':>9} {'p90':>7} {'max':>7} {'found':>6}"
    )
    results = []
    for backend in args.backends.split(","):
        if backend not in BACKENDS:
            raise SystemExit(f"unknown backend {backend!r}")
        result = await measure(backend, args)
        print(row(result), flush=True)
        results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--lookups", type=int, default=3, help="lookups per node")
    parser.add_argument("--frozen-nodes", type=int, default=16)
    parser.add_argument("--frozen", type=int, default=3)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--converge-seconds", type=float, default=120.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = asyncio.run(run(args))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
