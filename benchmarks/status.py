#!/usr/bin/env python3
"""How long ``swarmgrad status`` takes to show a live run's peers, three ways: through the DHT
(a reader joins, reads, leaves), from a local node's own view (``--node``: no DHT), and each
refresh of ``--watch`` (one reader kept open).

    python benchmarks/status.py                  # a 2-node demo swarm, 5 repeats
    python benchmarks/status.py --nodes 3 --repeats 7 --json out.json

The swarm trains (the light demo spec, 60 rounds, then it serves until the end) while it is
measured, as a volunteer's machine does.
Each ``status`` is a whole command (interpreter start included), arms alternating; ``--watch``
prints a JSON line a refresh and the gaps between lines, less the period, are its reads.
Reported: medians and ranges, and DHT / node.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate

#: The demo spec training a quarter of its tokens a step (tests/helpers.light): rounds every
#: second or two, so the swarm is busy but the benchmark short.
LIGHT = DEMO_SPEC.replace("seq_len = 64", "seq_len = 32").replace(
    "batch_size = 16", "batch_size = 8"
)


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarmgrad.node.cli", "status", *args, "--json"]


def timed(args: list[str]) -> float:
    started = time.monotonic()
    subprocess.run(args, check=True, capture_output=True, timeout=120)
    return time.monotonic() - started


def watch_gaps(args: list[str], seconds: float, period: float) -> tuple[float, list[float]]:
    """The first line's time and the gaps (less ``period``) between the next ones."""
    started = time.monotonic()
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    times = []
    try:
        for _ in process.stdout:
            times.append(time.monotonic() - started)
            if times[-1] > seconds:
                break
    finally:
        process.terminate()
        process.wait(timeout=30)
    return times[0], [b - a - period for a, b in itertools.pairwise(times)]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out, spec = Path(folder) / "sim", Path(folder) / "run.toml"
        spec.write_text(LIGHT)
        done, errors = threading.Event(), []

        def swarm() -> None:
            try:
                simulate(SimulationConfig(nodes=args.nodes, rounds=60, spec_path=spec,
                                          profile_path=None, out_dir=out, hold=done))  # fmt: skip
            except Exception as error:  # reported below
                errors.append(error)

        thread = threading.Thread(target=swarm, daemon=True)
        thread.start()
        deadline = time.monotonic() + 180
        while not all((out / f"node-{i}.json").exists() for i in range(args.nodes)):
            if errors or time.monotonic() > deadline:
                raise SystemExit(f"the swarm did not start: {errors}")
            time.sleep(0.5)
        log = (out / "node-0.log").read_text()
        metrics = log.split("metrics on http://", 1)[1].split("/metrics", 1)[0]
        via_dht = command(str(spec), "--bootstrap-file", str(out / "bootstrap.json"))
        via_node = command("--node", metrics)
        dht, node = [], []
        for _ in range(args.repeats):
            dht.append(timed(via_dht))
            node.append(timed(via_node))
        first, gaps = watch_gaps([*via_dht, "--watch", "1"], seconds=12, period=1.0)
        done.set()
        thread.join(timeout=120)
    results: dict[str, Any] = {
        "nodes": args.nodes,
        "repeats": args.repeats,
        "dht_seconds": spread(dht),
        "node_seconds": spread(node),
        "watch_first_seconds": first,
        "watch_read_seconds": spread(gaps),
    }
    print(f"{args.nodes} nodes training, {args.repeats} repeats (median, range)")
    for name, key in (("status via the DHT", "dht_seconds"), ("status --node", "node_seconds")):
        s = results[key]
        print(f"{name:<20} {s['median']:6.2f} s ({s['min']:.2f}-{s['max']:.2f})")
    w = results["watch_read_seconds"]
    print(
        f"status --watch 1     first table {first:.2f} s; each refresh's read "
        f"{1000 * w['median']:.0f} ms ({1000 * w['min']:.0f}-{1000 * w['max']:.0f})"
    )
    print(
        f"DHT / node: {results['dht_seconds']['median'] / results['node_seconds']['median']:.1f}x"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
