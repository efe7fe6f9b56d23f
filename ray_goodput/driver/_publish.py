"""Publishing a goodput ledger: one MLflow run per job, and Ray metrics for the dashboard."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from ray.util import metrics

from ray_goodput.goodput import Ledger, chart_png, timeline_png

logger = logging.getLogger(__name__)


def _artifacts_beside(tracking_uri: str) -> str | None:
    """For a sqlite store, ``<db dir>/mlartifacts`` (MLflow's default is ``./mlruns`` of
    whichever process creates the experiment — here the Ray Train controller)."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    return (Path(tracking_uri[len(prefix) :]).parent / "mlartifacts").as_uri()


class MlflowSink:
    """One MLflow run per job; it stays open across worker-group restarts."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str) -> None:
        # Slow to import: loaded by the controller that publishes, not by every worker
        # process that imports this package to unpickle a training function. matplotlib
        # too: the charts at the run's end need it, and loading it here, in this background
        # thread at the start, keeps it out of the run's tail (fit() returns after the
        # charts); before the run is created, so a failed import leaves no empty run behind.
        import matplotlib  # noqa: PLC0415 - see above
        from mlflow import MlflowClient  # noqa: PLC0415 - see above

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: PLC0415 - see above

        self._client = MlflowClient(tracking_uri=tracking_uri)
        exp = self._client.get_experiment_by_name(experiment)
        exp_id = (
            exp.experiment_id
            if exp
            else self._client.create_experiment(experiment, artifact_location=_artifacts_beside(tracking_uri))
        )
        self.run_id = self._client.create_run(exp_id, run_name=run_name, tags={"ray_goodput": "goodput"}).info.run_id

    def flush(self) -> None:
        """Nothing: queued behind earlier calls, it says when they have run (the run is open)."""

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self._client.log_metric(self.run_id, key, float(value), step=step)

    def log_failure(self, count: int, message: str) -> None:
        self._client.set_tag(self.run_id, f"failure_{count}", message[:4000])

    def tag(self, key: str, value: str) -> None:
        self._client.set_tag(self.run_id, key, value[:4000])

    def finish(
        self,
        ledger: Ledger,
        step: int,
        summary: dict[str, Any],
        attempts: list[list[dict[str, Any]]],
        notes: dict[int, str],
    ) -> None:
        """Last metrics, the bar chart, the timeline and the summary; the run ends FINISHED."""
        self.log(ledger.as_metrics(), step)
        with tempfile.TemporaryDirectory() as tmp:
            chart = os.path.join(tmp, "goodput_breakdown.png")
            chart_png(ledger, chart)
            self._client.log_artifact(self.run_id, chart)
            timeline = os.path.join(tmp, "goodput_timeline.png")
            timeline_png(attempts, timeline, job_start=ledger.start, notes=notes)
            self._client.log_artifact(self.run_id, timeline)
            path = os.path.join(tmp, "goodput_summary.json")
            with open(path, "w") as f:
                json.dump(summary, f, indent=1)
            self._client.log_artifact(self.run_id, path)
        self._client.set_terminated(self.run_id, "FINISHED")


class RayGauges:
    """Live values for the Ray dashboard: goodput ratio and seconds per bucket."""

    def __init__(self, run_name: str) -> None:
        self._tags = {"run": run_name}
        self._ratio = metrics.Gauge("ray_goodput_goodput_ratio", "kept productive time / wall time", ("run",))
        self._seconds = metrics.Gauge("ray_goodput_ledger_seconds", "seconds per ledger bucket", ("run", "bucket"))

    def set(self, ledger: Ledger) -> None:
        self._ratio.set(ledger.goodput, tags=self._tags)
        for bucket, value in ledger.seconds.items():
            self._seconds.set(value, tags={**self._tags, "bucket": bucket})
