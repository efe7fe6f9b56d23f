"""A ledger in the forms people read: a text table, a chart, a JSON summary."""

from __future__ import annotations

import logging
from typing import Any

from ray_goodput.goodput._ledger import BUCKETS, Ledger
from ray_goodput.goodput._timeline import COLORS

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
    import matplotlib  # noqa: PLC0415 - optional plotting dependency, loaded only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after the backend is chosen

    fig, ax = plt.subplots(figsize=(7, 3.2))
    values = [ledger.seconds[b] for b in BUCKETS]
    ax.barh(list(BUCKETS)[::-1], values[::-1], color=[COLORS[b] for b in BUCKETS][::-1])  # as the timeline
    ax.set_xlabel("seconds")
    ax.set_title(
        f"goodput {ledger.goodput:.1%} of {ledger.total:.0f} s "
        f"({ledger.failures} failures, {ledger.steps_lost} steps lost)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(ledger: Ledger) -> dict[str, Any]:
    return {
        "goodput": ledger.goodput,
        "total_s": ledger.total,
        "seconds": ledger.seconds,
        "attempts": ledger.attempts,
        "failures": ledger.failures,
        "steps_kept": ledger.steps_kept,
        "steps_lost": ledger.steps_lost,
        "work_steps": ledger.work_steps,
        "checkpoints_superseded": ledger.checkpoints_superseded,
        "checkpoints_failed": ledger.checkpoints_failed,
        "recovery_point_age_s": ledger.recovery_point_age_s,
        "recovery_point_age_max_s": ledger.recovery_point_age_max_s,
        "checkpoint_interval_steps": ledger.checkpoint_interval_steps,
        "finished": ledger.finished,
    }
