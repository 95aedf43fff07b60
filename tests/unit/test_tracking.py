"""``[tracking]``: a node's rounds reach MLflow (a local file store by default); a tracker that is
not installed is a clear set-up error; one that fails mid-run is dropped, training goes on."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest

from swarmgrad.node.runspec import RunSpec, RunSpecError, TrackingSection
from swarmgrad.node.tracking import Tracker, TrackingError


def test_rounds_reach_an_mlflow_file_store_in_the_checkpoint_folder(tmp_path: Path) -> None:
    tracker = Tracker(
        TrackingSection(backends=("mlflow",)),
        run_id="demo",
        peer_id="sgpeer",
        folder=tmp_path,
        params={"codec": "int8", "inner_steps": 10},
    )
    tracker.log_round(1, {"val_loss": 5.5, "tokens_per_second": 1000.0, "mfu": float("nan")})
    tracker.log_round(2, {"val_loss": 5.0, "tokens_per_second": 1100.0, "mfu": float("nan")})
    tracker.close()
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("demo")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "sgpeer"
    assert run.data.params == {"codec": "int8", "inner_steps": "10"}
    history = client.get_metric_history(run.info.run_id, "val_loss")
    assert [(m.step, m.value) for m in history] == [(1, 5.5), (2, 5.0)]
    assert client.get_metric_history(run.info.run_id, "mfu") == []  # NaN is not reported
    assert run.info.status == "FINISHED"


def test_a_tracker_that_is_not_installed_is_named(tmp_path: Path) -> None:
    with pytest.raises(TrackingError, match="names trackio, which is not installed here"):
        Tracker(
            TrackingSection(backends=("trackio",)),
            run_id="demo",
            peer_id="p",
            folder=tmp_path,
            params={},
        )


def test_a_failing_tracker_is_dropped_and_the_others_go_on(tmp_path: Path) -> None:
    tracker = Tracker(
        TrackingSection(backends=("mlflow",)), run_id="r", peer_id="p", folder=tmp_path, params={}
    )

    class Broken:
        def log(self, step: int, metrics: object) -> None:
            raise ConnectionError("tracker offline")

        def close(self) -> None:
            pass

    tracker.backends["broken"] = Broken()
    tracker.log_round(1, {"val_loss": 1.0})
    assert set(tracker.backends) == {"mlflow"}
    tracker.close()


def test_tracking_is_off_by_default_operational_and_checked() -> None:
    spec = RunSpec.from_toml('[run]\nid = "x"\n')
    assert spec.tracking.backends == ()
    tracked = RunSpec.from_toml('[run]\nid = "x"\n[tracking]\nbackends = ["mlflow"]\n')
    assert tracked.hash == spec.hash  # where a node reports is its own business
    with pytest.raises(RunSpecError, match=r"tracking\.backends: unknown tensorboard"):
        RunSpec.from_toml('[run]\nid = "x"\n[tracking]\nbackends = ["tensorboard"]\n')
