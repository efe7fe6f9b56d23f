"""Both examples in their --smoke mode, as a user runs them (a subprocess each).

Both are ``early`` tests (see conftest): they start when collection ends and run beside
the quick tests, and each test waits for its own. Much of each run is waiting (Ray
starting, a killed worker's restart), which leaves the cores to the quick tests."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import kill_tree

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT_S = 300
pytestmark = pytest.mark.slow


def _start(script: str, out: Path, *extra: str) -> subprocess.Popen:
    """Output goes to files beside ``out`` (a pipe that nobody reads while the test waits
    for the other example would stall this one once full)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / "stdout", "w") as stdout, open(out.parent / "stderr", "w") as stderr:
        return subprocess.Popen(
            [sys.executable, str(EXAMPLES / script), "--smoke", "--out", str(out), *extra],
            stdout=stdout,
            stderr=stderr,
            cwd=out.parent,
        )


def _start_lm(directory: Path) -> subprocess.Popen:
    return _start("train_lm_fsdp2.py", directory / "lm" / "out")


def _start_img(directory: Path) -> subprocess.Popen:
    return _start("image_classification.py", directory / "img" / "out", "--images", "400")  # smoke: 1000


def _output(out: Path) -> str:
    return (out.parent / "stdout").read_text() + "\n" + (out.parent / "stderr").read_text()[-5000:]


def _finish(early: tuple[subprocess.Popen, Path], key: str) -> tuple[str, Path]:
    proc, out = early[0], early[1] / key / "out"
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_tree(proc)  # and the Ray it started
        raise AssertionError(f"{key} --smoke still running after {TIMEOUT_S} s:\n{_output(out)}") from None
    stdout = (out.parent / "stdout").read_text()
    assert proc.returncode == 0, f"{key} failed:\n{_output(out)}"
    assert not (out.parent / "mlruns").exists()  # MLflow artifacts stay under --out
    return stdout, out


@pytest.mark.early.with_args(_start_lm)
def test_lm_fsdp2_smoke_resumes_after_killed_worker(early):
    stdout, _ = _finish(early, "lm")
    assert re.search(r"^resumed from committed checkpoint step (10|20|30)$", stdout, re.M), stdout
    stalls = re.search(r"^checkpoint stall per save, rank 0 \(s\): (.+)$", stdout, re.M)
    assert stalls and len(re.findall(r"step \d+: \d+\.\d+", stalls.group(1))) >= 4, stdout
    goodput = re.search(r"^goodput (\d+\.\d)% of .*\((\d+) failure\(s\), (\d+) steps lost\)", stdout, re.M)
    # >= 1: on a loaded machine Ray's worker health check can fail an attempt as well.
    assert goodput and float(goodput.group(1)) > 0 and int(goodput.group(2)) >= 1, stdout
    losses = [float(v) for v in re.findall(r"\d+: (\d+\.\d+)", stdout.split("loss by step:")[1].splitlines()[0])]
    assert len(losses) == 6 and losses[-1] < losses[0], stdout  # it learns across the resume


@pytest.mark.early.with_args(_start_img)
def test_image_classification_smoke_prints_both_loaders(early):
    stdout, out = _finish(early, "img")
    rows = {}
    for name in ("stock", "ray_goodput"):
        row = re.search(rf"^\| {name} \| ([\d,]+) \| ([\d,]+) \| (\d+)% \| (\d+)% \|$", stdout, re.M)
        assert row, stdout
        rows[name] = [float(v.replace(",", "")) for v in row.groups()]
        assert rows[name][0] > 0 and rows[name][1] > 0
    # Every image landed in the node cache once (epoch 2 is served from it).
    cache = re.search(r"^node cache: (\d+) files, .* (\d+\.\d) MiB fetched from storage", stdout, re.M)
    assert cache and int(cache.group(1)) == 400 and float(cache.group(2)) > 0, stdout
    assert "fetch_seconds per step in MLflow: sqlite:///" in stdout
    assert (out / "mlflow.db").exists()
