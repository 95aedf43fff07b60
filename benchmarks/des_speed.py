"""How fast the discrete-event model runs, in the configurations issue 44 names: the demo spec's
defaults (no profile) and the volunteer scenario (``simulations/scenarios/volunteers-demo.toml``),
N peers x R rounds, timed in process CPU seconds (the model alone: its inputs are fixed, not
measured here, so runs repeat exactly on any machine).

Each row also prints a digest of the run's summary: a speed-up of the model must leave it
unchanged (same seed, same summary). Compare two checkouts by running this in each.

    .venv/bin/python benchmarks/des_speed.py      # demo defaults 1,000 x 20, volunteers 200 x 20
    .venv/bin/python benchmarks/des_speed.py --runs demo:1000x100 volunteers:1000x100
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarmgrad.simulations.des.driver import load_spec  # noqa: E402
from swarmgrad.simulations.des.model import ModelConfig, simulate  # noqa: E402
from swarmgrad.simulations.profiles import load_profile  # noqa: E402

SCENARIO = ROOT / "simulations" / "scenarios" / "volunteers-demo.toml"
STEP_SECONDS = 0.05  # the demo model's inner step (what ``simulate`` times on a 2-core machine)
CODEC_RATE = 1e9  # values/s: the codec's time left out (it is measured, and differs by machine)


def run(peers: int, rounds: int, scenario: bool, seed: int) -> dict[str, object]:
    spec = load_spec(None)
    profiles = load_profile(SCENARIO if scenario else None, peers, seed=seed)
    config = ModelConfig(
        spec=spec,
        nodes=peers,
        rounds=rounds,
        profiles=tuple(profiles),
        step_seconds=STEP_SECONDS,
        seed=seed,
        codec_values_per_second=CODEC_RATE,
    )
    started = time.process_time()
    summary = simulate(config)
    cpu = time.process_time() - started
    text = json.dumps(summary, sort_keys=True, default=str)
    return {
        "config": f"{'volunteers' if scenario else 'demo defaults'}, {peers:,} x {rounds}",
        "cpu_seconds": round(cpu, 2),
        "peer_rounds_per_cpu_second": round(peers * rounds / cpu),
        "samples_kept": summary["totals"]["samples_kept"],
        "digest": hashlib.sha256(text.encode()).hexdigest()[:16],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["demo:1000x20", "volunteers:200x20"],
        help="demo|volunteers:PEERSxROUNDS",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("des-speed-results.json"))
    args = parser.parse_args()
    rows = []
    for item in args.runs:
        kind, _, size = item.lower().partition(":")
        if kind not in ("demo", "volunteers") or "x" not in size:
            parser.error(f"--runs: {item!r} is not demo|volunteers:PEERSxROUNDS")
        peers, rounds = (int(part) for part in size.split("x"))
        row = run(peers, rounds, kind == "volunteers", args.seed)
        rows.append(row)
        print(
            f"{row['config']:>30}: {row['cpu_seconds']:7.2f} s CPU, "
            f"{row['peer_rounds_per_cpu_second']:>7,} peer-rounds/s, kept "
            f"{row['samples_kept']:.1%}, summary {row['digest']}",
            flush=True,
        )
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
