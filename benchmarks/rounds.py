#!/usr/bin/env python3
"""What a round costs a local swarm beyond its training: the demo spec on a quarter of its
tokens (the tests' ``light`` swarm), its nodes on loopback, timed round by round.

    python benchmarks/rounds.py                          # 4 nodes, 12 rounds, 3 repeats
    python benchmarks/rounds.py --nodes 8 --rounds 8 --repeats 5 --json out.json

Reported per repeat: the swarm's wall seconds (start to every node at the last epoch), and every
node's ``round_seconds`` (matchmaking and the all-reduce: what a round adds to the training);
then medians and ranges over the repeats. Run it on an otherwise idle machine, before and after a
change to matchmaking, in one sitting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from status import LIGHT  # benchmarks/status.py, beside this file

from swarmgrad.simulations.swarm import SimulationConfig, simulate


def one_swarm(nodes: int, rounds: int, seed: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rounds-") as folder:
        out = Path(folder)
        (out / "run.toml").write_text(LIGHT)
        started = time.monotonic()
        summary = simulate(
            SimulationConfig(nodes=nodes, rounds=rounds, spec_path=out / "run.toml",
                             profile_path=None, out_dir=out / "sim", seed=seed)
        )  # fmt: skip
        wall = time.monotonic() - started
        history = [
            h
            for i in range(nodes)
            for h in json.loads((out / "sim" / f"node-{i}.json").read_text())["history"]
        ]
    seconds = [h["round_seconds"] for h in history]
    return {
        "wall_seconds": wall,
        "round_seconds_median": statistics.median(seconds),
        "round_seconds_p90": statistics.quantiles(seconds, n=10)[-1],
        "averaged": sum(h["outcome"] == "averaged" for h in history) / len(history),
        "replicas_identical": summary["replicas_identical"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for option, default in (("--nodes", 4), ("--rounds", 12), ("--repeats", 3)):
        parser.add_argument(option, type=int, default=default)
    parser.add_argument("--json", type=Path, help="write the repeats here too")
    args = parser.parse_args()
    runs = [one_swarm(args.nodes, args.rounds, seed) for seed in range(args.repeats)]
    for i, run in enumerate(runs):
        print(f"repeat {i}: wall {run['wall_seconds']:.1f} s, round median "
              f"{run['round_seconds_median']:.2f} s (p90 {run['round_seconds_p90']:.2f} s), "
              f"averaged {run['averaged']:.0%}, identical {run['replicas_identical']}")  # fmt: skip
    for key in ("wall_seconds", "round_seconds_median"):
        values = [r[key] for r in runs]
        print(f"{key}: median {statistics.median(values):.2f} (range {min(values):.2f}-"
              f"{max(values):.2f})")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    return 0 if all(r["replicas_identical"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
