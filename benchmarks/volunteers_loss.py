"""Rounds for volunteers in real node processes: the demo model's final loss in a swarm with a
speed spread and crashes, against a calm swarm's at equal computed samples.

Three swarms of 4 nodes run the new rounds (``algorithm.round_seconds`` slots of 3 s, one
group, progress carried over resyncs, a checkpoint once a second of training is at risk):

- calm: equal nodes, nobody leaves;
- spread: the nodes 1x, 1.5x, 2x and 4x slower, nobody leaves;
- volunteers: the spread, and two crashes: one node killed mid-round, another just after a
  mid-round checkpoint, each restarted at once from its checkpoint.

The slow nodes train less in the same window, so the swarms compute different samples a round;
two swarms are compared at the smaller of their final sample counts, each read on its own loss
curve (linear in log samples between the two rounds around it). Volunteers against spread is the
cost of the crashes alone; spread against calm, of where the samples are computed.

    .venv/bin/python benchmarks/volunteers_loss.py              # ~9 min on 2 cores
    .venv/bin/python benchmarks/volunteers_loss.py --seeds 1 --rounds 8
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate

WINDOW_SECONDS = 3.0
SLOWDOWNS = (1.0, 1.5, 2.0, 4.0)
CHURN = """\
[[event]]
at_epoch = 3
action = "kill"
node = 3
during = "round"

[[event]]
at_epoch = 3
action = "start"
node = 3

[[event]]
at_epoch = {second}
action = "kill"
node = 1
during = "checkpoint"

[[event]]
at_epoch = {second}
action = "start"
node = 1
"""


def spec_text() -> str:
    return (
        DEMO_SPEC.replace("[averaging]", f"round_seconds = {WINDOW_SECONDS}\n\n[averaging]")
        + "\n[node]\ncheckpoint_every_rounds = 1000\ncheckpoint_every_seconds = 1\n"
    )


def run(folder: Path, *, swarm: str, rounds: int, seed: int) -> dict[str, Any]:
    folder.mkdir(parents=True)
    spec = folder / "run.toml"
    spec.write_text(spec_text())
    profile = folder / "peers.toml"
    slowdowns = (1.0,) * len(SLOWDOWNS) if swarm == "calm" else SLOWDOWNS
    profile.write_text("".join(f"[[peer]]\nslowdown = {s}\n" for s in slowdowns))
    churn = None
    if swarm == "volunteers":
        churn = folder / "churn.toml"
        churn.write_text(CHURN.format(second=max(4, 2 * rounds // 3)))
    return simulate(
        SimulationConfig(
            nodes=len(SLOWDOWNS),
            rounds=rounds,
            spec_path=spec,
            profile_path=profile,
            churn_path=churn,
            out_dir=folder / "sim",
            seed=seed,
        )
    )


def loss_at(curve: list[dict[str, Any]], samples: float) -> float:
    """The loss on ``curve`` (points with samples and val_loss) at ``samples``, linear in log
    samples between the points around it; NaN beyond the curve."""
    points = sorted((p["samples"], p["val_loss"]) for p in curve if p["samples"] > 0)
    for (s0, l0), (s1, l1) in itertools.pairwise(points):
        if s0 <= samples <= s1:
            t = (math.log(samples) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return l0 + t * (l1 - l0)
    return math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("volunteers-loss.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="volunteers-loss-") as scratch:
        for seed in range(args.seeds):
            runs = {
                swarm: run(
                    Path(scratch) / f"{swarm}-{seed}", swarm=swarm, rounds=args.rounds, seed=seed
                )
                for swarm in ("calm", "spread", "volunteers")
            }
            busy = runs["volunteers"]
            found: dict[str, Any] = {"seed": seed}
            for swarm, summary in runs.items():
                found[swarm] = {
                    "final_loss": summary["final_val_loss"],
                    "samples": summary["loss_curve"][-1]["samples"],
                    "identical": summary["replicas_identical"],
                    "wall_seconds": summary["wall_seconds"],
                    "samples_by_peer": [p["samples"] for p in summary["peers"]],
                    "curve": [(p["samples"], p["val_loss"]) for p in summary["loss_curve"]],
                }
            for swarm in ("calm", "spread"):
                # Both read at the smaller of the two swarms' final sample counts.
                other = runs[swarm]
                at = min(busy["loss_curve"][-1]["samples"], other["loss_curve"][-1]["samples"])
                ours, theirs = loss_at(busy["loss_curve"], at), loss_at(other["loss_curve"], at)
                found[f"against_{swarm}"] = {
                    "samples": at,
                    "volunteers_loss": ours,
                    f"{swarm}_loss": theirs,
                    "gap": ours / theirs - 1,
                }
            found["events"] = [e["event"] for e in busy["churn"]["events"]]
            rows.append(found)
            print(json.dumps(found), flush=True)
    for swarm in ("calm", "spread"):
        gaps = [r[f"against_{swarm}"]["gap"] for r in rows]
        runs_text = ", ".join(f"{g:+.2%}" for g in gaps)
        print(
            f"final loss, volunteers against {swarm} at equal samples: median "
            f"{statistics.median(gaps):+.2%} (runs {runs_text})"
        )
    args.out.write_text(json.dumps(rows, indent=1))
    print(f"results in {args.out}")


if __name__ == "__main__":
    main()
