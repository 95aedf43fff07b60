#!/usr/bin/env python3
"""Overlapped outer rounds against blocking ones: utilization and loss at equal samples.

    python benchmarks/overlap.py                          # 4 nodes, 2 MB/s uplinks, 2 repeats
    python benchmarks/overlap.py --fragments 1,2 --rounds 8 --repeats 3 --json out.json

Every arm runs the same demo spec (``--inner-steps``, int8 rounds) as real node processes on
loopback, every node's upload capped at ``--upload-mb`` MB/s, with the same seeded identities
(so the same data streams), alternating arm by arm: ``blocking`` rounds, and for each K in
``--fragments`` overlapped rounds of the whole model (K = 1) or of K fragments in turn (a round
every inner_steps / K steps, each overlapped with the next fragment's steps). Each arm trains
``--rounds x --inner-steps`` batches per node and ends with every sample's progress landed in the
global model (a run's end lands its round in flight and, with fragments, the fragments synced
before the last), so the final models are compared at equal samples. Reported per arm:
utilization (compute time over compute plus the time training waited for rounds, mean over
nodes), the final validation loss, wall time, and round times; then the medians' ratios to
blocking. Timings share 2 cores with 4 processes: compare arms within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate


def spec_text(inner_steps: int, overlap: bool, fragments: int = 1) -> str:
    text = DEMO_SPEC.replace("inner_steps = 10", f"inner_steps = {inner_steps}")
    if overlap:
        text = text.replace(
            "outer_momentum = 0.0", f"outer_momentum = 0.0\noverlap = true\nfragments = {fragments}"
        )
    return text


def run_arm(
    work: Path,
    *,
    overlap: bool,
    rounds: int,
    nodes: int,
    inner_steps: int,
    upload: float,
    seed: int,
    fragments: int = 1,
) -> dict[str, Any]:
    spec = work / f"run-{overlap}.toml"
    spec.write_text(spec_text(inner_steps, overlap, fragments))
    profile = work / "peers.toml"
    profile.write_text(f"[[peer]]\nupload_bytes_per_second = {upload}\n")
    summary = simulate(
        SimulationConfig(
            nodes=nodes,
            rounds=rounds,
            spec_path=spec,
            profile_path=profile,
            out_dir=work / f"sim-{overlap}",
            timeout_seconds=1800,
            seed=seed,
        )
    )
    peers = summary["peers"]
    return {
        "ok": summary["ok"],
        "replicas_identical": summary["replicas_identical"],
        "rounds": rounds,
        "samples_per_node": statistics.fmean(p["samples"] for p in peers),
        "utilization": statistics.fmean(p["utilization"] for p in peers),
        "final_val_loss": summary["final_val_loss"],
        "wall_seconds": summary["wall_seconds"],
        "round_seconds": summary.get("round_seconds"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8, help="whole-model rounds, every arm")
    parser.add_argument("--inner-steps", type=int, default=30)
    parser.add_argument("--upload-mb", type=float, default=2.0, help="every node's uplink, MB/s")
    parser.add_argument("--fragments", default="1,2", help="overlapped arms: fragments each")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    upload = args.upload_mb * 1e6
    overlapped = {
        ("overlapped" if k == 1 else f"overlapped, {k} fragments"): k
        for k in (int(part) for part in args.fragments.split(","))
    }
    arms: dict[str, list[dict[str, Any]]] = {"blocking": []} | {name: [] for name in overlapped}
    for repeat in range(args.repeats):
        for name in arms:
            fragments = overlapped.get(name, 1)
            with tempfile.TemporaryDirectory() as folder:
                result = run_arm(
                    Path(folder),
                    overlap=name != "blocking",
                    rounds=args.rounds * fragments,  # a fragment's round counts as one
                    nodes=args.nodes,
                    inner_steps=args.inner_steps,
                    upload=upload,
                    seed=repeat,
                    fragments=fragments,
                )
            arms[name].append(result)
            print(
                f"{name:>24} #{repeat}: utilization {result['utilization']:.1%}, "
                f"val loss {result['final_val_loss']:.4f}, samples/node "
                f"{result['samples_per_node']:.0f}, {result['wall_seconds']:.0f} s, "
                f"identical {result['replicas_identical']}",
                flush=True,
            )
    table: dict[str, Any] = {"config": vars(args) | {"json": str(args.json)}, "arms": arms}
    for name, results in arms.items():
        utilization = [r["utilization"] for r in results]
        losses = [r["final_val_loss"] for r in results]
        table[name] = {
            "utilization_median": statistics.median(utilization),
            "utilization_range": [min(utilization), max(utilization)],
            "val_loss_median": statistics.median(losses),
            "val_loss_range": [min(losses), max(losses)],
        }
    base = table["blocking"]["val_loss_median"]
    table["loss_ratio"] = {name: table[name]["val_loss_median"] / base for name in overlapped}
    print(json.dumps({k: v for k, v in table.items() if k != "arms"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
