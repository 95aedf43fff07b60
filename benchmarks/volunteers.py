"""Rounds for volunteers, in the discrete-event model: the rounds main had (groups of 4, a fixed
step count, a resync drops the peer's own progress) against the new ones (one group for the
whole swarm, rounds in slots of the DHT clock, a resync keeps the peer's progress), blocking or
overlapped, for the demo model and the 1B model of ``benchmarks/des.py``, in a calm swarm and
in the volunteer scenario (``simulations/scenarios/volunteers-*.toml``: speed spread sigma 0.5,
links of 10 / 30 / 100 / 1000 Mbit/s, 30% relayed, sessions of ~20 rounds ending in crashes).

"Kept" is the share of the samples trained that are in the final model (the rounds its state
descends from: ``simulations/des/report.py``); utilization is compute / (compute + the time
it waits for rounds and state downloads).

    .venv/bin/python benchmarks/volunteers.py --peers 64              # ~2 min on 2 cores
    .venv/bin/python benchmarks/volunteers.py --peers 1000 --rules new overlapped
    .venv/bin/python benchmarks/volunteers.py --models demo --peers 64

A blocking slot is twice the old rounds' compute at the median speed (inner_steps x one step),
an overlapped one once (``rounds_spec``). Their groups are the swarm (group_size at least the
peers; the demo spec's 256 caps open runs' groups, whose evidence holds at most 256 members).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from swarmgrad.node.averaging.slots import shortest_slot
from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.training.model import parameter_count
from swarmgrad.simulations.des import whatif
from swarmgrad.simulations.des.model import ModelConfig, simulate
from swarmgrad.simulations.profiles import PeerProfile, load_profile
from swarmgrad.simulations.swarm import DEMO_SPEC

HERE = Path(__file__).resolve().parent
SCENARIOS = HERE.parent / "simulations" / "scenarios"
#: One demo inner step (one thread of this 2-core machine: ``benchmarks/des.py`` times it) and
#: one 1B step on the assumed volunteer GPU (165 TFLOPS bf16 at 40% MFU: ``benchmarks/des.py``).
DEMO_STEP_SECONDS = 0.1
CODEC_VALUES_PER_SECOND = 4e8


def one_b_spec() -> RunSpec:
    from des import ONE_B_SPEC  # benchmarks/des.py, beside this file

    return RunSpec.from_toml(ONE_B_SPEC)


def one_b_step_seconds(spec: RunSpec) -> float:
    tokens = spec.data.batch_size * spec.model.seq_len
    return 6 * parameter_count(spec.model) * tokens / (165e12 * 0.4)


#: The rules compared: main's old rounds, slots with blocking rounds, slots with overlapped ones.
RULES = ("old", "new", "overlapped")


def rounds_spec(spec: RunSpec, rules: str, peers: int, step_seconds: float) -> RunSpec:
    """``spec`` with the old rounds (groups of 4, fixed steps, resyncs drop) or the new ones:
    one group of the swarm, progress carried over two epochs, and slots of the DHT clock
    (``algorithm.round_seconds``): twice the old rounds' compute at the median speed with
    blocking rounds (the round fits in the slot beside the training), once with overlapped
    ones (the round runs beside the next slot's training), and never shorter than the spec
    allows (``slots.shortest_slot``)."""
    algorithm, averaging = spec.algorithm, spec.averaging
    if rules == "old":
        return replace(
            spec,
            algorithm=replace(algorithm, carry_epochs=0, round_seconds=0.0),
            averaging=replace(averaging, group_size=4),
        )
    overlapped = rules == "overlapped"
    slot = (1 if overlapped else 2) * algorithm.inner_steps * step_seconds
    slot = max(slot, shortest_slot())  # the spec refuses shorter ones
    return replace(
        spec,
        algorithm=replace(algorithm, carry_epochs=2, round_seconds=slot, overlap=overlapped),
        averaging=replace(averaging, group_size=max(averaging.group_size, peers)),
    )


def calm(peers: int, mbit: float) -> tuple[PeerProfile, ...]:
    rate = mbit * whatif.MBIT
    return tuple(
        PeerProfile(upload_bytes_per_second=rate, download_bytes_per_second=rate, latency_ms=20.0)
        for _ in range(peers)
    )


def volunteers(model: str, peers: int, seed: int, mbit: float | None) -> tuple[PeerProfile, ...]:
    """The scenario file's peers; ``mbit``: every link at that speed instead of the mix."""
    drawn = load_profile(SCENARIOS / f"volunteers-{model}.toml", peers, seed=seed)
    if mbit is None:
        return tuple(drawn)
    rate = mbit * whatif.MBIT
    return tuple(
        replace(p, upload_bytes_per_second=rate, download_bytes_per_second=rate, bandwidth=1.0)
        for p in drawn
    )


def row(
    spec: RunSpec,
    profiles: tuple[PeerProfile, ...],
    *,
    rounds: int,
    step_seconds: float,
    seed: int,
    **key: Any,
) -> dict[str, Any]:
    started = time.process_time()
    summary = simulate(
        ModelConfig(
            spec=spec,
            nodes=len(profiles),
            rounds=rounds,
            profiles=profiles,
            step_seconds=step_seconds,
            seed=seed,
            codec_values_per_second=CODEC_VALUES_PER_SECOND,
        )
    )
    totals = summary["totals"]
    reached = max((p["epoch"] for p in summary["peers"]), default=0)
    return {
        **key,
        "samples_kept": totals["samples_kept"],
        "utilization": totals["utilization"],
        "rounds_per_hour": 3600 * reached / summary["wall_seconds"],
        "resyncs": totals["resyncs"],
        "rounds_partial": totals["rounds_partial"],
        "rounds_lost": totals["rounds_lost"],
        "stalled": summary["stalled"],
        "cpu_s": time.process_time() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=("demo", "1b"), default=["demo", "1b"])
    parser.add_argument("--peers", nargs="+", type=int, default=[64, 1000])
    parser.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("volunteers-results.json"))
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []

    def add(found: dict[str, Any]) -> None:
        rows.append(found)
        print(json.dumps(found), flush=True)

    # The calm swarm: 200 equal peers, the demo spec, 20 rounds, its step and codec.
    demo = RunSpec.from_toml(DEMO_SPEC)
    for rules in args.rules:
        spec = rounds_spec(demo, rules, 200, 0.05)
        calm_200 = calm(200, 1000.0)
        add(row(spec, calm_200, rounds=20, step_seconds=0.05, seed=1, model="demo", peers=200,
                scenario="calm, uncapped", rules=rules))  # fmt: skip
    for model in args.models:
        spec, step = (
            (demo, DEMO_STEP_SECONDS)
            if model == "demo"
            else (one_b_spec(), one_b_step_seconds(one_b_spec()))
        )
        rounds = 20 if model == "demo" else 10
        for peers in args.peers:
            scenarios = {
                "calm, 100 Mbit/s": calm(peers, 100.0),
                "volunteers": volunteers(model, peers, args.seed, None),
                "volunteers, 100 Mbit/s": volunteers(model, peers, args.seed, 100.0),
            }
            for name, profiles in scenarios.items():
                for rules in args.rules:
                    add(row(rounds_spec(spec, rules, peers, step), profiles, rounds=rounds,
                            step_seconds=step, seed=args.seed, model=model, peers=peers,
                            scenario=name, rules=rules))  # fmt: skip
    whatif.print_table("rounds for volunteers: old rounds vs new", rows)
    args.out.write_text(json.dumps(rows, indent=1))
    print(f"results in {args.out}")


if __name__ == "__main__":
    main()
