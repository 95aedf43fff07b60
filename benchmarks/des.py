"""The discrete-event model: how fast it runs, and what it says (what-if tables).

0. Calibration: the demo spec with every uplink capped (1 MB/s; 4 MB/s for 8 nodes) through the
   real ``simulate`` (N node processes on loopback) and through the model, given the real run's
   own seconds per inner step: predicted vs measured median round time and bytes sent per peer.
1. Speed: N peers x R rounds with heterogeneity (compute speeds log-normal sigma 0.25; links of
   10, 50, 100 and 1000 Mbit/s; 30% relayed) and churn (sessions of about 20 rounds, back five
   rounds later), timed in process CPU seconds; reported as peers x rounds per second (targets:
   1,000 x 100 in < 60 s; 10,000 x 100 in < 10 min, with ``--big``).
2. What-if tables (``simulations/des/whatif.py``) for the demo model (one inner step timed on this
   CPU, one thread, as ``simulate``'s nodes run) and a ~1B-parameter GPT (d 2048, 18 layers,
   vocab 32k, seq 1024, batch 8, 500 inner steps), whose step time comes from an assumed
   volunteer GPU: ``--gpu-tflops`` (bf16 dense peak, default 165: an RTX 4090) at ``--mfu``
   (default 0.4): 6 x params x tokens per step / (peak x MFU).

    .venv/bin/python benchmarks/des.py                 # ~5 min on 2 cores
    .venv/bin/python benchmarks/des.py --big           # + 10,000 peers x 100 rounds
    .venv/bin/python benchmarks/des.py --sections 1b --codec sparse --codec-option bits=2

``--codec`` (with ``--codec-option KEY=VALUE``) sets both specs' ``[averaging]`` codec: the
model's bytes per round are the codec's own payloads (``simulations/des/traffic.py``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.training.model import parameter_count
from swarmgrad.simulations.des import calibrate, driver, whatif
from swarmgrad.simulations.des.model import ModelConfig, simulate
from swarmgrad.simulations.profiles import PeerProfile
from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig
from swarmgrad.simulations.swarm import simulate as run_processes

SECTIONS = ("calibration", "speed", "demo", "1b")

ONE_B_SPEC = """\
[run]
id = "whatif-1b"

[model]
vocab_size = 32000
d_model = 2048
n_layers = 18
n_heads = 16
seq_len = 1024

[data]
batch_size = 8

[algorithm]
name = "diloco"
inner_steps = 500

[averaging]
codec = "int8"
group_size = 4
matchmaking_timeout_seconds = 120.0
round_timeout_seconds = 600.0
sender_timeout_seconds = 60.0
reducer_timeout_seconds = 120.0
"""


def speed(peers: int, rounds: int, spec: RunSpec, step_seconds: float, seed: int) -> dict[str, Any]:
    """One heterogeneous, churning swarm, timed in CPU seconds."""
    rng = random.Random(seed)
    compute_round = spec.algorithm.inner_steps * step_seconds
    profiles = tuple(
        PeerProfile(
            slowdown=rng.lognormvariate(0.0, 0.25),
            upload_bytes_per_second=(mbit := rng.choice([10, 50, 100, 1000])) * whatif.MBIT,
            download_bytes_per_second=mbit * whatif.MBIT,
            latency_ms=rng.uniform(5.0, 60.0),
            nat="relayed" if rng.random() < 0.3 else "direct",
            session_seconds=20 * 2 * compute_round,
            offline_seconds=5 * 2 * compute_round,
        )
        for _ in range(peers)
    )
    started = time.process_time()
    summary = simulate(
        ModelConfig(
            spec=spec,
            nodes=peers,
            rounds=rounds,
            profiles=profiles,
            step_seconds=step_seconds,
            seed=seed,
        )
    )
    cpu = time.process_time() - started
    totals = summary["totals"]
    return {
        "peers": peers,
        "rounds": rounds,
        "cpu_seconds": cpu,
        "peer_rounds_per_second": peers * rounds / cpu,
        "simulated_seconds": summary["wall_seconds"],
        "ok": summary["ok"],
        "utilization": totals["utilization"],
        "samples_kept": totals["samples_kept"],
        "rounds_lost": totals["rounds_lost"],
        "rounds_partial": totals["rounds_partial"],
        "resyncs": totals["resyncs"],
    }


def calibration(nodes: int, upload: float, work: Path, seed: int) -> dict[str, Any]:
    """One real shaped run and the model's prediction of it."""
    work.mkdir(parents=True, exist_ok=True)
    spec_path, profile = work / "run.toml", work / "peers.toml"
    spec_path.write_text(DEMO_SPEC)
    profile.write_text(f"[[peer]]\nupload_bytes_per_second = {upload}\n")
    rounds = 8
    real = run_processes(
        SimulationConfig(
            nodes=nodes, rounds=rounds, spec_path=spec_path, profile_path=profile,
            out_dir=work / "real", seed=seed,
        )
    )  # fmt: skip
    spec = RunSpec.load(spec_path)
    step_seconds = calibrate.step_seconds_of(real, spec)
    model = driver.run(
        driver.DesConfig(
            nodes=nodes, rounds=rounds, out_dir=work / "model", spec_path=spec_path,
            profile_path=profile, step_seconds=step_seconds, seed=seed,
        )
    )  # fmt: skip

    def median_round(summary: dict[str, Any]) -> float:
        return statistics.median(r["median"] for r in summary["round_seconds"])

    def sent(summary: dict[str, Any]) -> float:
        return statistics.fmean(p["bytes_sent"] for p in summary["peers"])

    return {
        "nodes": nodes,
        "upload_mb_s": upload / 1e6,
        "real_round_s": median_round(real),
        "model_round_s": median_round(model),
        "round_ratio": median_round(model) / median_round(real),
        "real_mib_sent": sent(real) / 2**20,
        "model_mib_sent": sent(model) / 2**20,
        "bytes_ratio": sent(model) / sent(real),
        "real_resyncs": sum(p["outcomes"].get("resynced", 0) for p in real["peers"]),
        "model_resyncs": model["totals"]["resyncs"],
    }


def tables(name: str, scenario: whatif.Scenario) -> dict[str, list[dict[str, Any]]]:
    out = {
        "bandwidth_by_group_size": whatif.bandwidth_by_group_size(scenario),
        "inner_steps_for_90": whatif.inner_steps_for(scenario),
        "speed_spread": whatif.speed_spread(scenario),
        "churn_and_relays": whatif.churn_and_relays(scenario),
    }
    for title, rows in out.items():
        whatif.print_table(f"{name}: {title.replace('_', ' ')}", rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--big", action="store_true", help="also 10,000 peers x 100 rounds")
    parser.add_argument("--peers", type=int, default=64, help="swarm size of the what-if tables")
    parser.add_argument("--rounds", type=int, default=20, help="rounds per what-if row")
    parser.add_argument("--gpu-tflops", type=float, default=165.0)
    parser.add_argument("--mfu", type=float, default=0.4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-calibration", action="store_true", help="skip the real runs")
    parser.add_argument("--out", type=Path, default=Path("des-results.json"))
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--codec", help="the specs' averaging codec (default: theirs, int8)")
    parser.add_argument("--codec-option", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()

    demo = with_codec(DEMO_SPEC, args.codec, args.codec_option)
    demo_step = calibrate.step_seconds(demo)
    big = with_codec(ONE_B_SPEC, args.codec, args.codec_option)
    params = parameter_count(big.model)
    tokens = big.data.batch_size * big.model.seq_len
    big_step = 6 * params * tokens / (args.gpu_tflops * 1e12 * args.mfu)
    demo_params = parameter_count(demo.model)
    print(f"demo: {demo_params:,} params, one inner step {demo_step * 1e3:.1f} ms here")
    print(f"1B: {params:,} params, one inner step {big_step:.2f} s on the assumed GPU")
    print(f"codec: {big.averaging.codec} {big.averaging.codec_options or ''}")

    results: dict[str, Any] = {
        "codec": big.averaging.codec,
        "codec_options": big.averaging.codec_options,
    }
    if "calibration" in args.sections and not args.no_calibration:
        work = Path(tempfile.mkdtemp(prefix="des-calibration-"))
        results["calibration"] = [
            calibration(4, 1e6, work / "n4", args.seed),
            calibration(8, 4e6, work / "n8", args.seed),
        ]
        whatif.print_table("calibration: real processes vs the model", results["calibration"])

    if "speed" in args.sections:
        runs = [(1000, 100)] + ([(10_000, 100)] if args.big else [])
        speeds = [speed(n, r, demo, demo_step, args.seed) for n, r in runs]
        whatif.print_table("model speed (CPU seconds, heterogeneity and churn)", speeds)
        results["speed"] = speeds
        median = statistics.median(s["peer_rounds_per_second"] for s in speeds)
        print(f"model speed: {median:,.0f} peer-rounds per CPU second")
    results["demo_step_seconds"] = demo_step
    if "demo" in args.sections:
        results["demo"] = tables(
            "demo model", whatif.Scenario(spec=demo, step_seconds=demo_step, peers=args.peers,
                                          rounds=args.rounds, seed=args.seed),
        )  # fmt: skip
    if "1b" in args.sections:
        results["1b"] = tables(
            "1B model", whatif.Scenario(spec=big, step_seconds=big_step, peers=args.peers,
                                        rounds=min(args.rounds, 10), seed=args.seed),
        )  # fmt: skip
    results["1b_step_seconds"] = big_step
    results["assumptions"] = {"gpu_tflops": args.gpu_tflops, "mfu": args.mfu}
    args.out.write_text(json.dumps(results, indent=1))
    print(f"results in {args.out}")


def with_codec(text: str, codec: str | None, options: list[str]) -> RunSpec:
    """The spec of ``text`` (whose codec is int8) with another averaging codec and its options
    (``KEY=VALUE``), checked as any spec is."""
    if codec is None:
        if options:
            raise SystemExit("--codec-option needs --codec")
        return RunSpec.from_toml(text)
    pairs = []
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key.isidentifier():
            raise SystemExit(f"--codec-option {option!r}: expected KEY=VALUE")
        pairs.append(f"{key} = {float(value)!r}")
    chosen = f"codec = {json.dumps(codec)}" + (
        f"\ncodec_options = {{ {', '.join(pairs)} }}" if pairs else ""
    )
    assert 'codec = "int8"' in text
    return RunSpec.from_toml(text.replace('codec = "int8"', chosen, 1))


if __name__ == "__main__":
    main()
