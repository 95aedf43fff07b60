"""``simulate --launcher ray``: the same swarm, its processes started by Ray actors on a (local)
Ray head, gives the local launcher's result: the same peers, as much learned, identical replicas."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmgrad.simulations.profiles import SimulationError
from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate
from tests.helpers import light


@pytest.mark.timeout(300)  # ~85 s on a 2-core machine: room for a slower one
def test_a_ray_launched_swarm_matches_the_local_launchers_summary(tmp_path: Path) -> None:
    # ``light``: what is compared is where the processes run, not the model.
    spec = tmp_path / "run.toml"
    spec.write_text(light(DEMO_SPEC))
    results = {}
    for launcher in ("local", "ray"):
        results[launcher] = simulate(
            SimulationConfig(
                nodes=4,
                rounds=3,
                spec_path=spec,
                out_dir=tmp_path / launcher,
                seed=7,
                launcher=launcher,
            )
        )
    local, ray = results["local"], results["ray"]
    for summary in (local, ray):
        assert summary["ok"]
        assert summary["replicas_identical"]
        assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.5
    # The same seeded peers, the same data: the same training, within a round's timing.
    assert sorted(p["peer_id"] for p in ray["peers"]) == sorted(
        p["peer_id"] for p in local["peers"]
    )
    assert ray["initial_val_loss"] == local["initial_val_loss"]
    # How many samples a round gathers depends on the peers' timing (Ray starts them later and
    # slower), so the final losses differ by a few percent; what each launcher's swarm learned
    # must be alike: the loss falls by as much, within a quarter.
    learned = {k: s["initial_val_loss"] - s["final_val_loss"] for k, s in results.items()}
    assert learned["ray"] == pytest.approx(learned["local"], rel=0.25)
    assert (tmp_path / "ray" / "node-0.log").read_text().count("epoch 3") >= 1


def test_the_launcher_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(SimulationError, match="--launcher must be one of local, ray"):
        SimulationConfig(nodes=2, rounds=1, out_dir=tmp_path, launcher="ssh")
    with pytest.raises(SimulationError, match="--ray-address goes with --launcher ray"):
        SimulationConfig(nodes=2, rounds=1, out_dir=tmp_path, ray_address="10.0.0.1:6379")
    with pytest.raises(SimulationError, match="--netem shapes this machine's namespaces"):
        SimulationConfig(nodes=2, rounds=1, out_dir=tmp_path, launcher="ray", netem=True)
