"""Planning checkpoints: failure odds, the optimal interval, expected and simulated goodput.

Pure Python (no Ray, no torch): usable from the CLI, a notebook or the Checkpointer.
"""

from ray_goodput.plan._auto import AutoInterval
from ray_goodput.plan._formulas import (
    afr_from_mtbf,
    expected_buckets,
    expected_goodput,
    expected_lost_s,
    failure_probability,
    interval_steps,
    mtbf_hours,
    optimal_interval_s,
    young_interval_s,
)
from ray_goodput.plan._simulate import DEFAULT_SYSTEMS, Outcome, System, replay, simulate

__all__ = [
    "DEFAULT_SYSTEMS",
    "AutoInterval",
    "Outcome",
    "System",
    "afr_from_mtbf",
    "expected_buckets",
    "expected_goodput",
    "expected_lost_s",
    "failure_probability",
    "interval_steps",
    "mtbf_hours",
    "optimal_interval_s",
    "replay",
    "simulate",
    "young_interval_s",
]
