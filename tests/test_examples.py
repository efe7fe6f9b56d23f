"""Both examples in their --smoke mode, as a user runs them (a subprocess each)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, out: Path, *extra: str) -> str:
    try:
        proc = subprocess.run([sys.executable, str(EXAMPLES / script), "--smoke", "--out", str(out), *extra],
                              capture_output=True, text=True, timeout=300, cwd=out.parent)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{script} --smoke still running after 300 s:\n{exc.stdout}\n{exc.stderr}") from exc
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr[-5000:]}"
    assert not (out.parent / "mlruns").exists()  # MLflow artifacts stay under --out
    return proc.stdout


@pytest.mark.slow
def test_lm_fsdp2_smoke_resumes_after_killed_worker(tmp_path):
    stdout = _run("train_lm_fsdp2.py", tmp_path / "lm")
    assert re.search(r"^resumed from committed checkpoint step (10|20|30)$", stdout, re.M), stdout
    stalls = re.search(r"^checkpoint stall per save, rank 0 \(s\): (.+)$", stdout, re.M)
    assert stalls and len(re.findall(r"step \d+: \d+\.\d+", stalls.group(1))) >= 4, stdout
    goodput = re.search(r"^goodput (\d+\.\d)% of .*\((\d+) failure\(s\), (\d+) steps lost\)", stdout, re.M)
    # >= 1: on a loaded machine Ray's worker health check can fail an attempt as well.
    assert goodput and float(goodput.group(1)) > 0 and int(goodput.group(2)) >= 1, stdout
    losses = [float(v) for v in re.findall(r"\d+: (\d+\.\d+)", stdout.split("loss by step:")[1].splitlines()[0])]
    assert len(losses) == 6 and losses[-1] < losses[0], stdout  # it learns across the resume


@pytest.mark.slow
def test_image_classification_smoke_prints_both_loaders(tmp_path):
    stdout = _run("image_classification.py", tmp_path / "img", "--images", "400")  # smoke: 1000
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
    assert (tmp_path / "img" / "mlflow.db").exists()
