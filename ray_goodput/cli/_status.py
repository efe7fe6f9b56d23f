"""``ray-goodput status``: what each node's uploader and cache are doing, one line each; with
``--run``, what the run's Recovery decided and how its checkpoints stand."""

from __future__ import annotations

import argparse
import logging
import sys
import time

import ray

from ray_goodput.checkpoint import uploader_status
from ray_goodput.data import cache_status
from ray_goodput.driver import load_state
from ray_goodput.goodput import compute, read_events
from ray_goodput.storage import resolve

logger = logging.getLogger(__name__)


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def status_lines(address: str = "auto") -> list[str]:
    """Human-readable lines for every node's uploader and cache."""
    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    lines = ["uploaders:"]
    uploaders = uploader_status()
    lines += ["  (none running)"] if not uploaders else []
    for s in uploaders:
        if "error" in s:
            lines.append(f"  node {s['node_id'][:12]}  ERROR {s['error']}")
            continue
        lines.append(
            f"  node {s['node_id'][:12]}  queue {s['queue']}  pending {_mb(s['bytes_pending'])}"
            f"  uploaded {_mb(s['bytes_uploaded'])}  {s['throughput_mb_s']:.1f} MB/s"
            f"  failed {s['jobs_failed']}  last error: {s['last_error'] or '-'}"
        )
    lines.append("caches:")
    caches = cache_status()
    lines += ["  (none running)"] if not caches else []
    for c in caches:
        if c.get("error"):
            lines.append(f"  node {c['node_id'][:12]}  ERROR {c['error']}")
            continue
        lines.append(
            f"  node {c['node_id'][:12]}  used {_mb(c['bytes_used'])} / {_mb(c['capacity_bytes'])}"
            f"  files {c['files']}  hit rate {c['hit_rate']:.0%}  evictions {c['evictions']}"
        )
    return lines


def recovery_lines(run: str) -> list[str]:
    """What the run's Recovery decided: isolated nodes and each attempt's resume step."""
    state = load_state(run)
    if state is None:
        return [f"recovery: no record under {run}"]
    lines = [
        f"recovery: isolated nodes {', '.join(n[:12] for n in state['isolated_nodes']) or '-'}"
        + (f"; stopped: {state['stopped']}" if state.get("stopped") else "")
    ]
    for a in state["attempts"]:
        excluded = ", ".join(n[:12] for n in a.get("excluded_nodes", [])) or "-"
        lines.append(f"  attempt {a['attempt']}  resume step {a.get('resume_step')}  excluded {excluded}")
    return lines


def checkpoint_lines(run: str, now: float | None = None) -> list[str]:
    """The run's checkpoints as its goodput events tell: failed and superseded saves, and
    how old the recovery point (the newest committed checkpoint's state) is now, or was at
    the run's end when it finished."""
    events = read_events(resolve(run))
    if not events:
        return [f"checkpoints: no goodput events under {run}"]
    ledger = compute(list(events.values()))
    if not ledger.finished:  # a run under way (or dead): its recovery point ages until now
        ledger = compute(list(events.values()), job_end=time.time() if now is None else now)
    if ledger.recovery_point_age_s is None or ledger.recovery_point_age_max_s is None:
        point = "none committed yet"
    else:
        state = "at the run's end" if ledger.finished else "now"
        point = f"{ledger.recovery_point_age_s:.0f} s old {state} (at most {ledger.recovery_point_age_max_s:.0f} s)"
    return [
        f"checkpoints: failed {ledger.checkpoints_failed}  superseded {ledger.checkpoints_superseded}"
        f"  recovery point {point}"
    ]


def cmd_status(args: argparse.Namespace) -> int:
    try:
        nodes = status_lines(args.address)
    except ConnectionError as exc:  # ray.init: nothing runs at that address
        sys.stderr.write(
            f"ray-goodput: no Ray cluster at {args.address!r} ({exc}); start one (ray start --head, "
            "ray up) or pass --address\n"
        )
        return 2
    lines = nodes + (recovery_lines(args.run) + checkpoint_lines(args.run) if args.run else [])
    for line in lines:
        sys.stdout.write(line + "\n")
    return 0
