"""``ray-goodput status``: what each node's uploader and cache are doing, one line each."""

from __future__ import annotations

import argparse
import logging
import sys

import ray

from ray_goodput.checkpoint import uploader_status
from ray_goodput.data import cache_status
from ray_goodput.driver import load_state

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


def cmd_status(args: argparse.Namespace) -> int:
    lines = status_lines(args.address) + (recovery_lines(args.run) if args.run else [])
    for line in lines:
        sys.stdout.write(line + "\n")
    return 0
