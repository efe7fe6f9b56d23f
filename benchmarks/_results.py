"""Where a benchmark's results go, and what they record about the run that made them.

Every benchmark writes one JSON file, by default ``benchmarks/results/<benchmark>_<machine
kind>.json`` (machine kind: ``cpu``, or ``cuda_<gpu>`` for a run on a GPU, e.g.
``cuda_h200``), overwriting the previous run's: the file in the tree is the current
result, earlier ones are in git's history. Each file is ``{"run": ..., <the benchmark's
own keys>}`` where ``run`` says what produced it:

    commit    ``git rev-parse HEAD`` when the run started (None outside a git checkout)
    dirty     whether the tree had changes then (``git status --porcelain``), results
              files under ``benchmarks/results/`` not counted; ``changed`` names them
    date      when the run started, ``finished`` when the file was last written (UTC, ISO 8601)
    machine   CPUs (count, model), memory, GPU (name, count) if any, load average, versions
    command   the command line

Run from a benchmark's directory (``python benchmarks/<name>.py``): imported as ``_results``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
_RESULTS_REL = RESULTS_DIR.relative_to(ROOT).as_posix()


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout


def git_state() -> dict[str, Any]:
    """``{"commit", "dirty", "changed"}`` of the checkout the benchmark runs from."""
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--", ".", f":(exclude){_RESULTS_REL}")
    changed = [line[3:] for line in (status or "").splitlines() if line.strip()]
    return {
        "commit": head.strip() if head else None,
        "dirty": None if status is None else bool(changed),
        "changed": changed[:20] + ([f"... {len(changed) - 20} more"] if len(changed) > 20 else []),
    }


def _cpu_model() -> str | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or None
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else None


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _gpus() -> list[str]:
    """Names of the machine's NVIDIA GPUs: from ``nvidia-smi``, else from torch when the
    benchmark imported it; none when neither knows of one."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return [line.strip() for line in done.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        pass
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def machine() -> dict[str, Any]:
    """What the run measured on: CPUs, memory, GPUs, load, software versions."""
    versions = {"python": platform.python_version()}
    for name in ("torch", "ray", "pyarrow"):
        try:  # the installed distribution's metadata: nothing is imported
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    gpus = _gpus()
    return {
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": _memory_gib(),
        "gpu": gpus[0] if gpus else None,
        "gpus": len(gpus),
        "platform": platform.platform(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        **versions,
    }


def machine_kind(device: str = "cpu") -> str:
    """``cpu``, or ``cuda_<gpu>`` (``NVIDIA H200`` -> ``cuda_h200``) for a run on a GPU."""
    if device == "cpu":
        return "cpu"
    gpus = _gpus()
    name = gpus[0] if gpus else "unknown"
    words = [w for w in re.split(r"[^0-9a-z]+", name.lower()) if w and w not in ("nvidia", "tesla", "geforce")]
    return "cuda_" + ("_".join(words) or "unknown")


def default_path(benchmark: str, device: str = "cpu") -> Path:
    """``benchmarks/results/<benchmark>_<machine kind>.json``."""
    return RESULTS_DIR / f"{benchmark}_{machine_kind(device)}.json"


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def start_run(benchmark: str, argv: list[str] | None = None) -> dict[str, Any]:
    """The ``run`` record, taken when the run starts (the commit measured is the one then)."""
    args = sys.argv[1:] if argv is None else argv
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT).as_posix() if script.is_relative_to(ROOT) else str(script)
    return {
        "benchmark": benchmark,
        **git_state(),
        "date": _utc_now(),
        "machine": machine(),
        "command": shlex.join(["python", shown, *args]),
    }


def write(path: str | Path, run: dict[str, Any], payload: dict[str, Any]) -> Path:
    """Write ``{"run": run, **payload}`` to ``path`` (overwriting); returns the path. Called
    after each phase of a long run too, so that a run stopped early leaves what it measured."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"run": {**run, "finished": _utc_now()}, **payload}
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


def read(path: str | Path) -> dict[str, Any]:
    """A results file's content (the ``run`` record and the benchmark's keys)."""
    return json.loads(Path(path).read_text())
