"""``ray_goodput.testing`` itself: what the other tests rely on from its process launcher."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ray_goodput.testing import run_world
from tests import _env_at_import, _fails_at_import

ROOT = Path(__file__).resolve().parents[1]


def test_a_rank_imports_its_functions_module_with_the_callers_environment(monkeypatch):
    # The fork server starts (with the environment of that moment) before the variable is
    # set, as it does when a test without Ray runs before the shared Ray sets RAY_AUTH_MODE.
    run_world(_env_at_import.nothing, 1)
    monkeypatch.setenv("RAY_GOODPUT_TEST_MARKER", "set-by-the-caller")
    assert run_world(_env_at_import.seen_at_import, 2) == ["set-by-the-caller"] * 2


def test_a_rank_that_dies_before_the_rendezvous_ends_the_run_at_once_naming_it(monkeypatch):
    # Its peer would wait in the rendezvous (30 min by default): run_world sees the early
    # exit and ends the run with the dead rank's error, well before its own timeout.
    monkeypatch.setenv("RAY_GOODPUT_TEST_FAIL_IMPORT_RANK", "1")
    with pytest.raises(RuntimeError, match=r"rank 1 .*before it joined") as err:
        run_world(_fails_at_import.barrier, 2, timeout_s=60)
    assert "cannot import" in str(err.value)  # its traceback comes along
    monkeypatch.setenv("RAY_GOODPUT_TEST_FAIL_IMPORT_RANK", "none")
    assert run_world(_fails_at_import.barrier, 2) == [0, 1]


def test_the_ray_marker_selects_the_tests_that_use_a_shared_ray():
    """``-m "not ray"`` must leave out the users of ``ray_local`` and ``ray_cluster``: the
    markers are added to them at collection, before ``-m`` selects (added after, they
    selected nothing and the whole suite ran)."""
    def collected(*args: str) -> set[str]:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider", *args,
                               "tests/test_data_cache.py", "tests/test_recovery.py"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode in (0, 5), done.stdout + done.stderr  # 5: none selected
        return {line.split("::")[1].split("[")[0] for line in done.stdout.splitlines() if "::" in line}

    no_ray, ray = collected("-m", "not ray"), collected("-m", "ray")
    assert "test_lru_eviction_under_small_capacity" in ray - no_ray  # uses ray_local
    assert "test_failing_health_check_keeps_workers_off_x_and_a_not_retryable_error_there_ends_the_run" in ray
    assert "test_gpu_check_device_path_and_no_gpu_pass_on_cpu" in no_ray - ray  # needs no Ray
