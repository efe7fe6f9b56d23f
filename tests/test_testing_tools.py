"""``ray_goodput.testing`` and the suite's own machinery: the process launcher, the S3 server
start, and the markers that select tiers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ray_goodput.testing import free_port, run_world
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
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "--co",
            "-p",
            "no:cacheprovider",
            "-m",
            "not ray",
            "tests/test_train_integration.py",
            "tests/test_goodput_timeline.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    selected = {line.split("::")[1] for line in done.stdout.splitlines() if "::" in line}
    assert "test_quickstart_resumes_from_last_committed" not in selected  # uses ray_local
    assert "test_mlflow_artifacts_go_beside_a_sqlite_store_not_into_the_working_directory" in selected


def test_a_rank_that_raises_ends_the_run_at_once_with_its_traceback_while_its_peer_waits():
    for allow_deaths in (False, True):  # an error is an error, deaths allowed or not; no 60 s wait
        with pytest.raises(RuntimeError, match=r"rank 1 failed") as err:
            run_world(_fails_at_import.rank_1_raises, 2, timeout_s=60, allow_deaths=allow_deaths)
        assert "fails on purpose" in str(err.value)


def test_a_run_past_its_timeout_names_each_ranks_state():
    # Each rank is named with its state: running, or still starting on a loaded machine
    # (the watch's 3 s count from the spawn; joining the group can take longer there).
    with pytest.raises(TimeoutError, match=r"rank 0: (running|starting); rank 1: (running|starting)"):
        run_world(_fails_at_import.sleeps, 2, 30.0, timeout_s=3)


def test_a_moto_server_whose_port_was_taken_meanwhile_starts_again_on_another(monkeypatch):
    # Two servers start at once in a suite run (the CI soak's and the session's): a port
    # picked free can be bound by the other before moto binds it. The other server's
    # answer there must not count as this one being up.
    import ray_goodput.testing._s3 as s3

    first, first_endpoint = s3.start_moto_server()
    try:
        taken = int(first_endpoint.rsplit(":", 1)[1])
        ports = iter([taken])
        monkeypatch.setattr(s3, "free_port", lambda: next(ports, None) or free_port())
        second, second_endpoint = s3.start_moto_server()
        second.kill()
        second.wait()
        assert second_endpoint != first_endpoint
    finally:
        first.kill()
        first.wait()


def test_a_published_marker_file_is_never_read_before_its_writer_finished(tmp_path):
    """A reader that opens a marker as soon as it exists must see all of it. The restart
    fidelity test read its trigger (a node id) empty once, pulled node "" and failed,
    with its run left going in the background."""
    from ray_goodput.testing import publish_file, wait_for_file

    text = "x" * (4 << 20)
    seen: list[int] = []

    def read_all() -> None:
        for i in range(20):
            seen.append(len(wait_for_file(tmp_path / f"m{i}", timeout_s=60).read_text()))

    reader = threading.Thread(target=read_all)
    reader.start()
    for i in range(20):
        publish_file(tmp_path / f"m{i}", text)
    reader.join(timeout=60)
    assert not reader.is_alive()
    assert seen == [len(text)] * 20


def _maybe_fail_in_a_process(*calls: tuple[Path, int, int, bool]) -> int:
    """In one new process, ``FailAt(at, rank 1, or_later).maybe_fail(step, 1)`` for each
    ``(marker_dir, step, at, or_later)`` in turn; the process's exit code."""
    code = "from ray_goodput.testing import FailAt\n" + "".join(
        f"FailAt(step={at}, rank=1, marker_dir={str(d)!r}, or_later={late}).maybe_fail({step}, 1)\n"
        for d, step, at, late in calls
    )
    return subprocess.run([sys.executable, "-c", code], timeout=120).returncode


def test_a_failure_due_while_its_rank_was_being_replaced_kills_the_replacement_at_its_first_step(tmp_path):
    """A replica replaced while its peers stepped past a scheduled failure heals to a later
    step: with an exact-step FailAt it never met that failure, and the step-failures
    benchmark compared replica mode, meeting fewer failures, against systems meeting all."""
    exact, late = tmp_path / "exact", tmp_path / "late"
    # Step 7 passed unseen by an exact-step FailAt; a late one is not due before step 7.
    assert _maybe_fail_in_a_process((exact, 9, 7, False), (late, 6, 7, True)) == 0
    assert _maybe_fail_in_a_process((late, 9, 7, True)) == -9  # due since step 7: SIGKILL
    assert (late / "fault-step7-rank1.fired").exists() and not list(exact.glob("*.fired"))
    assert _maybe_fail_in_a_process((late, 10, 7, True)) == 0  # once per marker_dir


def _worker_env() -> tuple[dict, dict]:
    """In a Ray worker: its runtime env, and the environment variables the suite sets."""
    import ray

    keys = ("PYTHONPATH", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S")
    return dict(ray.get_runtime_context().runtime_env), {k: os.environ.get(k) for k in keys}


def _env_of_a_task(**options) -> tuple[dict, dict]:
    import ray

    return ray.get(ray.remote(num_cpus=0)(_worker_env).options(**options).remote(), timeout=60)


def test_the_shared_local_rays_workers_get_its_environment_without_a_runtime_env(ray_local):
    # The shared Ray gave its variables as the job's runtime_env: every worker of the suite
    # was then started through Ray's runtime-env agent and a setup process that execs the
    # worker, about 0.35 s of CPU and of start latency more per worker.
    runtime_env, env = _env_of_a_task()
    assert runtime_env == {}
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)  # the workers import the tests' modules


def test_the_shared_clusters_workers_get_its_environment_without_a_runtime_env(ray_cluster):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head = ray.get_runtime_context().get_node_id()  # the driver's node: where Train's controller runs
    for node in [head, *ray_cluster.worker_ids]:  # the worker nodes: added by top_up, after the head
        runtime_env, env = _env_of_a_task(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        assert runtime_env == {}, node
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT), node
        assert env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.1", node
        assert env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "5", node  # the cluster's own
