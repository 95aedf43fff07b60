#!/usr/bin/env python3
"""The same benchmarks on an older checkout ("before") and on this tree ("after"), alternating.

    git worktree add /tmp/before 38f1593
    .venv/bin/python benchmarks/before_after.py --before-tree /tmp/before            # ~30 min
    .venv/bin/python benchmarks/before_after.py --before-tree /tmp/before --only codecs demo

Each run is a process of its own: the before runs import the old tree's packages (they go first
on PYTHONPATH, under the ``swarmgrad`` name) and run the old tree's copy of the script, so each
side is measured by its own code. The order alternates per pass (before, after; then after,
before), so neither side always runs first on a machine whose speed drifts. Every run's whole
output goes to ``--out`` (one file per run); the summary prints the lines that hold each
benchmark's numbers, side by side.

What it runs (the numbers issue 43 asks to stay within noise through the house's refactors):
codecs (64 MiB encode + decode), the all-reduce of 4 peers (25M values, none and int8), state
sync (100 MB from 1, 2 and 4 capped donors), an open run's round cost (one process: trusted vs
open all-reduce of 8 members; a swarm of 8: one trusted and one open run), and the demo (4 nodes,
10 rounds: wall time and final validation loss).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("node", "protocol", "compression", "simulations")


@dataclass(frozen=True, slots=True)
class Bench:
    name: str
    #: The command, ``{tree}`` standing for the tree's root and ``{out}`` for a scratch folder.
    argv: tuple[str, ...]
    #: Lines of its output that hold its numbers (a regular expression).
    keep: str
    timeout_seconds: float


BENCHES = (
    Bench("codecs", ("{tree}/benchmarks/codecs.py", "--size-mib", "64", "--repeats", "5",
                     "--no-hivemind"), r"int8|fp16|int4", 900),
    Bench("allreduce", ("{tree}/benchmarks/allreduce.py", "--sizes-m", "25", "--peers", "4",
                        "--codecs", "none,int8", "--rounds", "5", "--kill-trials", "0",
                        "--no-hivemind"), r"swarmgrad|none|int8", 900),
    Bench("state_sync", ("{tree}/benchmarks/state_sync.py", "--mb", "100", "--repeats", "3"),
          r"swarmgrad|hivemind", 1200),
    Bench("open_cost", ("{tree}/benchmarks/byzantine.py", "--round-cost-only",
                        "--swarm-upload-mb", "0", "--swarm-repeats", "1",
                        "--round-cost-repeats", "10"), r"trusted|open|between", 1800),
    Bench("demo", ("-m", "swarmgrad.node.cli", "simulate", "--nodes", "4", "--rounds", "10",
                   "--out", "{out}/simulation"), r"val loss|rounds in|identical|wall", 900),
)  # fmt: skip


def overlay(before: Path, folder: Path) -> Path:
    """A folder whose ``swarmgrad`` package is ``before``'s (first on PYTHONPATH)."""
    package = folder / "swarmgrad"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").touch()
    for name in PACKAGES:
        link = package / name
        link.unlink(missing_ok=True)
        link.symlink_to(before / name)
    return folder


def run_one(bench: Bench, tree: Path, env: dict[str, str], log: Path) -> tuple[float, str]:
    """One run: its wall seconds and the lines of its output that hold its numbers."""
    with tempfile.TemporaryDirectory() as scratch:
        argv = [a.format(tree=tree, out=scratch) for a in bench.argv]
        started = time.monotonic()
        try:
            done = subprocess.run([sys.executable, *argv], cwd=scratch, env=env,
                                  capture_output=True, text=True,
                                  timeout=bench.timeout_seconds)  # fmt: skip
            output, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as expired:
            output, code = f"{expired.stdout or ''}{expired.stderr or ''}", -1
        seconds = time.monotonic() - started
    log.write_text(output)
    kept = [line for line in output.splitlines() if re.search(bench.keep, line)]
    if code != 0:
        kept.append(f"(exit {code}; whole output in {log})")
    return seconds, "\n".join(kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before-tree", type=Path, required=True, help="the older checkout")
    parser.add_argument("--passes", type=int, default=2, help="runs per side and benchmark")
    parser.add_argument("--only", nargs="+", choices=[b.name for b in BENCHES])
    parser.add_argument("--out", type=Path, default=Path("before-after"), help="the outputs")
    args = parser.parse_args()
    before = args.before_tree.resolve()
    if not (before / "node").is_dir():
        parser.error(f"{before} is not a swarmgrad checkout (no node/)")
    args.out.mkdir(parents=True, exist_ok=True)
    imports = f"{overlay(before, args.out / 'before-pkg')}{os.pathsep}{before}"
    trees = {
        "before": (before, os.environ | {"PYTHONPATH": imports}),
        "after": (REPO, dict(os.environ)),
    }
    benches = [b for b in BENCHES if not args.only or b.name in args.only]
    print(f"before: {before}; after: {REPO}; {args.passes} pass(es); outputs in {args.out}")
    for bench in benches:
        for k in range(args.passes):
            order = ["before", "after"] if k % 2 == 0 else ["after", "before"]
            for side in order:
                tree, env = trees[side]
                log = args.out / f"{bench.name}-{side}-{k}.txt"
                seconds, kept = run_one(bench, tree, env, log)
                print(f"\n== {bench.name}, {side}, pass {k + 1} ({seconds:.0f} s)", flush=True)
                print(kept, flush=True)


if __name__ == "__main__":
    main()
