"""Experiment tracking (``[tracking]``): each node reports its rounds to MLflow, Weights & Biases
and/or trackio, whichever the spec names and are installed; off by default.

One tracker run per node (named by its peer id, in the experiment / project named by
``tracking.project`` or the run id), with the spec's summary as parameters and, per round (the
epoch as the step): validation and training loss, tokens/s, MFU, bytes sent and received,
utilization and the round's time. MLflow writes to ``tracking.uri``, by default a file store in
the node's checkpoint folder (``mlruns/``, browsable with ``mlflow ui``). A tracker that fails
while the node runs is logged and dropped; the node trains on.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from swarmgrad.node.runspec import TrackingSection
from swarmgrad.protocol.errors import SetupError

log = logging.getLogger(__name__)


class TrackingError(SetupError):
    """A tracker named in ``[tracking]`` cannot start here; the message says why."""


class _Backend(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class _Mlflow:
    def __init__(self, uri: str, project: str, name: str, params: Mapping[str, Any]) -> None:
        import mlflow

        if uri.startswith("file:"):
            # MLflow 3 keeps its file store for local use behind this switch (a database
            # backend needs sqlalchemy, which mlflow-skinny leaves out).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(project)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self._client.create_experiment(project)
        )
        run = self._client.create_run(experiment_id, run_name=name)
        self._run_id = run.info.run_id
        for key, value in params.items():
            self._client.log_param(self._run_id, key, value)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._client.log_metric(self._run_id, key, value, step=step)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


class _Wandb:
    def __init__(self, folder: Path, project: str, name: str, params: Mapping[str, Any]) -> None:
        import wandb

        self._run = wandb.init(project=project, name=name, config=dict(params), dir=str(folder))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class _Trackio:
    def __init__(self, project: str, name: str, params: Mapping[str, Any]) -> None:
        import trackio

        self._trackio = trackio
        trackio.init(project=project, name=name, config=dict(params))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._trackio.log(dict(metrics), step=step)

    def close(self) -> None:
        self._trackio.finish()


class Tracker:
    """The node's trackers; :meth:`log_round` reports one round to each."""

    def __init__(
        self,
        section: TrackingSection,
        *,
        run_id: str,
        peer_id: str,
        folder: Path,
        params: Mapping[str, Any],
    ) -> None:
        project, name = section.project or run_id, peer_id
        self.backends: dict[str, _Backend] = {}
        for backend in section.backends:
            try:
                if backend == "mlflow":
                    uri = section.uri or (folder / "mlruns").absolute().as_uri()
                    self.backends[backend] = _Mlflow(uri, project, name, params)
                elif backend == "wandb":
                    self.backends[backend] = _Wandb(folder, project, name, params)
                else:
                    self.backends[backend] = _Trackio(project, name, params)
            except ImportError as error:
                self.close()
                raise TrackingError(
                    f"tracking.backends names {backend}, which is not installed here ({error}); "
                    f"pip install {backend}"
                ) from None
            except Exception as error:  # each library has its own errors for a bad URI or login
                self.close()
                raise TrackingError(f"tracking: {backend} did not start: {error}") from None

    def log_round(self, step: int, metrics: Mapping[str, float]) -> None:
        finite = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        for name, backend in list(self.backends.items()):
            try:
                backend.log(step, finite)
            except Exception as error:  # a tracker's outage never stops training
                log.warning("tracking: %s failed (%s); not reporting to it any more", name, error)
                del self.backends[name]

    def close(self) -> None:
        for name, backend in self.backends.items():
            try:
                backend.close()
            except Exception as error:
                log.warning("tracking: closing %s failed: %s", name, error)
        self.backends.clear()
