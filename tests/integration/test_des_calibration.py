"""The discrete-event model against real processes: the same spec and profile (every uplink capped)
through ``simulate`` (4 real nodes on loopback) and through the model, given only the real run's
own compute speed. The model must predict the round time within 25% (its least contended rounds:
see ``uncontended_round``) and the bytes each peer sends within 5%."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from swarmgrad.node.runspec import RunSpec
from swarmgrad.simulations.des import calibrate, driver
from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate

ROUNDS = 6


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_model_predicts_a_real_shaped_run(tmp_path: Path) -> None:
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(DEMO_SPEC)
    spec = RunSpec.load(spec_path)
    profile = tmp_path / "peers.toml"  # 1 MB/s uplinks: a round's bytes take about a second
    profile.write_text("[[peer]]\nupload_bytes_per_second = 1e6\n")
    real = simulate(
        SimulationConfig(
            nodes=4,
            rounds=ROUNDS,
            spec_path=spec_path,
            profile_path=profile,
            out_dir=tmp_path / "real",
            seed=1,
        )
    )
    assert real["ok"]
    # What the model is told of the real run: how long an inner step took there.
    step_seconds = calibrate.step_seconds_of(real, spec)
    modelled = driver.run(
        driver.DesConfig(
            nodes=4,
            rounds=ROUNDS,
            out_dir=tmp_path / "model",
            spec_path=spec_path,
            profile_path=profile,
            step_seconds=step_seconds,
            seed=1,
        )
    )
    assert modelled["ok"]

    def uncontended_round(summary: dict[str, object]) -> float:
        """The lower quartile of the epochs' median rounds. The model is told one compute speed
        and draws no CPU contention; on 2 cores running 4 nodes beside the other lane's tests,
        some real rounds also wait for a peer that contention slowed (epochs' medians 1.75 to
        3.54 s in one CI run, where the model said 1.67 s, and 0.65 s a step against ~0.13 s
        idle). Its least contended rounds are what the model predicts; idle, all of them are
        (within 1-2%, docs/benchmarks.md)."""
        medians = [r["median"] for r in summary["round_seconds"]]  # type: ignore[attr-defined, index]
        return statistics.quantiles(medians, n=4)[0] if len(medians) > 1 else medians[0]

    def bytes_per_peer(summary: dict[str, object]) -> float:
        return statistics.fmean(p["bytes_sent"] for p in summary["peers"])  # type: ignore[attr-defined, index]

    real_round, model_round = uncontended_round(real), uncontended_round(modelled)
    assert model_round == pytest.approx(real_round, rel=0.25), (model_round, real_round)
    real_bytes, model_bytes = bytes_per_peer(real), bytes_per_peer(modelled)
    assert model_bytes == pytest.approx(real_bytes, rel=0.05), (model_bytes, real_bytes)
