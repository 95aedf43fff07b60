"""The discrete-event model against real processes, each node on a CPU share of its own.

For 4, 8 and 12 nodes: the demo spec through the real ``simulate`` (node processes on loopback)
and through the model (``--engine des``), with the same profile and churn schedule:

- a speed spread: slowdowns 1, 1.5 and 2 in turn (a 2x spread);
- every uplink capped (``--upload`` bytes/s; a round's bytes take about a second);
- each node's CPU held to ``--cpu`` cores over the node count (a cgroup quota each:
  ``simulations/cpushare.py``), so the real run is N machines of that speed, not N processes
  taking CPU from one another as the scheduler hands it out; the model is told the share;
- a kill and a restart: node 1 is killed at epoch 3 (SIGKILL, mid-training) and restarts at
  epoch 5 from its checkpoints.

The model is told only what the real run measured of compute: its seconds per inner step
(``calibrate.step_seconds_of``, per peer over its slowdown and share). Printed, per node count:
median round time (the median over epochs of each epoch's median), bytes sent by the median peer,
mean utilization (compute over compute and communication), samples kept (real: the share of the
samples the nodes count that they sent in rounds that averaged; model: the share in the final
model), the killed node's seconds from its restart to its first round, resyncs, how often the
median node's group was throttled (it wanted more than its share), and model / real ratios.

    .venv/bin/python benchmarks/calibration.py                  # 4, 8, 12 nodes: ~12 min
    .venv/bin/python benchmarks/calibration.py --nodes 4 --repeats 3

It needs root for the cgroups (``cpu_cores``). Run it on an otherwise idle machine: a share is a
ceiling; CPU the rest of the machine takes is not the model's to see.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from swarmgrad.node.runspec import RunSpec
from swarmgrad.simulations.des import calibrate, driver, whatif
from swarmgrad.simulations.profiles import load_profile
from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate, simulation_identity

SLOWDOWNS = (1.0, 1.5, 2.0)
CHURN = """\
[[event]]
at_epoch = 3
action = "kill"
node = 1

[[event]]
at_epoch = 5
action = "start"
node = 1
"""


def profile_text(cores: float, upload: float) -> str:
    return "".join(
        f"[[peer]]\nslowdown = {s}\nupload_bytes_per_second = {upload:g}\ncpu_cores = {cores:.4f}\n"
        for s in SLOWDOWNS
    )


def median_round(summary: dict[str, Any]) -> float:
    return statistics.median(r["median"] for r in summary["round_seconds"])


def mean_of(summary: dict[str, Any], key: str) -> float:
    return statistics.fmean(p[key] for p in summary["peers"])


def median_of(summary: dict[str, Any], key: str) -> float:
    """Over the peers: the median peer is one the churn did not touch."""
    return statistics.median(p[key] for p in summary["peers"])


def rejoin(summary: dict[str, Any]) -> float:
    seconds = summary.get("churn", {}).get("rejoin_seconds", {}).get("node-1", [])
    return seconds[0] if seconds else float("nan")


def compare(nodes: int, rounds: int, cpu: float, upload: float, work: Path, seed: int) -> dict:
    """One real run and the model's prediction of it."""
    work.mkdir(parents=True, exist_ok=True)
    spec_path, profile, churn = work / "run.toml", work / "peers.toml", work / "churn.toml"
    spec_path.write_text(DEMO_SPEC)
    cores = cpu / nodes
    profile.write_text(profile_text(cores, upload))
    churn.write_text(CHURN)
    real = simulate(
        SimulationConfig(
            nodes=nodes, rounds=rounds, spec_path=spec_path, profile_path=profile,
            churn_path=churn, out_dir=work / "real", seed=seed, timeout_seconds=1800,
        )
    )  # fmt: skip
    spec = RunSpec.load(spec_path)
    profiles = load_profile(profile, nodes, seed=seed)
    factors = {
        simulation_identity(seed, i).peer_id: p.compute_factor for i, p in enumerate(profiles)
    }
    step_seconds = calibrate.step_seconds_of(real, spec, factors)
    model = driver.run(
        driver.DesConfig(
            nodes=nodes, rounds=rounds, out_dir=work / "model", spec_path=spec_path,
            profile_path=profile, churn_path=churn, step_seconds=step_seconds, seed=seed,
        )
    )  # fmt: skip
    row: dict[str, Any] = {"nodes": nodes, "cores_each": round(cores, 3), "ok": real["ok"]}
    row["step_ms"] = round(step_seconds * 1e3, 1)
    for name, measure in (
        ("round_s", median_round),
        ("mib_sent", lambda s: median_of(s, "bytes_sent") / 2**20),
        ("utilization", lambda s: mean_of(s, "utilization")),
    ):
        row[f"real_{name}"], row[f"model_{name}"] = measure(real), measure(model)
        row[f"{name}_ratio"] = row[f"model_{name}"] / row[f"real_{name}"]
    row["real_kept"], row["model_kept"] = real["samples_kept"], model["totals"]["samples_kept"]
    row["kept_ratio"] = row["model_kept"] / max(row["real_kept"], 1e-9)
    row["real_rejoin_s"], row["model_rejoin_s"] = rejoin(real), rejoin(model)
    row["throttled"] = statistics.median(real.get("cpu_throttled", {}).values() or [0.0])
    row["real_resyncs"] = sum(p["outcomes"].get("resynced", 0) for p in real["peers"])
    row["model_resyncs"] = model["totals"]["resyncs"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 8, 12])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--cpu", type=float, default=1.6, help="cores shared by the nodes")
    parser.add_argument("--upload", type=float, default=1e6, help="uplink cap, bytes/s")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("calibration-results.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="calibration-"))
    rows = []
    for nodes in args.nodes:
        for repeat in range(args.repeats):
            where = work / f"n{nodes}-{repeat}"
            rows.append(compare(nodes, args.rounds, args.cpu, args.upload, where, args.seed))
            whatif.print_table("real processes (CPU shares) vs the model", rows[-1:])
    whatif.print_table("real processes (CPU shares) vs the model", rows)
    args.out.write_text(json.dumps(rows, indent=1))
    print(f"results in {args.out} (runs under {work})")


if __name__ == "__main__":
    main()
