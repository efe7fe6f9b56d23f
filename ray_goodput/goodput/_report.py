"""Publishing a ledger: MLflow run (metrics, summary, chart), Ray metrics, text table."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any

from ray_goodput.goodput._ledger import BUCKETS, Ledger

logger = logging.getLogger(__name__)


def table(ledger: Ledger) -> str:
    """A markdown table of the buckets with seconds and shares."""
    total = ledger.total or 1.0
    rows = ["| bucket | seconds | share |", "|---|---:|---:|"]
    rows += [f"| {b} | {ledger.seconds[b]:.1f} | {ledger.seconds[b] / total:.1%} |" for b in BUCKETS]
    rows.append(f"| **total** | {ledger.total:.1f} | goodput {ledger.goodput:.1%} |")
    return "\n".join(rows)


def chart_png(ledger: Ledger, path: str) -> None:
    """A horizontal bar chart of the breakdown."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 3.2))
    values = [ledger.seconds[b] for b in BUCKETS]
    colors = ["#2ca02c"] + ["#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"]
    ax.barh(list(BUCKETS)[::-1], values[::-1], color=colors[::-1])
    ax.set_xlabel("seconds")
    ax.set_title(f"goodput {ledger.goodput:.1%} of {ledger.total:.0f} s "
                 f"({ledger.failures} failures, {ledger.steps_lost} steps lost)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(ledger: Ledger) -> dict[str, Any]:
    return {"goodput": ledger.goodput, "total_s": ledger.total, "seconds": ledger.seconds,
            "attempts": ledger.attempts, "failures": ledger.failures,
            "steps_kept": ledger.steps_kept, "steps_lost": ledger.steps_lost,
            "finished": ledger.finished}


class MlflowSink:
    """One MLflow run per job; it stays open across worker-group restarts."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str) -> None:
        import mlflow  # noqa: PLC0415

        self._client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        exp = self._client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else self._client.create_experiment(experiment)
        self.run_id = self._client.create_run(exp_id, run_name=run_name,
                                              tags={"ray_goodput": "goodput"}).info.run_id

    def log(self, ledger: Ledger, step: int) -> None:
        for key, value in ledger.as_metrics().items():
            self._client.log_metric(self.run_id, key, float(value), step=step)

    def log_failure(self, count: int, message: str) -> None:
        self._client.set_tag(self.run_id, f"failure_{count}", message[:4000])

    def finish(self, ledger: Ledger, step: int) -> None:
        self.log(ledger, step)
        with tempfile.TemporaryDirectory() as tmp:
            chart = os.path.join(tmp, "goodput_breakdown.png")
            chart_png(ledger, chart)
            self._client.log_artifact(self.run_id, chart)
            path = os.path.join(tmp, "goodput_summary.json")
            with open(path, "w") as f:
                json.dump(summary(ledger), f, indent=1)
            self._client.log_artifact(self.run_id, path)
        self._client.set_terminated(self.run_id, "FINISHED")


class RayGauges:
    """Live values for the Ray dashboard: goodput ratio and seconds per bucket."""

    def __init__(self, run_name: str) -> None:
        from ray.util import metrics  # noqa: PLC0415

        self._tags = {"run": run_name}
        self._ratio = metrics.Gauge("ray_goodput_goodput_ratio", "kept productive time / wall time", ("run",))
        self._seconds = metrics.Gauge("ray_goodput_ledger_seconds", "seconds per ledger bucket", ("run", "bucket"))

    def set(self, ledger: Ledger) -> None:
        self._ratio.set(ledger.goodput, tags=self._tags)
        for bucket, value in ledger.seconds.items():
            self._seconds.set(value, tags={**self._tags, "bucket": bucket})
