"""MLflow metrics for a Ray Train run: one MLflow run per Ray Train run, found again after restarts."""

from __future__ import annotations

import os
import time

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

RUN_TAG = "ray_resilient.run"


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else a local SQLite store in ``~/.ray_resilient``."""
    configured = os.environ.get("MLFLOW_TRACKING_URI")
    if configured:
        return configured
    directory = os.path.expanduser("~/.ray_resilient")
    os.makedirs(directory, exist_ok=True)
    return f"sqlite:///{directory}/mlflow.db"


def current_run_name() -> str:
    """The Ray Train run's name inside a train function, else ``"ray_resilient"``."""
    try:
        import ray.train

        return ray.train.get_context().get_experiment_name()
    except (RuntimeError, ValueError):
        return "ray_resilient"


class MlflowMetrics:
    """Logs metric dicts to the MLflow run of ``run_name`` (created on first use, reused after).

    Every attempt of a Ray Train run (restarts, a re-run driver) finds the same MLflow run by
    its tag, so a run's curves continue across failures.
    """

    def __init__(self, run_name: str, tracking_uri: str | None = None, experiment: str = "ray_resilient",
                 prefix: str = ""):
        self.client = MlflowClient(tracking_uri or default_tracking_uri())
        self.prefix = prefix
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        runs = self.client.search_runs([experiment_id], f"tags.`{RUN_TAG}` = '{run_name}'", max_results=1)
        if runs:
            self.run_id = runs[0].info.run_id
        else:
            self.run_id = self.client.create_run(experiment_id, tags={RUN_TAG: run_name}, run_name=run_name).info.run_id

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(f"{self.prefix}{key}", float(value), now, step) for key, value in metrics.items()])
