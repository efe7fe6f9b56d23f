"""Publishing a goodput ledger: one MLflow run per job, and Ray metrics for the dashboard."""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from ray.util import metrics

from ray_goodput.goodput import Ledger, chart_png, timeline_png

logger = logging.getLogger(__name__)
_FAILURE_TAG = re.compile(r"^failure_(\d+)$")


def _artifacts_beside(tracking_uri: str) -> str | None:
    """For a sqlite store, ``<db dir>/mlartifacts`` (MLflow's default is ``./mlruns`` of
    whichever process creates the experiment — here the Ray Train controller)."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    return (Path(tracking_uri[len(prefix) :]).parent / "mlartifacts").as_uri()


class MlflowSink:
    """One MLflow run per job; it stays open across worker-group restarts. ``resume``: the
    job's run, opened by an earlier ``fit()`` of the job (replica mode runs it again when
    Ray's controller ended the run): the run goes on, RUNNING again, its ``failure_<n>``
    tags numbered on from the highest. A new run is made when it is not a live run of this
    store's experiment; an MLflow error other than "no such run" is raised."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, resume: str | None = None) -> None:
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
        self._failures_before = 0  # failure tags of the job's earlier fit() runs
        run_id = self._resumed(exp_id, resume) if resume else None
        if run_id is None:
            run_id = self._client.create_run(exp_id, run_name=run_name, tags={"ray_goodput": "goodput"}).info.run_id
        self.run_id: str = run_id

    def _resumed(self, exp_id: str, run_id: str) -> str | None:
        """``run_id``, RUNNING again, when it is a live run of experiment ``exp_id``."""
        from mlflow.exceptions import MlflowException  # noqa: PLC0415 - loaded with MLflow, above

        try:
            run = self._client.get_run(run_id)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":  # deleted for good
                return None
            raise  # the store failed for a moment: the next MLflow call opens the run again
        if run.info.experiment_id != exp_id or run.info.lifecycle_stage != "active":
            return None
        if run.info.status != "RUNNING":
            self._client.update_run(run_id, status="RUNNING")
        numbers = [int(m.group(1)) for key in run.data.tags if (m := _FAILURE_TAG.match(key))]
        self._failures_before = max(numbers, default=0)  # past a tag that was not written too
        logger.info("goodput MLflow run %s goes on (%d failures before)", run_id, self._failures_before)
        return run_id

    def open(self) -> None:
        """Nothing: the run is open once this sink is made (queued to open it early)."""

    def flush(self) -> None:
        """Nothing: queued behind earlier calls, it says when they have run."""

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self._client.log_metric(self.run_id, key, float(value), step=step)

    def log_failure(self, count: int, message: str) -> None:
        """``count``: this ``fit()``'s; the tag goes on from the job's earlier ones."""
        self._client.set_tag(self.run_id, f"failure_{self._failures_before + count}", message[:4000])

    def fail(self) -> None:
        """The run ended with an error: FAILED (a ``fit()`` run again for the job resumes it)."""
        self._client.set_terminated(self.run_id, "FAILED")

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
