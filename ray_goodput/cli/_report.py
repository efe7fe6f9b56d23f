"""``ray-goodput report``: the goodput breakdown of a finished run, read from MLflow."""

from __future__ import annotations

import argparse
import sys

import mlflow

from ray_goodput.errors import ConfigError
from ray_goodput.goodput import BUCKETS


def _out(line: str = "") -> None:
    sys.stdout.write(line + "\n")


def _quoted(value: str) -> str:
    """``value`` as a string literal of MLflow's search filter (which has no escapes)."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise ConfigError(
        f"run name {value!r} has both quote characters, which MLflow's search cannot match; rename the run"
    )


def cmd_report(args: argparse.Namespace) -> int:
    client = mlflow.MlflowClient(tracking_uri=args.tracking_uri)
    exp = client.get_experiment_by_name(args.experiment)
    runs = (
        client.search_runs(
            [exp.experiment_id],
            filter_string=f"tags.mlflow.runName = {_quoted(args.run)}",
            order_by=["attributes.start_time DESC"],
        )
        if exp
        else []
    )
    if not runs:
        _out(f"no MLflow run named {args.run!r} in experiment {args.experiment!r} at {args.tracking_uri}")
        return 2
    m = runs[0].data.metrics
    total = m.get("goodput/total_s", 0.0) or 1.0
    _out(
        f"run {args.run} ({runs[0].info.status}): goodput {m.get('goodput/goodput', 0):.1%} "
        f"of {m.get('goodput/total_s', 0):.1f}s, {m.get('goodput/failures', 0):.0f} failure(s), "
        f"{m.get('goodput/steps_lost', 0):.0f} steps lost"
    )
    _out(f"{'BUCKET':<18}{'SECONDS':>10}{'SHARE':>9}")
    for bucket in BUCKETS:
        value = m.get(f"goodput/{bucket}_s", 0.0)
        _out(f"{bucket:<18}{value:>10.1f}{value / total:>9.1%}")
    return 0
