#!/usr/bin/env python3
"""Reachability in the NAT lab: how peers get connected, and what NAT'd peers cost a round.

    sudo python benchmarks/nat.py                  # three swarms, 6 rounds each (~5 min)
    sudo python benchmarks/nat.py --rounds 4 --json out.json

Three 4-peer swarms of real node processes in network namespaces (simulations/natlab.py), one
after the other, each training the demo model (DiLoCo, int8, group of 4):
  all-public:   4 peers on the public segment;
  half-natted:  2 public peers, 2 each behind its own router (masquerade, unsolicited inbound
                dropped, no UPnP);
  half-upnp:    the same, but one of the two routers offers UPnP.
It prints how each peer came to be reached (direct / upnp / relayed), the share of the round's
links (member -> owner of a part) that are direct, through a mapped port, punched (NAT'd to NAT'd)
or relayed, and the
median all-reduce and round times of the rounds where all four averaged, side by side with the
all-public swarm. Needs root (namespaces), nftables and miniupnpd.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from itertools import permutations
from pathlib import Path
from typing import Any

from swarmgrad.simulations.lab_nodes import start_swarm, wait_until
from swarmgrad.simulations.natlab import Host, NatLab
from swarmgrad.simulations.swarm import DEMO_SPEC


def run_swarm(name: str, layout: list[str], rounds: int, work: Path) -> dict[str, Any]:
    out = work / name
    out.mkdir(parents=True)
    spec = out / "run.toml"
    spec.write_text(DEMO_SPEC.replace('id = "shakespeare-demo"', f'id = "nat-bench-{name}"'))
    with NatLab() as lab:
        boot = lab.public()
        hosts: list[Host] = []
        for kind in layout:
            hosts.append(lab.public() if kind == "public" else lab.home(upnp=kind == "upnp"))
        started = time.monotonic()
        nodes = start_swarm(boot, hosts, spec_path=spec, out_dir=out, rounds=rounds)
        try:
            done = wait_until(
                nodes,
                lambda s: s.get("epoch", 0) >= rounds,
                timeout_seconds=120 + 60 * rounds,
                what="trained",
            )
        finally:
            for node in nodes:
                node.stop()
        elapsed = time.monotonic() - started
    reach = [s["reachability"] for s in done]
    # In a round every member dials every other member's part (all own one here): the link from
    # A to B is however B is reached, except that a NAT'd A punches through to a relayed B (and
    # counts its punched and relay-fallback connections).
    links = {"direct": 0, "upnp": 0, "punched": 0, "relayed": 0, "unreachable": 0}
    for a, b in permutations(range(len(reach)), 2):
        kind = reach[b]
        if kind == "relayed" and reach[a] in ("relayed", "unreachable"):
            tried = done[a]["links"]
            kind = "punched" if tried["punched"] and not tried["relayed"] else "relayed"
        links[kind] += 1
    full = [
        h
        for s in done
        for h in s["history"]
        if h["outcome"] == "averaged" and h["group_size"] == len(layout)
    ]
    allreduce = [h["allreduce_seconds"] for h in full]
    round_seconds = [h["round_seconds"] for h in full]
    return {
        "name": name,
        "layout": layout,
        "reachability": reach,
        "links": links,
        "full_rounds": len(full),
        "allreduce_median_s": statistics.median(allreduce) if allreduce else None,
        "allreduce_spread_s": [min(allreduce), max(allreduce)] if allreduce else None,
        "round_median_s": statistics.median(round_seconds) if round_seconds else None,
        "relayed_bytes": sum(s.get("relayed_bytes", 0) for s in done),
        "identical": len({s["checksum"] for s in done}) == 1,
        "wall_s": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nat-bench-") as tmp:
        layouts = {
            "all-public": ["public"] * 4,
            "half-natted": ["public", "public", "nat", "nat"],
            "half-upnp": ["public", "public", "upnp", "nat"],
        }
        work = Path(tmp)
        results = [run_swarm(name, layout, args.rounds, work) for name, layout in layouts.items()]
    print(f"4 peers, demo model, DiLoCo int8, {args.rounds} rounds per swarm")
    print(
        f"{'swarm':<12} {'peers reached as':<34} {'links direct/upnp/punched/relayed':<34} "
        f"{'all-reduce median (min-max)':<28} {'round median':<12} relayed"
    )
    base = results[0]["allreduce_median_s"]
    for r in results:
        reached = ", ".join(r["reachability"])
        total = sum(r["links"].values())
        kinds = ("direct", "upnp", "punched", "relayed")
        pairs = "/".join(f"{100 * r['links'][k] / total:.0f}%" for k in kinds)
        med, spread = r["allreduce_median_s"], r["allreduce_spread_s"]
        allreduce = (
            f"{med:.3f} s ({spread[0]:.3f}-{spread[1]:.3f})"
            + (f" {med / base:.2f}x" if base else "")
            if med is not None
            else "no full round"
        )
        rounds = f"{r['round_median_s']:.2f} s" if r["round_median_s"] is not None else "-"
        print(
            f"{r['name']:<12} {reached:<34} {pairs:<34} {allreduce:<28} {rounds:<12} "
            f"{r['relayed_bytes'] / 1e6:.1f} MB"
        )
        if not r["identical"]:
            print(f"  ! {r['name']}: replicas differ")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
