"""``ray-goodput status``: what each node's uploader and cache are doing."""

from __future__ import annotations

import logging

import ray

from ray_goodput.node import _services

logger = logging.getLogger(__name__)


def uploader_status(timeout_s: float = 10.0) -> list[dict]:
    """``stats()`` of every live CheckpointUploader, sorted by node id (``error`` when it did
    not answer in ``timeout_s``). Needs ``ray.init``."""
    from ray_goodput.node._uploader import KIND  # noqa: PLC0415 - import cycle

    refs = {node: h.stats.remote() for node, h in _services.find(KIND).items()}
    out = []
    for node, ref in sorted(refs.items()):
        try:
            out.append(ray.get(ref, timeout=timeout_s))
        except Exception as exc:  # noqa: BLE001 - report it, keep listing
            out.append({"node_id": node, "error": f"{type(exc).__name__}: {exc}"})
    return out


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def status_lines(address: str = "auto") -> list[str]:
    """Human-readable lines for every node's uploader and cache."""
    from ray_goodput.data import cache_status  # noqa: PLC0415

    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    lines = ["uploaders:"]
    uploaders = uploader_status()
    lines += ["  (none running)"] if not uploaders else []
    for s in uploaders:
        if "error" in s:
            lines.append(f"  node {s['node_id'][:12]}  ERROR {s['error']}")
            continue
        lines.append(f"  node {s['node_id'][:12]}  queue {s['queue']}  pending {_mb(s['bytes_pending'])}"
                     f"  uploaded {_mb(s['bytes_uploaded'])}  {s['throughput_mb_s']:.1f} MB/s"
                     f"  failed {s['jobs_failed']}  last error: {s['last_error'] or '-'}")
    lines.append("caches:")
    caches = cache_status()
    lines += ["  (none running)"] if not caches else []
    for c in caches:
        if c.get("error"):
            lines.append(f"  node {c['node_id'][:12]}  ERROR {c['error']}")
            continue
        lines.append(f"  node {c['node_id'][:12]}  used {_mb(c['bytes_used'])} / {_mb(c['capacity_bytes'])}"
                     f"  files {c['files']}  hit rate {c['hit_rate']:.0%}  evictions {c['evictions']}")
    return lines
