"""The step-failures benchmark's schedule and verdicts (``benchmarks/_step_failures.py``):
pure logic over hand-made results; the benchmark itself runs real Ray, gloo and S3."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ray_goodput.testing import FailAt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _step_failures  # the benchmarks import each other by bare name

FAIL_AT = [20, 60, 100, 140]


def _run(system: str, goodput: float, met: int, seed: int = 0) -> dict:
    return {
        "system": system,
        "seed": seed,
        "fail_at": FAIL_AT,
        "failures_met": met,
        "wall_s": 100.0,
        "ledger": {"goodput": goodput, "work_steps": 100.0 * goodput},
        "survivor_max_gap_s": 1.4 if system == "rg_replicas" else None,
    }


def _verdict_line(text: str, starts: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(starts))


def test_a_seed_where_replica_mode_met_fewer_failures_than_scheduled_meets_no_target():
    """Replica mode's replacement healed past two scheduled failures and never met them:
    its 3× goodput came from failing half as often, and must not count as the 2× target."""
    results = [_run("rt_async_dcp", 0.2, 4), _run("rg_whole", 0.22, 4), _run("rg_replicas", 0.6, 2)]
    text = _step_failures.verdicts(results)
    assert "MISSED" in _verdict_line(text, "replica mode / Ray")
    assert "MISSED" in _verdict_line(text, "survivors' largest step gap")
    assert "replica mode met 2 of 4 failures" in text
    # Ray's and ray_goodput's whole-group runs both met every failure: their comparison stands.
    assert _verdict_line(text, "ray_goodput whole-group").endswith("target ≥ 1×: MET")
    whole_short = [_run("rt_async_dcp", 0.2, 4), _run("rg_whole", 0.22, 3), _run("rg_replicas", 0.6, 4)]
    text = _step_failures.verdicts(whole_short)
    assert "MISSED" in _verdict_line(text, "ray_goodput whole-group")
    assert _verdict_line(text, "replica mode / Ray").endswith("target ≥ 2×: MET")

    every_failure_met = [_run("rt_async_dcp", 0.2, 4), _run("rg_whole", 0.22, 4), _run("rg_replicas", 0.6, 4)]
    text = _step_failures.verdicts(every_failure_met)
    assert _verdict_line(text, "replica mode / Ray").endswith("target ≥ 2×: MET")
    assert _verdict_line(text, "ray_goodput whole-group").endswith("target ≥ 1×: MET")


@pytest.mark.parametrize("seed", range(20))
def test_failure_steps_are_seeded_inside_the_run_and_at_least_min_gap_apart(seed):
    steps = _step_failures.failure_steps(seed, 240, 4, min_gap=50)
    assert steps == _step_failures.failure_steps(seed, 240, 4, min_gap=50)
    assert len(steps) == 4 and 10 <= steps[0] and steps[-1] < 235
    assert all(b - a >= 50 for a, b in zip(steps, steps[1:]))


def test_a_schedule_that_cannot_fit_names_the_options_that_make_it_fit():
    assert _step_failures.failure_steps(0, 166, 4, min_gap=50) == [10, 60, 110, 160]  # the one placement
    with pytest.raises(ValueError, match=r"--steps.*--failures.*--min-gap"):
        _step_failures.failure_steps(0, 165, 4, min_gap=50)
    with pytest.raises(ValueError, match=r"--min-gap must be at least 1"):  # two failures on one step
        _step_failures.failure_steps(0, 240, 4, min_gap=0)


def test_the_failures_a_run_met_are_the_markers_its_killed_processes_wrote(tmp_path):
    """The count behind "every failure met": FailAt's own markers, written by processes it
    SIGKILLed (one due at its step, one due late), not the schedule."""
    for at, step in ((20, 20), (60, 75)):
        code = (
            "from ray_goodput.testing import FailAt; "
            f"FailAt(step={at}, rank=1, marker_dir={str(tmp_path)!r}, or_later=True).maybe_fail({step}, 1)"
        )
        assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == -9
    FailAt(step=100, rank=1, marker_dir=str(tmp_path), or_later=True).maybe_fail(99, 1)  # not due: no marker
    assert _step_failures.failures_met(tmp_path) == 2
