"""Bytes each peer sends to reach a validation loss: sync fp32 vs DiLoCo fp32 / 8-bit / 4-bit.

Every setting is a real local swarm (``swarmgrad simulate``: a bootstrap and N node processes on
loopback) training the demo model on the same sample budget (same samples per peer). For each
setting the script reports, per peer:

* bytes sent to reach the target validation loss (the first epoch whose mean validation loss over
  the peers is at or below it), and the ratio to sync fp32's bytes for the same target;
* the final validation loss at the common sample budget, and its gap to sync fp32's.

The target defaults to within 2% of sync fp32's final loss (``--target-gap``): how soon each
setting comes as close to what per-step averaging reaches on the budget as the issue allows.

Each seed (``--seeds``) fixes the peers' identities and so their data streams (``simulate``'s
``seed``): within a seed every setting sees the same data, and its gap is measured against the
sync run of the same seed. Over several seeds the script reports the median and the range.

    .venv/bin/python benchmarks/communication.py                 # 4 nodes, ~10 minutes on 2 cores
    .venv/bin/python benchmarks/communication.py --seeds 1 2 3 --only "sync fp32" "diloco int4"
    .venv/bin/python benchmarks/communication.py --inner-steps 50 --samples-per-peer 4000
    .venv/bin/python benchmarks/communication.py --inner-steps 25 --outer 1.0/0.5 \\
        --warm-start-steps 250        # from a model that has trained a while, as the paper does
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

from swarmgrad.node.config import home
from swarmgrad.node.runspec import RunSpec
from swarmgrad.simulations.baseline import warm_start
from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate

#: (name, algorithm, codec, more ``[averaging]`` lines: the codec's options, the results' codec)
SETTINGS = [
    ("sync fp32", "sync", "none", ""),
    ("diloco fp32", "diloco", "none", ""),
    ("diloco int8", "diloco", "int8", ""),
    ("diloco int4", "diloco", "int4", ""),
    ("diloco sparse 2-bit", "diloco", "sparse", "codec_options = { bits = 2 }"),
    ("diloco sparse 4-bit", "diloco", "sparse", "codec_options = { bits = 4 }"),
    (
        "diloco sparse, int8 results",
        "diloco",
        "sparse",
        'codec_options = { bits = 2 }\nresult_codec = "int8"',
    ),
]


#: The options that say what was run (saved with --json, restored with --from-json).
RUN_ARGS = (
    "nodes",
    "inner_steps",
    "samples_per_peer",
    "outer",
    "schedule",
    "lr",
    "diloco_lr",
    "warm_start_steps",
    "eval_windows",
)


def spec_text(
    algorithm: str,
    codec: str,
    *,
    nodes: int,
    inner_steps: int,
    batch: int,
    outer: str = "1.0/0.0",
    schedule: str = "0/0",
    inner_lr: float | None = None,
    init: str = "",
    averaging: str = "",
) -> str:
    chosen = f'codec = "{codec}"' + (f"\n{averaging}" if averaging else "")
    text = DEMO_SPEC.replace('codec = "int8"', chosen)
    text = text.replace("group_size = 256", f"group_size = {nodes}")
    text = re.sub(r"inner_steps = \d+", f"inner_steps = {inner_steps}", text)
    outer_lr, outer_momentum = (float(x) for x in outer.split("/"))
    text = text.replace(
        "outer_lr = 1.0\nouter_momentum = 0.0",
        f"outer_lr = {outer_lr}\nouter_momentum = {outer_momentum}",
    )
    text = text.replace("seq_len = 64\n", f"seq_len = 64\n{init}")
    if inner_lr is not None:
        text = re.sub(r"inner_lr = [0-9.e-]+", f"inner_lr = {inner_lr!r}", text)
    warmup, decay = (int(x) for x in schedule.split("/"))
    text = text.replace(
        "outer_momentum = ", f"warmup_steps = {warmup}\ndecay_steps = {decay}\nouter_momentum = "
    )
    if algorithm == "sync":
        # One optimizer step per global batch of one micro-batch from every peer.
        text = text.replace(
            'name = "diloco"', f'name = "sync"\ntarget_batch_size = {nodes * batch}'
        )
    return text


def first_reaching(curve: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    return next((point for point in curve if point["val_loss"] <= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=50, help="DiLoCo's H")
    parser.add_argument(
        "--samples-per-peer", type=int, default=4000, help="sample budget of every setting"
    )
    parser.add_argument("--target-loss", type=float, help="a fixed target for every seed")
    parser.add_argument(
        "--target-gap",
        type=float,
        default=0.02,
        help="without --target-loss: the target is sync fp32's final loss x (1 + this)",
    )
    parser.add_argument(
        "--from-json", type=Path, help="report on the results a --json run saved; run nothing"
    )
    parser.add_argument("--outer", default="1.0/0.0", help="DiLoCo's outer lr/momentum")
    parser.add_argument("--lr", type=float, help="inner AdamW lr (default: the demo spec's)")
    parser.add_argument(
        "--diloco-lr", type=float, help="the diloco settings' inner lr, if not --lr's"
    )
    parser.add_argument(
        "--schedule", default="0/0", help="inner lr WARMUP/DECAY steps (algorithm.warmup_steps/...)"
    )
    parser.add_argument(
        "--warm-start-steps",
        type=int,
        default=0,
        help="first train the initial model alone for this many steps of the global batch, on a "
        "stream no peer sees, and start every setting from it (model.init)",
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[1], help="one run of every setting per seed"
    )
    parser.add_argument(
        "--eval-windows",
        type=int,
        default=128,
        help="held-out windows each node evaluates after each round (the node's default is 32)",
    )
    parser.add_argument("--only", nargs="*", help="run only these settings (by name)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        for (
            key
        ) in RUN_ARGS:  # what the saved run was (a file from before these were saved: as given)
            setattr(args, key, saved.get("args", {}).get(key, getattr(args, key)))
        args.json = None
        report(args, {int(seed): runs for seed, runs in saved["results"].items()})
        return
    batch = 16  # the demo spec's data.batch_size
    with tempfile.TemporaryDirectory() as keep:
        init = ""
        if args.warm_start_steps:
            weights = Path(keep) / "warm.safetensors"
            digest, loss = warm_start(
                RunSpec.from_toml(DEMO_SPEC),
                steps=args.warm_start_steps,
                batch_size=args.nodes * batch,
                cache_dir=home() / "cache",
                path=weights,
            )
            init = f'init = "{weights}"\ninit_sha256 = "{digest}"\n'
            print(f"warm start: {args.warm_start_steps} steps alone, val loss {loss:.3f}")
        results = {
            seed: run_settings(args, batch=batch, init=init, seed=seed) for seed in args.seeds
        }
    report(args, results)


def run_settings(
    args: argparse.Namespace, *, batch: int, init: str, seed: int
) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for name, algorithm, codec, averaging in SETTINGS:
        if args.only and name not in args.only:
            continue
        steps_per_epoch = 1 if algorithm == "sync" else args.inner_steps
        epochs = max(1, args.samples_per_peer // (batch * steps_per_epoch))
        with tempfile.TemporaryDirectory() as tmp:
            spec = Path(tmp) / "run.toml"
            spec.write_text(
                spec_text(
                    algorithm,
                    codec,
                    nodes=args.nodes,
                    inner_steps=args.inner_steps,
                    batch=batch,
                    outer=args.outer,
                    schedule=args.schedule,
                    inner_lr=args.diloco_lr
                    if algorithm == "diloco" and args.diloco_lr
                    else args.lr,
                    init=init,
                    averaging=averaging,
                )
            )
            summary = simulate(
                SimulationConfig(
                    nodes=args.nodes,
                    rounds=epochs,
                    spec_path=spec,
                    profile_path=None,
                    out_dir=Path(tmp) / "sim",
                    timeout_seconds=3600,
                    seed=seed,
                    extra_node_args=("--eval-windows", str(args.eval_windows)),
                )
            )
        results[name] = summary
        print(
            f"seed {seed}, {name}: {epochs} epochs in {summary['wall_seconds']:.0f} s, val loss "
            f"{summary['initial_val_loss']:.3f} -> {summary['final_val_loss']:.3f}, "
            f"replicas identical: {summary['replicas_identical']}",
            flush=True,
        )
    return results


def _sent(point: dict[str, Any] | None) -> float | None:
    return point["bytes_sent_per_peer"] if point else None


def compare(
    runs: dict[str, dict[str, Any]], target_loss: float | None, target_gap: float
) -> dict[str, dict[str, Any]]:
    """One seed's rows: each setting's final loss, gap, bytes and ratios to sync fp32's."""
    reference = runs.get("sync fp32")
    target = target_loss or (reference["final_val_loss"] * (1 + target_gap) if reference else None)
    rows = {}
    for name, summary in runs.items():
        curve = summary["loss_curve"]
        row: dict[str, Any] = {
            "final": summary["final_val_loss"],
            "total": curve[-1]["bytes_sent_per_peer"] if curve else 0.0,
            "to_target": _sent(first_reaching(curve, target)) if target else None,
            "target": target,
        }
        if reference:
            ref_curve = reference["loss_curve"]
            ref_total = ref_curve[-1]["bytes_sent_per_peer"]
            ref_to_target = _sent(first_reaching(ref_curve, target)) if target else None
            row["gap"] = (row["final"] - reference["final_val_loss"]) / reference["final_val_loss"]
            row["total_ratio"] = ref_total / row["total"] if row["total"] else None
            row["ratio"] = (
                ref_to_target / row["to_target"] if ref_to_target and row["to_target"] else None
            )
        rows[name] = row
    return rows


def _fmt(value: float | None, spec: str, missing: str = "") -> str:
    """``value`` as ``spec`` says (a trailing "x" is written after the number)."""
    if value is None:
        return missing
    return format(value, spec[:-1]) + "x" if spec.endswith("x") else format(value, spec)


def report(args: argparse.Namespace, results: dict[int, dict[str, dict[str, Any]]]) -> None:
    print(
        f"\n{args.nodes} peers, {args.samples_per_peer} samples per peer, H = {args.inner_steps}, "
        f"outer {args.outer}, inner lr {args.lr or 'as the demo spec'}"
        f"{f' (diloco {args.diloco_lr:g})' if args.diloco_lr else ''}, schedule {args.schedule}, "
        f"warm start {args.warm_start_steps} steps, "
        f"{args.eval_windows} validation windows"
    )
    if args.target_loss:
        print(f"target validation loss: {args.target_loss:.3f}")
    else:
        print(f"target validation loss: sync fp32's final + {args.target_gap:.0%} (of each seed)")
    header = f"{'seed':<6}{'setting':<14}{'final loss':>11}{'gap':>8}{'MiB to target':>15}"
    header += f"{'ratio':>9}{'MiB total':>11}{'total ratio':>13}"
    print(header)
    print("-" * len(header))
    table = {
        seed: compare(runs, args.target_loss, args.target_gap) for seed, runs in results.items()
    }
    for seed, rows in table.items():
        for name, row in rows.items():
            print(
                f"{seed:<6}{name:<14}{row['final']:>11.3f}{_fmt(row.get('gap'), '+.1%'):>8}"
                f"{_fmt(row['to_target'] and row['to_target'] / 2**20, '.1f', 'not reached'):>15}"
                f"{_fmt(row.get('ratio'), '.0fx'):>9}{row['total'] / 2**20:>11.1f}"
                f"{_fmt(row.get('total_ratio'), '.0fx'):>13}"
            )
    if len(table) > 1:
        print(f"\nover {len(table)} seeds: median [min, max]")
        names = list(next(iter(table.values())))
        for name in names:
            rows = [rows[name] for rows in table.values() if name in rows]
            print(
                f"{name:<14} final {_spread([r['final'] for r in rows], '.3f')}"
                f"  gap {_spread([r.get('gap') for r in rows], '+.1%')}"
                f"  total ratio {_spread([r.get('total_ratio') for r in rows], '.0fx')}"
                f"  ratio to target {_spread([r.get('ratio') for r in rows], '.0fx')}"
            )
    if args.json:
        saved = {
            "args": {k: getattr(args, k) for k in RUN_ARGS},
            "results": results,
            "table": table,
        }
        args.json.write_text(json.dumps(saved, indent=1))


def _spread(values: list[float | None], spec: str) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    low, mid, high = (_fmt(v, spec) for v in (min(known), statistics.median(known), max(known)))
    return f"{mid} [{low}, {high}]"


if __name__ == "__main__":
    main()
