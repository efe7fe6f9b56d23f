"""Test utilities: real multi-process gloo worlds, real process-killing fault injection,
a faulty HTTP proxy, bounded waits, and the chaos soak's oracle (what storage holds, and
the invariants a run interrupted by failures must keep).

Shipped with the library so users can test their own training loops the same way.
"""

from ray_goodput.testing._faults import FailAt, kill_self
from ray_goodput.testing._flaky_proxy import FlakyProxy
from ray_goodput.testing._net import free_port
from ray_goodput.testing._soak_oracle import (
    ReferenceRun,
    StorageScan,
    check_data,
    check_kept,
    check_no_rot,
    check_restore,
    judge_run,
    kept_steps,
    read_outcome,
    scan_storage,
)
from ray_goodput.testing._wait import publish_file, wait_for, wait_for_file
from ray_goodput.testing._world import run_world

__all__ = [
    "FailAt",
    "FlakyProxy",
    "ReferenceRun",
    "StorageScan",
    "check_data",
    "check_kept",
    "check_no_rot",
    "check_restore",
    "free_port",
    "judge_run",
    "kept_steps",
    "kill_self",
    "publish_file",
    "read_outcome",
    "run_world",
    "scan_storage",
    "wait_for",
    "wait_for_file",
]
