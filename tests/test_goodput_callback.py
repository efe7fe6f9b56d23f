"""GoodputCallback's MLflow thread against a real MLflow (sqlite store) and real event files,
with its hooks called directly (no Ray run: the controller is not the point here)."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace
from typing import Any

import pyarrow.fs as pafs

from ray_goodput import GoodputCallback
from ray_goodput.driver import _publish
from ray_goodput.goodput._events import EventLog
from ray_goodput.goodput._recorder import StepRecorder
from ray_goodput.storage import StorageLocation


def _recorder(root: str) -> StepRecorder:
    """Rank 0's recorder of one attempt, its events under ``root``."""
    return StepRecorder(EventLog(StorageLocation(uri=root, fs=pafs.LocalFileSystem(), root=root), rank=0, world_size=1))


def _started(tmp_path, ctx, **kwargs) -> tuple[GoodputCallback, Any, str]:
    """A GoodputCallback on a sqlite store, its controller hooks (ray_goodput.TorchTrainer
    adds them) past the controller's start (the MLflow run opens in the background), and
    the store's URI."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cb = GoodputCallback(tracking_uri=uri, **kwargs)
    hooks = cb.controller_callback()
    hooks.after_controller_start(ctx)
    return cb, hooks, uri


def _finished_job(root: str) -> None:
    """One attempt that stepped twice and ended cleanly, as rank 0's recorder writes it."""
    rec = _recorder(root)
    rec.step(1)
    rec.step(2)
    rec.end()


def _run_context(root: str, name: str) -> SimpleNamespace:
    """What Ray Train hands the hooks: the run's config with its storage."""
    storage = SimpleNamespace(storage_filesystem=pafs.LocalFileSystem(), experiment_fs_path=root)
    ctx = SimpleNamespace(get_run_config=lambda: SimpleNamespace(storage_context=storage, name=name))
    ctx.run_config = ctx.get_run_config()
    return ctx


def _assert_finished_in_mlflow(uri: str, name: str) -> None:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("ray_goodput")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.runName = '{name}'")
    assert run.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"goodput_breakdown.png", "goodput_summary.json"}


def test_with_the_controller_hooks_the_final_ledger_spans_the_whole_job_and_no_report_waits_for_mlflow(
    tmp_path, monkeypatch
):
    """The report that saw the job's end published the final ledger while every worker waited
    in it: first it waited for MLflow to finish the run (charts, artifacts; seconds when the
    store is new); then, with MLflow moved off it, the ledger still ended at that report, and
    the job's tail after it (the workers' shutdown, the controller's end) was in no bucket.
    With the controller hooks, a report queues live metrics only; the controller's end
    publishes the final ledger up to its own time and waits for MLflow to finish the run."""

    root = str(tmp_path / "run")
    _finished_job(root)
    entered, release = threading.Event(), threading.Event()
    original = _publish.MlflowSink.finish

    def held_finish(self, *args):
        entered.set()
        assert release.wait(60), "the test never released MLflow's finish"
        original(self, *args)

    monkeypatch.setattr(_publish.MlflowSink, "finish", held_finish)
    ctx = _run_context(root, "held")
    cb, hooks, uri = _started(tmp_path, ctx)
    cb.after_report(ctx, [{"step": 2}], None)  # the ledger is finished: not published as final here
    assert cb.ledger is not None and cb.ledger.finished
    assert not (tmp_path / "run" / "goodput" / "summary.json").exists()
    ended = time.time()
    threading.Timer(0.5, release.set).start()
    hooks.after_controller_finish(None)  # publishes, and returns once MLflow finished the run
    assert entered.is_set()
    final = json.loads((tmp_path / "run" / "goodput" / "summary.json").read_text())
    assert final["finished"] and final["total_s"] >= ended - cb.job_start  # up to the controller's end
    _assert_finished_in_mlflow(uri, "held")


def test_a_job_that_records_its_end_after_its_last_report_still_gets_its_final_ledger(tmp_path):
    """A training function under Ray's own TorchTrainer that calls ``record_end()`` after its
    last ``ray.train.report`` (or a report whose ledger was not final yet): no report
    follows the end, so ``after_report`` never saw a finished ledger, and the MLflow run
    stayed open without its chart or summary. The controller's end publishes it."""

    root = str(tmp_path / "run")
    rec = _recorder(root)
    rec.step(1)
    ctx = _run_context(root, "late-end")
    cb, hooks, uri = _started(tmp_path, ctx)
    cb.after_report(ctx, [{"step": 1}], None)  # the last report: the ledger is not finished yet
    assert not cb.ledger.finished
    rec.step(2)
    rec.end()  # after the last report
    hooks.after_controller_finish(None)
    assert cb.ledger.finished
    assert (tmp_path / "run" / "goodput" / "summary.json").exists()
    _assert_finished_in_mlflow(uri, "late-end")


def test_a_run_that_ended_with_an_error_is_not_published_as_finished_at_the_controllers_end(tmp_path):
    """The end record says a rank's function returned, not that the run succeeded: rank 0
    can end cleanly while another rank's failure uses up the retries."""
    root = str(tmp_path / "run")
    _finished_job(root)
    ctx = _run_context(root, "failed")
    cb, hooks, _ = _started(tmp_path, ctx)
    hooks.after_controller_finish(SimpleNamespace(error=RuntimeError("rank 1 failed past max_failures")))
    assert not (tmp_path / "run" / "goodput" / "summary.json").exists()
    hooks.after_controller_finish(SimpleNamespace(error=None))  # a run that ended well
    assert json.loads((tmp_path / "run" / "goodput" / "summary.json").read_text())["finished"]


def test_a_run_that_ended_well_without_recording_its_end_is_still_published_at_the_controllers_end(tmp_path):
    """Replica mode's rank 0 can be a replacement told its peers had finished (it records no
    end), and a loop without a Checkpointer may never call ``record_end()``: the run ended
    well all the same, and its ledger goes out, saying it saw no end."""
    root = str(tmp_path / "run")
    rec = _recorder(root)
    rec.step(1)
    ctx = _run_context(root, "no-end")
    cb, hooks, uri = _started(tmp_path, ctx)
    hooks.after_controller_finish(SimpleNamespace(error=None))
    assert json.loads((tmp_path / "run" / "goodput" / "summary.json").read_text())["finished"] is False
    _assert_finished_in_mlflow(uri, "no-end")


def test_a_report_does_not_wait_for_a_refresh_under_way_and_the_controllers_end_publishes_the_final_ledger(
    tmp_path, monkeypatch
):
    """The controller hooks refresh the ledger between reports in a thread at the lowest CPU
    priority. A report (every worker waiting in it) must not wait for that thread, which a
    busy node may starve; the controller's end then publishes the final ledger the report
    skipped."""
    root = str(tmp_path / "run")
    _finished_job(root)
    ctx = _run_context(root, "busy")
    cb, hooks, uri = _started(tmp_path, ctx)
    entered, release = threading.Event(), threading.Event()
    original = GoodputCallback.refresh

    def held_refresh(self, *args, **kwargs):
        if threading.current_thread().name == "rg-goodput-refresh":
            entered.set()
            assert release.wait(120), "the test never released the refresh"
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GoodputCallback, "refresh", held_refresh)
    hooks.after_worker_group_poll_status(SimpleNamespace())  # starts the refresh: held inside it
    assert entered.wait(60), "the controller's poll started no refresh"
    report = threading.Thread(target=cb.after_report, args=(ctx, [{"step": 2}], None), daemon=True)
    report.start()
    report.join(timeout=30)
    held = not release.is_set()
    release.set()
    assert not report.is_alive() and held, "the report waited for the refresh under way"
    hooks.after_controller_finish(None)
    assert cb.ledger is not None and cb.ledger.finished
    assert (tmp_path / "run" / "goodput" / "summary.json").exists()
    _assert_finished_in_mlflow(uri, "busy")


def test_refreshes_between_reports_take_a_bounded_share_of_the_controllers_time(tmp_path, monkeypatch):
    """A refresh recomputes the ledger over every event of the run (about 0.9 s per million
    steps): at a fixed ``log_every_s`` a long run's refreshes would take most of the
    controller's time. The next one waits twenty times as long as the last one took."""
    root = str(tmp_path / "run")
    _finished_job(root)
    ctx = _run_context(root, "costly")
    cb, hooks, _ = _started(tmp_path, ctx, log_every_s=0.01)
    calls = []

    def slow_progress(self, run_context):
        calls.append(time.monotonic())
        time.sleep(0.3)

    monkeypatch.setattr(GoodputCallback, "publish_progress", slow_progress)
    hooks.after_worker_group_poll_status(SimpleNamespace())
    assert _wait_until(lambda: len(calls) == 1), "the controller's poll started no refresh"
    hooks._refresher.join(timeout=30)
    for _ in range(5):  # the controller polls every 0.1 s or so; log_every_s alone would allow these
        time.sleep(0.02)
        hooks.after_worker_group_poll_status(SimpleNamespace())
    assert len(calls) == 1, calls  # the next refresh is at least 6 s (20 x 0.3 s) after the last
    hooks.after_controller_finish(None)


def _wait_until(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_one_failure_polled_many_times_is_one_failure_in_the_ledger_and_mlflow(tmp_path):
    """Ray calls after_exception at every poll that shows errors; while it waits out a
    preemption it polls every 2 s before its one decision: each poll was a failure of its
    own (goodput/failures, a failure_N tag each). A failure is new once a worker group or
    a replica's replacement started since the last one."""
    root = str(tmp_path / "run")
    _finished_job(root)
    ctx = _run_context(root, "polled")
    cb, hooks, _ = _started(tmp_path, ctx)
    for _ in range(30):
        cb.after_exception(ctx, {1: RuntimeError("node preempted")})
    hooks.on_controller_start_worker_group(scaling_config=None, num_workers=2)  # the restart
    cb.after_exception(ctx, {0: RuntimeError("a second failure")})
    hooks.after_replica_group_start(SimpleNamespace())  # replica mode: a replacement
    cb.after_exception(ctx, {0: RuntimeError("a third failure")})
    assert cb.refresh(ctx).failures == 3
    # A preemption Ray decides on although no poll showed an error (the draining node's
    # worker still ran) is a failure too; one whose group finished within its grace is not.
    from ray.train.v2._internal.execution.failure_handling import FailureDecision

    notice = SimpleNamespace(errors={}, get_preemption_info=lambda: "node-A")
    hooks.on_controller_start_worker_group(scaling_config=None, num_workers=2)
    for _ in range(3):
        hooks.after_worker_group_poll_status(notice)
    assert cb.refresh(ctx).failures == 3  # not yet: Ray has not decided
    hooks.before_controller_execute_failure_decision(FailureDecision.RETRY)
    assert cb.refresh(ctx).failures == 4
    hooks.on_controller_start_worker_group(scaling_config=None, num_workers=2)
    hooks.after_worker_group_poll_status(notice)
    hooks.after_controller_finish(SimpleNamespace(error=None))  # it finished within the grace period
    assert cb.refresh(ctx).failures == 4


def test_a_run_recovery_stops_for_an_error_no_retry_fixes_says_so_in_its_summary(tmp_path):
    """Ray calls the user callbacks' ``after_exception`` before any other callback's hook
    of the same poll (its UserCallbackHandler precedes them), so GoodputCallback published
    its final summary before Recovery had seen the error: ``stopped`` was null in every
    run Recovery stopped. A Recovery runs when its record is there."""
    from ray_goodput.driver._record import STATE_FILE
    from ray_goodput.errors import StateMismatchError
    from ray_goodput.storage import write_bytes

    root = str(tmp_path / "run")
    _finished_job(root)
    location = StorageLocation(uri=root, fs=pafs.LocalFileSystem(), root=root)
    record = {"attempts": [{"attempt": 1}, {"attempt": 2}], "stopped": None, "isolated_nodes": []}
    write_bytes(location, STATE_FILE, json.dumps(record).encode())  # as Recovery wrote it at the start
    ctx = _run_context(root, "stopped")
    cb, _, _ = _started(tmp_path, ctx)
    cb.after_exception(ctx, {0: RuntimeError("collective aborted"), 1: StateMismatchError("no key 'ema'")})
    summary = json.loads((tmp_path / "run" / "goodput" / "summary.json").read_text())
    assert summary["stopped"] == {"attempt": "2", "rank": "1", "error": "StateMismatchError: no key 'ema'"}


def test_without_a_recovery_an_error_no_retry_fixes_is_not_reported_as_a_stop(tmp_path):
    """Without a Recovery, Ray retries such an error until max_failures: nothing stopped it."""
    from ray_goodput.errors import StateMismatchError

    root = str(tmp_path / "run")
    _finished_job(root)
    ctx = _run_context(root, "unstopped")
    cb, _, _ = _started(tmp_path, ctx)
    cb.after_exception(ctx, {1: StateMismatchError("no key 'ema'")})
    assert json.loads((tmp_path / "run" / "goodput" / "summary.json").read_text())["stopped"] is None


def test_the_nodes_excluded_from_an_attempt_are_noted_on_that_attempts_row():
    """Notes were keyed by the Recovery's attempt index, rows are rank 0's processes: an
    attempt whose rank 0 died before its first event (or a replica's replacement, a row
    of its own) shifted every later note onto the wrong row. Each attempt's note now goes
    to the first row that began after it started, before the next attempt started."""
    from ray_goodput.driver._callback import attempt_notes

    recovery = [
        {"attempt": 1, "t": 100.0, "excluded_nodes": []},
        {"attempt": 2, "t": 200.0, "excluded_nodes": ["aaaaaaaaaaaa"]},  # rank 0 died before its first event
        {"attempt": 3, "t": 300.0, "excluded_nodes": ["aaaaaaaaaaaa", "bbbbbbbbbbbb"]},
    ]
    rows = [[{"t": 101.0}, {"t": 150.0}], [{"t": 305.0}], [{"t": 340.0}]]  # the last: a replica's replacement
    assert attempt_notes(recovery, rows) == {1: "excluded aaaaaaaa, bbbbbbbb"}
    # a record written before attempts had a time places no note rather than a wrong one
    assert attempt_notes([{"attempt": 1, "excluded_nodes": ["cccccccc"]}], rows) == {}


def test_the_controllers_end_waits_for_mlflow_once_within_its_bound(tmp_path, monkeypatch):
    """The final publication waited up to the bound for MLflow to finish the run, and the
    controller's end then waited the bound again behind the same stuck call: twice the
    documented 120 s (with a refresh holding the lock, 60 s more) before the controller
    could go."""
    from ray_goodput.driver import _callback

    root = str(tmp_path / "run")
    _finished_job(root)
    ctx = _run_context(root, "stuck")
    release = threading.Event()
    monkeypatch.setattr(_publish.MlflowSink, "finish", lambda self, *args: release.wait(60))
    monkeypatch.setattr(_callback, "_MLFLOW_DRAIN_S", 2.0)
    waits: list[tuple[float, bool]] = []  # each wait for the MLflow thread: its bound, and whether it was done
    wait = _callback.GoodputCallback._wait_for_mlflow

    def recorded(self, timeout_s: float) -> bool:
        done = wait(self, timeout_s)
        waits.append((timeout_s, done))
        return done

    monkeypatch.setattr(_callback.GoodputCallback, "_wait_for_mlflow", recorded)
    cb, hooks, _ = _started(tmp_path, ctx)
    began = time.monotonic()
    try:
        hooks.after_controller_finish(SimpleNamespace(error=None))
        waited = time.monotonic() - began
    finally:
        release.set()
    # One bound for the publication and the end together (the waits' bounds, not the wall
    # time, which a loaded machine stretches), and it ran out on the stuck finish.
    # (Below the bound: the publication's own time is inside it, not added to it.)
    assert waits and sum(bound for bound, _ in waits) < 2.0 and waits[-1][1] is False, waits
    assert waited >= 1.95, waited
    assert json.loads((tmp_path / "run" / "goodput" / "summary.json").read_text())["finished"]


def test_a_fit_run_again_goes_on_in_the_jobs_mlflow_run_numbering_its_failures_on(tmp_path):
    """In replica mode ``ray_goodput.TorchTrainer`` runs ``fit()`` again when Ray's
    controller ended the run (a worker died while it replaced a replica). The new
    controller's copy of the GoodputCallback opened a second MLflow run for the same job,
    numbered its failures from ``failure_1`` again, and the first run stayed RUNNING."""
    import pickle

    import mlflow

    root = str(tmp_path / "run")
    ctx = _run_context(root, "rerun")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cb = GoodputCallback(tracking_uri=uri)
    sent = (cb, cb.controller_callback())  # what the driver hands each fit()'s controller
    client = mlflow.MlflowClient(tracking_uri=uri)

    def runs() -> list:
        exp = client.get_experiment_by_name("ray_goodput")
        return client.search_runs([exp.experiment_id], filter_string="tags.mlflow.runName = 'rerun'")

    first, first_hooks = pickle.loads(pickle.dumps(sent))
    first_hooks.after_controller_start(ctx)
    first.after_exception(ctx, {1: RuntimeError("replica 1 died")})
    first_hooks.after_replica_group_start(SimpleNamespace())
    first.after_exception(ctx, {0: RuntimeError("replica 0 died while replica 1 was replaced")})
    first_hooks.after_controller_finish(SimpleNamespace(error=RuntimeError("the controller ended the run")))
    (run,) = runs()
    assert run.info.status == "FAILED"  # ended with an error: not left RUNNING

    second, second_hooks = pickle.loads(pickle.dumps(sent))
    second_hooks.after_controller_start(ctx)
    _finished_job(root)
    second.after_exception(ctx, {1: RuntimeError("replica 1 died again")})
    second_hooks.after_controller_finish(SimpleNamespace(error=None))
    (again,) = runs()
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    failures = {k: v for k, v in again.data.tags.items() if k.startswith("failure_")}
    assert failures == {
        "failure_1": "rank 1: RuntimeError: replica 1 died",
        "failure_2": "rank 0: RuntimeError: replica 0 died while replica 1 was replaced",
        "failure_3": "rank 1: RuntimeError: replica 1 died again",
    }


def test_only_the_same_jobs_fit_goes_on_in_its_mlflow_run_and_failures_number_on_past_gaps(tmp_path):
    """A new driver's GoodputCallback on the storage of a finished job reopened its run:
    FINISHED turned RUNNING, and the new job's metrics, logged from its own start (steps
    from 0), sat below the old job's latest. Failures were numbered on by counting the
    earlier tags: after a tag that failed to write (failure_1, failure_3), the next
    failure overwrote failure_3."""
    import pickle

    import mlflow

    root = str(tmp_path / "run")
    ctx = _run_context(root, "again")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(tracking_uri=uri)

    def runs() -> list:
        exp = client.get_experiment_by_name("ray_goodput")
        return client.search_runs([exp.experiment_id], filter_string="tags.mlflow.runName = 'again'")

    cb = GoodputCallback(tracking_uri=uri)
    sent = (cb, cb.controller_callback())
    first, first_hooks = pickle.loads(pickle.dumps(sent))
    first_hooks.after_controller_start(ctx)
    first.after_exception(ctx, {0: RuntimeError("one")})
    assert first._wait_for_mlflow(60)
    (run,) = runs()
    client.set_tag(run.info.run_id, "failure_3", "a failure whose failure_2 tag was not written")
    first_hooks.after_controller_finish(SimpleNamespace(error=RuntimeError("ended")))

    second, second_hooks = pickle.loads(pickle.dumps(sent))  # the same job's fit() run again
    second_hooks.after_controller_start(ctx)
    second.after_exception(ctx, {0: RuntimeError("four")})
    _finished_job(root)
    second_hooks.after_controller_finish(SimpleNamespace(error=None))
    (run,) = runs()
    assert run.info.status == "FINISHED" and run.data.tags["failure_4"] == "rank 0: RuntimeError: four"
    assert run.data.tags["failure_3"] == "a failure whose failure_2 tag was not written"

    other = GoodputCallback(tracking_uri=uri)  # another driver started on the finished job's storage
    hooks = other.controller_callback()
    hooks.after_controller_start(ctx)
    hooks.after_controller_finish(SimpleNamespace(error=None))
    assert {r.info.run_id for r in runs()} > {run.info.run_id}  # a run of its own
    assert client.get_run(run.info.run_id).info.status == "FINISHED"  # the finished job's run is left as it was


def test_a_job_whose_mlflow_run_record_is_unreadable_or_whose_store_fails_a_moment_keeps_one_run(tmp_path, monkeypatch):
    """A record that is not what the callback writes stopped every MLflow call of the job
    (its sink was never made); an MLflow error that passes (a locked sqlite store) was
    taken for a run deleted, and the job's run split in two."""
    import pickle

    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

    root = str(tmp_path / "run")
    (tmp_path / "run" / "goodput").mkdir(parents=True)
    (tmp_path / "run" / "goodput" / "mlflow_run.json").write_text("[1, 2]")
    ctx = _run_context(root, "odd")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(tracking_uri=uri)
    cb = GoodputCallback(tracking_uri=uri)
    sent = (cb, cb.controller_callback())
    first, first_hooks = pickle.loads(pickle.dumps(sent))
    first_hooks.after_controller_start(ctx)
    first_hooks.after_controller_finish(SimpleNamespace(error=RuntimeError("ended")))
    exp = client.get_experiment_by_name("ray_goodput")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FAILED"

    original, calls = mlflow.MlflowClient.get_run, []

    def locked_once(self, run_id):
        calls.append(run_id)
        if len(calls) == 1:
            raise MlflowException("database is locked", error_code=TEMPORARILY_UNAVAILABLE)
        return original(self, run_id)

    monkeypatch.setattr(mlflow.MlflowClient, "get_run", locked_once)
    second, second_hooks = pickle.loads(pickle.dumps(sent))
    second_hooks.after_controller_start(ctx)  # its open fails; the next MLflow call opens it
    _finished_job(root)
    second_hooks.after_controller_finish(SimpleNamespace(error=None))
    assert len(calls) >= 2
    (again,) = client.search_runs([exp.experiment_id])
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"


def test_a_run_whose_mlflow_run_never_opened_makes_none_at_an_error_end(tmp_path, monkeypatch):
    """The controller's end with an error skipped marking a run FAILED when none was open,
    but its wait for the MLflow thread then opened one: a new, empty run, left RUNNING."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

    def unavailable(self, *args, **kwargs):
        raise MlflowException("the store is down", error_code=TEMPORARILY_UNAVAILABLE)

    root = str(tmp_path / "run")
    ctx = _run_context(root, "down")
    monkeypatch.setattr(mlflow.MlflowClient, "create_run", unavailable)
    cb, hooks, uri = _started(tmp_path, ctx)
    assert cb._wait_for_mlflow(60)  # the open at the start failed
    monkeypatch.undo()  # the store is back
    hooks.after_controller_finish(SimpleNamespace(error=RuntimeError("ended")))
    exp = mlflow.MlflowClient(tracking_uri=uri).get_experiment_by_name("ray_goodput")
    assert exp is None or not mlflow.MlflowClient(tracking_uri=uri).search_runs([exp.experiment_id])
