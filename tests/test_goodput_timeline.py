"""The job timeline, the per-step data-wait statistics, and the incremental event reader."""

from __future__ import annotations

import pytest

from ray_goodput import storage
from ray_goodput.goodput import EventLog, EventReader, compute, fetch_stats
from ray_goodput.goodput._timeline import marks, spans, timeline_png
from tests.test_goodput_ledger import _attempt, _rolled_back_attempt


def _two_attempts():
    first = _attempt(100.0, 0, 15, ckpt=0.2)
    second = _attempt(first[-1]["t"] + 6.0, 10, 10, end=True)
    return [first, second]


def test_timeline_spans_agree_with_the_ledger_bucket_by_bucket():
    attempts = _two_attempts()
    ledger = compute(attempts, job_start=95.0)
    per_bucket: dict[str, float] = {}
    for s in spans(attempts, job_start=95.0):
        per_bucket[s.bucket] = per_bucket.get(s.bucket, 0.0) + s.end - s.start
    for bucket in ("productive", "lost", "checkpoint_stall", "data_stall", "restore", "startup", "restart_downtime"):
        assert per_bucket.get(bucket, 0.0) == pytest.approx(ledger.seconds[bucket]), bucket
    assert {s.row for s in spans(attempts)} == {0, 1}


def test_timeline_spans_agree_with_the_ledger_after_a_rollback_in_the_attempt():
    attempts = [_rolled_back_attempt()]
    ledger = compute(attempts, job_start=100.0)
    per_bucket: dict[str, float] = {}
    for s in spans(attempts, job_start=100.0):
        per_bucket[s.bucket] = per_bucket.get(s.bucket, 0.0) + s.end - s.start
    assert ledger.seconds["lost"] > 0
    for bucket in ("productive", "lost", "data_stall", "restore", "startup"):
        assert per_bucket.get(bucket, 0.0) == pytest.approx(ledger.seconds[bucket]), bucket


def test_timeline_marks_failures_saves_resumes_and_notes():
    attempts = _two_attempts()
    found = marks(attempts, notes={1: "excluded abc"})
    kinds = [m.kind for m in found]
    assert kinds.count("failure") == 1 and kinds.count("resume") == 2 and kinds.count("note") == 1
    assert kinds.count("save") == 15  # every step of the first attempt stalled on a save
    assert [m.label for m in found if m.kind == "resume"] == ["resumed from step 0", "resumed from step 10"]


def test_timeline_shows_a_replacement_and_its_degraded_share_as_the_ledger_counts_it():
    attempt = _attempt(100.0, 0, 10, end=True)
    for e in attempt:
        if e["e"] == "step" and 4 <= e["step"] <= 6:
            e["capacity"] = 0.5  # 1 of 2 replicas stepped while the other was replaced
    ledger = compute([attempt], job_start=100.0)
    per_bucket: dict[str, float] = {}
    for s in spans([attempt], job_start=100.0):
        per_bucket[s.bucket] = per_bucket.get(s.bucket, 0.0) + s.end - s.start
    assert per_bucket["degraded"] == pytest.approx(ledger.seconds["degraded"])
    assert per_bucket["productive"] == pytest.approx(ledger.seconds["productive"])
    found = [(m.kind, m.t) for m in marks([attempt]) if m.kind.startswith("replica")]
    step = {e["step"]: e for e in attempt if e["e"] == "step"}
    assert found == [("replica_lost", step[4]["t0"]), ("replica_back", step[7]["t0"])]


def test_timeline_draws_a_replicas_quorum_wait_and_uncommitted_step_as_the_ledger_counts_them():
    attempt = _attempt(100.0, 0, 4, end=True)
    steps = [e for e in attempt if e["e"] == "step"]
    t0 = steps[2]["t0"]
    attempt.insert(attempt.index(steps[2]), {"e": "uncommitted", "t0": t0, "t": t0 + 0.4})
    for e in steps[2:]:
        e["t0"] += 0.4 if e is steps[2] else 1.6
        e["t"] += 1.6
    steps[2]["wait"] = 1.2
    attempt[-1]["t"] += 1.6
    ledger = compute([attempt], job_start=100.0)
    per_bucket: dict[str, float] = {}
    for s in spans([attempt], job_start=100.0):
        per_bucket[s.bucket] = per_bucket.get(s.bucket, 0.0) + s.end - s.start
    for bucket in ("lost", "restart_downtime", "productive", "data_stall"):
        assert per_bucket.get(bucket, 0.0) == pytest.approx(ledger.seconds[bucket]), bucket
    assert ledger.seconds["lost"] == pytest.approx(0.4) and ledger.seconds["restart_downtime"] == pytest.approx(1.2)


def test_timeline_png_is_written(tmp_path):
    path = tmp_path / "timeline.png"
    timeline_png(_two_attempts(), str(path), job_start=95.0, notes={1: "excluded n1"})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_fetch_stats_are_nearest_rank_percentiles_of_the_interval():
    events = [{"e": "step", "t": float(i), "fetch": i / 100} for i in range(1, 101)]
    events.append({"e": "restore", "t": 50.5})
    stats = fetch_stats(events, since=0.0)
    assert stats == {"data/fetch_seconds_p50": 0.51, "data/fetch_seconds_p95": 0.96, "data/fetch_seconds_max": 1.0}
    assert fetch_stats(events, since=90.0)["data/fetch_seconds_p50"] == 0.96
    assert fetch_stats(events, since=100.0) == {}


@pytest.fixture(params=["local", "s3"])
def run_root(request, tmp_path):
    if request.param == "local":
        return storage.resolve(str(tmp_path / "run"))
    return storage.resolve(request.getfixturevalue("s3_server").bucket_uri("run"))


def test_event_reader_reads_only_new_events(run_root):
    log = EventLog(run_root, rank=0, world_size=2)
    reader = EventReader(run_root)
    log.emit("step", step=1, n=1, t0=1.0, fetch=0.0, ckpt=0.0)
    log.flush()
    first = reader.poll()
    assert [e["e"] for e in first[log.attempt]] == ["start", "step"]
    reads = reader.reads
    assert reader.poll()[log.attempt] == first[log.attempt] and reader.reads == reads  # nothing new
    log.emit("step", step=2, n=1, t0=2.0, fetch=0.0, ckpt=0.0)
    log.flush()
    again = reader.poll()[log.attempt]
    assert [e.get("step") for e in again] == [None, 1, 2] and reader.reads == reads + 1
    log.close()


def test_mlflow_artifacts_go_beside_a_sqlite_store_not_into_the_working_directory(tmp_path, monkeypatch):
    from ray_goodput.driver._publish import MlflowSink

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    attempts = _two_attempts()
    sink = MlflowSink(f"sqlite:///{tmp_path}/store/mlflow.db", "exp", "run-1")
    ledger = compute(attempts, job_start=95.0)
    sink.finish(ledger, 1, {"goodput": ledger.goodput}, attempts, {})
    stored = {p.name for p in (tmp_path / "store" / "mlartifacts").rglob("*.png")}
    assert stored == {"goodput_breakdown.png", "goodput_timeline.png"}
    assert not (tmp_path / "cwd" / "mlruns").exists()


def test_what_the_recorder_hears_after_the_end_reaches_object_storage_at_once(s3_server):
    """``close()`` records the end, then settles the last saves: their commit's recovery point
    came after the end and sat in the object-store log's buffer (pushed once a second), where
    the final ledger, read right after, did not see it, and a process exiting first lost it."""
    from ray_goodput.goodput._recorder import StepRecorder

    root = storage.resolve(s3_server.bucket_uri("late"))
    log = EventLog(root, rank=0, world_size=1)
    rec = StepRecorder(log)
    rec.step(1)
    rec.recovery_point(1, at=1.0)  # before the end: the periodic flush carries it
    rec.end()
    rec.recovery_point(2, at=2.0)
    rec.checkpoint_superseded(3)
    events = EventReader(root).poll()[log.attempt]
    assert [(e["e"], e.get("step")) for e in events if e["e"] != "start"][-3:] == [
        ("end", None),
        ("recovery_point", 2),
        ("ckpt_superseded", 3),
    ], events
    log.close()


def test_timeline_spans_agree_with_the_ledger_when_an_attempt_died_before_it_stepped_or_one_resumed_lower():
    # The timeline kept an attempt's steps up to the very next row's resume point: a row that
    # died before it restored drew its predecessor's kept steps as lost, and a later row that
    # resumed lower left steps drawn as productive that the ledger counts lost.
    first = _attempt(100.0, 0, 30)
    died = [{"e": "start", "t": first[-1]["t"] + 5.0}]
    second = _attempt(died[-1]["t"] + 5.0, 20, 20)
    third = _attempt(second[-1]["t"] + 5.0, 10, 40, end=True)
    attempts = [first, died, second, third]
    ledger = compute(attempts, job_start=95.0)
    per_bucket: dict[str, float] = {}
    for s in spans(attempts, job_start=95.0):
        per_bucket[s.bucket] = per_bucket.get(s.bucket, 0.0) + s.end - s.start
    assert ledger.seconds["lost"] == pytest.approx((20 + 20) * 0.9)
    for bucket in ("productive", "lost"):
        assert per_bucket.get(bucket, 0.0) == pytest.approx(ledger.seconds[bucket]), bucket


def test_the_breakdown_chart_draws_each_bucket_in_the_timelines_colour(tmp_path, monkeypatch):
    """The chart had 8 colours for 9 buckets (``degraded`` was added to the buckets only):
    matplotlib cycled them, drawing productive in other's colour and degraded in
    productive's green, against the timeline's legend."""
    import matplotlib.axes

    from ray_goodput.goodput import BUCKETS, chart_png
    from ray_goodput.goodput._timeline import COLORS

    drawn = {}
    barh = matplotlib.axes.Axes.barh

    def recording(self, y, width, *args, color=None, **kwargs):
        drawn.update(zip(y, color))
        return barh(self, y, width, *args, color=color, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "barh", recording)
    chart_png(compute(_two_attempts(), job_start=95.0), str(tmp_path / "breakdown.png"))
    assert drawn == {b: COLORS[b] for b in BUCKETS}


def test_an_event_chunk_whose_read_failed_is_read_again_at_the_next_poll(s3_server, monkeypatch):
    """A chunk was marked read before its read: a read that failed (its retries spent on a
    flaky store) left its events out of every later poll of the job's one reader, so an
    end in it made the run "not finished" and its steps restart downtime."""
    from ray_goodput.errors import StorageError
    from ray_goodput.goodput import _events
    from ray_goodput.goodput._recorder import StepRecorder

    root = storage.resolve(s3_server.bucket_uri("flaky"))
    log = EventLog(root, rank=0, world_size=1)
    rec = StepRecorder(log)
    rec.step(1)
    rec.end()  # the end goes to the store at once, in a chunk of its own
    read = _events.read_bytes
    failed = []

    def flaky(location, rel, *args, **kwargs):
        if not failed:
            failed.append(rel)
            raise StorageError(f"read of {rel} failed after 6 attempt(s)")
        return read(location, rel, *args, **kwargs)

    monkeypatch.setattr(_events, "read_bytes", flaky)
    reader = EventReader(root)
    with pytest.raises(StorageError):
        reader.poll()
    events = reader.poll()[log.attempt]
    assert {e["e"] for e in events} >= {"start", "step", "end"}, events
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)
    log.close()
