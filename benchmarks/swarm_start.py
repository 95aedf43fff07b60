#!/usr/bin/env python3
"""What a local swarm costs to start and stop: node processes forked from the warm zygote
against each started from a fresh interpreter.

    python benchmarks/swarm_start.py                      # 4 nodes, 1 round, 3 repeats
    python benchmarks/swarm_start.py --nodes 8 --rounds 2 --repeats 5 --json out.json

Two ways a swarm is started, each with ``--fork-nodes`` and ``--no-fork-nodes``, alternating
arm by arm: ``cli``, the command a user runs (``swarmgrad simulate``, a process of its own, so
the forked arm includes the zygote's start), and ``library``, ``simulate()`` called again and
again in one process (a test suite, a sweep), where the zygote is already up after the first
swarm. Reported per arm: wall seconds and the machine's busy CPU-seconds over the run (from
/proc/stat: run it on an otherwise idle machine), medians and ranges; then forked / fresh.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarmgrad.simulations.swarm import SimulationConfig, simulate
from swarmgrad.simulations.zygote import zygote


def busy_cpu_seconds() -> float:
    """Every core's non-idle time since boot (the machine's, so children of children count)."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / 100.0


def measured(run: Callable[[], None]) -> tuple[float, float]:
    cpu, wall = busy_cpu_seconds(), time.monotonic()
    run()
    return time.monotonic() - wall, busy_cpu_seconds() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    args = parser.parse_args()

    def cli(out: Path, fork: bool) -> None:
        command = [
            sys.executable, "-m", "swarmgrad.node.cli", "simulate",
            "--nodes", str(args.nodes), "--rounds", str(args.rounds), "--out", str(out),
            "--fork-nodes" if fork else "--no-fork-nodes",
        ]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, timeout=600)

    def library(out: Path, fork: bool) -> None:
        config = SimulationConfig(
            nodes=args.nodes, rounds=args.rounds, out_dir=out, fork_nodes=fork
        )
        summary = simulate(config)
        if not summary["ok"]:
            raise SystemExit(f"the swarm failed: {out}")

    zygote()  # the library arms' zygote is up before the first one is timed
    ways = {"cli": cli, "library": library}
    results: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="swarm-start-") as folder:
        for repeat in range(args.repeats):
            for way, start in ways.items():
                for fork in (True, False):
                    arm = f"{way} {'forked' if fork else 'fresh'}"
                    out = Path(folder) / f"{way}-{fork}-{repeat}"
                    wall, cpu = measured(lambda: start(out, fork))  # noqa: B023 (called at once)
                    results.setdefault(arm, []).append((wall, cpu))
                    print(f"{arm:16} repeat {repeat}: {wall:5.1f} s wall, {cpu:5.1f} CPU-s")

    table: dict[str, Any] = {}
    print(f"\n{args.nodes} nodes, {args.rounds} round(s), {args.repeats} repeats (median, range)")
    for arm, runs in results.items():
        walls, cpus = [r[0] for r in runs], [r[1] for r in runs]
        table[arm] = {"wall_seconds": walls, "cpu_seconds": cpus}
        print(
            f"{arm:16} wall {statistics.median(walls):5.1f} s ({min(walls):.1f}-{max(walls):.1f})"
            f"  CPU {statistics.median(cpus):5.1f} s ({min(cpus):.1f}-{max(cpus):.1f})"
        )
    for way in ways:
        forked, fresh = table[f"{way} forked"], table[f"{way} fresh"]
        ratios = {
            key: statistics.median(forked[key]) / statistics.median(fresh[key])
            for key in ("wall_seconds", "cpu_seconds")
        }
        table[f"{way} forked / fresh"] = ratios
        print(
            f"{way:7} forked / fresh: wall {ratios['wall_seconds']:.2f}x, "
            f"CPU {ratios['cpu_seconds']:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
