"""The goodput ledger as pure functions: every second in exactly one bucket."""

from __future__ import annotations

import pytest

from ray_goodput.goodput import BUCKETS, compute


def _attempt(start, restored, steps, *, restore_s=1.0, step_s=1.0, fetch=0.1, ckpt=0.0, end=False):
    """Events of one attempt: start, restore, then `steps` (from restored+1), each step_s long."""
    t = start + 2.0  # process + model setup
    events = [{"e": "start", "t": start}, {"e": "restore", "step": restored, "t0": t, "t": t + restore_s}]
    t += restore_s
    for step in range(restored + 1, restored + 1 + steps):
        events.append({"e": "step", "step": step, "n": 1, "t0": t, "t": t + step_s, "fetch": fetch, "ckpt": ckpt})
        t += step_s
    if end:
        events.append({"e": "end", "t": t + 0.5})
    return events


def test_no_failure():
    a = _attempt(100.0, 0, 10, end=True)
    ledger = compute([a], job_start=95.0)
    assert ledger.total == pytest.approx(a[-1]["t"] - 95.0)
    assert sum(ledger.seconds.values()) == pytest.approx(ledger.total)
    assert ledger.seconds["startup"] == pytest.approx(5.0 + 2.0)
    assert ledger.seconds["restore"] == pytest.approx(1.0)
    assert ledger.seconds["productive"] == pytest.approx(10 * 0.9)
    assert ledger.seconds["data_stall"] == pytest.approx(10 * 0.1)
    assert ledger.seconds["lost"] == 0 and ledger.steps_lost == 0 and ledger.steps_kept == 10
    assert ledger.finished and ledger.failures == 0


def test_failure_splits_kept_lost_and_downtime():
    first = _attempt(100.0, 0, 15)  # reached step 15, died
    second = _attempt(first[-1]["t"] + 6.0, 10, 10, end=True)  # resumed from 10
    ledger = compute([second, first], job_start=100.0)  # order does not matter
    assert ledger.attempts == 2 and ledger.failures == 1
    assert ledger.steps_lost == 5 and ledger.steps_kept == 20
    assert ledger.work_steps == pytest.approx(20)  # 10 of the first attempt's 15, all 10 of the second
    assert ledger.seconds["lost"] == pytest.approx(5 * 0.9)
    assert ledger.seconds["productive"] == pytest.approx(20 * 0.9)
    assert ledger.seconds["restart_downtime"] == pytest.approx(6.0 + 2.0)
    assert ledger.seconds["restore"] == pytest.approx(2.0)
    assert sum(ledger.seconds.values()) == pytest.approx(ledger.total)
    assert ledger.goodput == pytest.approx(18.0 / ledger.total)


def test_coarse_events_are_split_at_the_resume_point():
    first = [
        {"e": "start", "t": 0.0},
        {"e": "step", "step": 10, "n": 10, "t0": 1.0, "t": 11.0, "fetch": 0.0, "ckpt": 0.5},
        {"e": "step", "step": 20, "n": 10, "t0": 11.0, "t": 21.0, "fetch": 0.0, "ckpt": 0.0},
    ]
    second = [
        {"e": "start", "t": 25.0},
        {"e": "restore", "step": 14, "t0": 26.0, "t": 27.0},
        {"e": "step", "step": 20, "n": 6, "t0": 27.0, "t": 33.0, "fetch": 0.0, "ckpt": 0.0},
    ]
    ledger = compute([first, second])
    assert ledger.seconds["lost"] == pytest.approx(6.0)  # steps 15..20 of the first attempt
    assert ledger.seconds["productive"] == pytest.approx(9.5 + 4.0 + 6.0)
    assert ledger.seconds["checkpoint_stall"] == pytest.approx(0.5)
    assert ledger.steps_lost == 6


def _rolled_back(events: list[dict], to: int, upto: int) -> list[dict]:
    """``events`` then a restore of step ``to`` (a rollback, 1 s), steps to ``upto`` (1 s
    each) and the end."""
    t = events[-1]["t"]
    events.append({"e": "restore", "step": to, "t0": t, "t": t + 1.0})
    t += 1.0
    for step in range(to + 1, upto + 1):
        events.append({"e": "step", "step": step, "n": 1, "t0": t, "t": t + 1.0, "fetch": 0.1, "ckpt": 0.0})
        t += 1.0
    events.append({"e": "end", "t": t})
    return events


def _rolled_back_attempt() -> list[dict]:
    """One attempt: steps 1 to 8, a restore of step 4 (a rollback), steps 5 to 10, the end."""
    return _rolled_back(_attempt(100.0, 0, 8), to=4, upto=10)


def test_steps_a_rollback_in_the_attempt_redid_are_lost_not_productive():
    """A run that rolls back inside its attempt (a loss spike: ``ckpt.restore`` of step 4
    after step 8) and steps again from there: the ledger took only the attempt's first
    restore as its resume, so steps 5 to 8 were productive twice and none was lost."""
    ledger = compute([_rolled_back_attempt()], job_start=100.0)
    assert ledger.steps_lost == 4 and ledger.steps_kept == 10
    assert ledger.work_steps == pytest.approx(10)
    assert ledger.seconds["lost"] == pytest.approx(4 * 0.9)
    assert ledger.seconds["productive"] == pytest.approx(10 * 0.9)
    assert ledger.seconds["restore"] == pytest.approx(2.0)
    assert sum(ledger.seconds.values()) == pytest.approx(ledger.total)


def test_a_rollback_in_a_later_attempt_below_its_resume_makes_the_earlier_attempts_steps_lost():
    """Attempt 1 reaches step 10 and dies; attempt 2 resumes from 10, then rolls back to 5
    and steps to 12. Steps 6 to 10 of attempt 1 were redone: lost, not kept (only each
    attempt's first restore was looked at). The job's kept steps are where it ended, 12."""
    first = _attempt(100.0, 0, 10)
    second = _rolled_back(_attempt(first[-1]["t"] + 5.0, 10, 0), to=5, upto=12)
    ledger = compute([first, second], job_start=100.0)
    assert ledger.steps_lost == 5 and ledger.steps_kept == 12
    assert ledger.work_steps == pytest.approx(12)
    assert ledger.seconds["lost"] == pytest.approx(5 * 0.9)


def test_a_rollback_with_no_step_after_it_keeps_the_steps_up_to_where_it_rolled_back():
    a = _attempt(100.0, 0, 8)
    t = a[-1]["t"]
    a += [{"e": "restore", "step": 4, "t0": t, "t": t + 1.0}, {"e": "end", "t": t + 2.0}]
    ledger = compute([a], job_start=100.0)
    assert ledger.steps_kept == 4 and ledger.steps_lost == 4


@pytest.mark.parametrize("n_attempts", [1, 2, 3, 5])
def test_buckets_always_sum_to_total(n_attempts):
    attempts, t, restored = [], 0.0, 0
    for i in range(n_attempts):
        a = _attempt(t, restored, 7 + i, ckpt=0.05, end=i == n_attempts - 1)
        attempts.append(a)
        t = a[-1]["t"] + 3.0
        restored += 4
    ledger = compute(attempts, job_start=-2.0)
    assert set(ledger.seconds) == set(BUCKETS)
    assert all(v >= 0 for v in ledger.seconds.values())
    assert sum(ledger.seconds.values()) == pytest.approx(ledger.total)


def test_empty():
    assert compute([]).total == 0 and compute([]).goodput == 0


def test_superseded_checkpoints_are_counted_in_the_ledger_and_its_metrics():
    first = _attempt(100.0, 0, 5)
    first.insert(3, {"e": "ckpt_superseded", "step": 2, "t": first[2]["t"] + 0.1})
    second = _attempt(first[-1]["t"] + 5.0, 0, 5, end=True)
    second.append({"e": "ckpt_superseded", "step": 4, "t": second[-1]["t"] + 0.1})
    ledger = compute([first, second], job_start=100.0)
    assert ledger.checkpoints_superseded == 2
    assert ledger.as_metrics()["goodput/checkpoints_superseded"] == 2
    assert sum(ledger.seconds.values()) == pytest.approx(ledger.total)


def test_failed_saves_and_the_recovery_points_age_are_in_the_ledger_and_its_metrics():
    run = _attempt(100.0, 0, 20, end=True)  # steps end at 103 + 20 = 123, the end event at 123.5
    run += [
        {"e": "recovery_point", "step": 2, "at": 105.0, "t": 105.5},
        {"e": "ckpt_failed", "step": 4, "t": 108.0},
        {"e": "ckpt_failed", "step": 6, "t": 110.0},
        {"e": "recovery_point", "step": 8, "at": 111.0, "t": 112.0},  # 7 s after step 2's state
        {"e": "recovery_point", "step": 12, "at": 115.0, "t": 115.3},
        {"e": "recovery_point", "step": 16, "at": 118.0, "t": 118.3},
        {"e": "recovery_point", "step": 18, "at": 121.0, "t": 121.2},
    ]
    run.sort(key=lambda e: e["t"])
    ledger = compute([run], job_start=100.0)
    assert ledger.checkpoints_failed == 2
    assert ledger.recovery_point_age_max_s == pytest.approx(7.0)  # the outage: 112 - 105
    assert ledger.recovery_point_age_s == pytest.approx(123.5 - 121.0)
    metrics = ledger.as_metrics()
    assert metrics["goodput/checkpoints_failed"] == 2 and metrics["goodput/recovery_point_age_max_s"] == 7.0
    assert "goodput/recovery_point_age_s" not in compute([_attempt(100.0, 0, 3)]).as_metrics()  # none committed


def test_steps_with_fewer_replicas_than_configured_count_their_missing_share_as_degraded():
    a = _attempt(100.0, 0, 10, end=True)
    for e in a:
        if e["e"] == "step" and 4 <= e["step"] <= 6:
            e["capacity"] = 0.5  # 1 of 2 replicas while the other was replaced
    ledger = compute([a], job_start=100.0)
    assert ledger.seconds["degraded"] == pytest.approx(3 * 0.9 * 0.5)
    assert ledger.seconds["productive"] == pytest.approx(10 * 0.9 - 3 * 0.9 * 0.5)
    assert sum(ledger.seconds.values()) == pytest.approx(ledger.total)
    assert ledger.steps_kept == 10 and ledger.failures == 0  # no restart: the job kept going
    assert ledger.work_steps == pytest.approx(7 + 3 * 0.5)
    assert ledger.as_metrics()["goodput/work_steps"] == pytest.approx(8.5)


def test_work_steps_do_not_grow_with_the_steps_duration_as_goodput_does():
    # Two jobs doing the same kept work with the same fixed costs, one with steps twice as
    # long: goodput (a share of time) is higher for the slower one, the work is the same.
    fast = compute([_attempt(100.0, 0, 10, end=True)], job_start=95.0)
    slow = compute([_attempt(100.0, 0, 10, step_s=2.0, end=True)], job_start=95.0)
    assert slow.goodput > fast.goodput
    assert slow.work_steps == fast.work_steps == pytest.approx(10)
    assert fast.work_steps / fast.total > slow.work_steps / slow.total


def test_a_replicas_wait_for_its_quorum_at_a_failure_and_its_uncommitted_step_are_not_productive():
    # Replica mode: the survivor's step that failed at a peer's death does not commit, and
    # its retry first waits in the quorum for the dead peer's heartbeat to time out. Before,
    # both sat in the next committed step's window and counted as productive work (half of
    # it, at 1 of 2 replicas): the survivors' stall at each failure raised goodput.
    a = _attempt(100.0, 0, 10, end=True)
    steps = [e for e in a if e["e"] == "step"]
    steps[0]["wait"] = 0.3  # the first quorum, waiting for every replica: start-up
    i = a.index(steps[5])
    t0 = steps[5]["t0"]
    failed = {"e": "uncommitted", "t0": t0, "t": t0 + 0.4}  # step 6's first try; its all-reduce failed
    a.insert(i, failed)
    for e in steps[5:]:  # everything after moves by the failed try and the wait
        e["t0"] += 0.4 + (1.2 if e is not steps[5] else 0.0)
        e["t"] += 0.4 + 1.2
    steps[5].update(wait=1.2, capacity=0.5)  # the retry, alone: 1.2 s in the quorum
    a[-1]["t"] += 1.6
    ledger = compute([a], job_start=100.0)

    assert ledger.seconds["lost"] == pytest.approx(0.4)
    assert ledger.seconds["restart_downtime"] == pytest.approx(1.2)
    assert ledger.seconds["startup"] == pytest.approx(2.0 + 0.3)
    assert ledger.seconds["productive"] + ledger.seconds["degraded"] == pytest.approx(10 * 0.9 - 0.3)
    assert sum(ledger.seconds.values()) == pytest.approx(ledger.total)
    assert ledger.steps_kept == 10 and ledger.steps_lost == 0 and ledger.failures == 0


def test_an_attempt_that_died_before_it_restored_does_not_make_the_steps_the_next_one_resumed_lost():
    """Attempt 2 died in its restore (a node lost, storage down): it wrote its start but no
    restore and no step. Attempt 3 resumed from step 10 of attempt 1: those 10 steps are
    kept, not lost because the attempt right after attempt 1 resumed nothing."""
    first = _attempt(100.0, 0, 15)
    died = [{"e": "start", "t": first[-1]["t"] + 5.0}]
    third = _attempt(died[-1]["t"] + 8.0, 10, 10, end=True)
    ledger = compute([first, died, third], job_start=100.0)
    assert (ledger.steps_kept, ledger.steps_lost) == (20, 5)
    assert ledger.work_steps == pytest.approx(20)
    assert ledger.seconds["productive"] == pytest.approx(20 * 0.9)
    assert ledger.seconds["lost"] == pytest.approx(5 * 0.9)
    assert sum(ledger.seconds.values()) == pytest.approx(ledger.total)
    # The run ended in such an attempt: the steps of the last attempt that got anywhere stay kept.
    ended = compute([first, died], job_start=100.0)
    assert (ended.steps_kept, ended.steps_lost) == (15, 0)


def test_steps_a_later_attempt_resumed_below_are_lost_not_counted_twice():
    """Attempt 3 resumed from step 50, below attempt 2's resume point (100): its pick was
    damaged and it fell back, or the node-local copy it had loaded was pruned. Attempt 1's
    steps 51-100 were computed again, so they are lost; the ledger took them as kept (only
    the next attempt's resume point counted), and counted 250 steps of work for 200.
    Lost: attempt 1's 51-100 and all of attempt 2's 101-150."""
    first = _attempt(100.0, 0, 100)
    second = _attempt(first[-1]["t"] + 5.0, 100, 50)
    third = _attempt(second[-1]["t"] + 5.0, 50, 150, end=True)
    ledger = compute([first, second, third], job_start=100.0)
    assert (ledger.steps_kept, ledger.steps_lost) == (200, 100)
    assert ledger.work_steps == pytest.approx(200)
    assert ledger.seconds["productive"] == pytest.approx(200 * 0.9)
    assert ledger.seconds["lost"] == pytest.approx(100 * 0.9)
    assert sum(ledger.seconds.values()) == pytest.approx(ledger.total)


def test_a_step_try_that_failed_before_the_attempts_first_step_is_counted_once():
    """The gap to an attempt's first step went to startup or restart downtime whole, and a
    failed try of a step inside it (replica 0's replacement restoring in its first quorum
    and dropping that step; a peer dying in the job's first step) went to lost as well:
    the buckets summed to more than the job's time."""
    attempt = [
        {"e": "start", "t": 0.0},
        {"e": "restore", "step": 5, "t0": 4.0, "t": 6.0},
        {"e": "uncommitted", "t0": 6.0, "t": 10.0},  # the step the restore happened in
        {"e": "step", "step": 6, "n": 1, "t0": 10.0, "t": 11.0},
        {"e": "end", "t": 11.0},
    ]
    ledger = compute([attempt], job_start=0.0)
    assert sum(ledger.seconds.values()) == pytest.approx(ledger.total) == pytest.approx(11.0)
    assert ledger.seconds["startup"] == pytest.approx(4.0)
    assert ledger.seconds["restore"] == pytest.approx(2.0) and ledger.seconds["lost"] == pytest.approx(4.0)
    from ray_goodput.goodput._timeline import spans

    drawn: dict[str, float] = {}
    for s in spans([attempt], job_start=0.0):
        drawn[s.bucket] = drawn.get(s.bucket, 0.0) + s.end - s.start
    assert drawn == pytest.approx({k: v for k, v in ledger.seconds.items() if v})


def test_status_gives_a_finished_runs_recovery_point_age_at_its_end_not_now(tmp_path):
    """``ray-goodput status --run`` aged the recovery point of a run that had finished up to
    the moment it was asked, and labelled that "at the run's end": a day later it said
    86,400 s old."""
    import time

    import pyarrow.fs as pafs

    from ray_goodput.cli._status import checkpoint_lines
    from ray_goodput.goodput._events import EventLog
    from ray_goodput.storage import StorageLocation

    root = str(tmp_path / "run")
    log = EventLog(StorageLocation(uri=root, fs=pafs.LocalFileSystem(), root=root), rank=0, world_size=1)
    t = time.time() - 1.0  # a run that ended just now, asked about a day later
    log.emit("start", t=t - 15.0)
    log.emit("step", step=1, n=1, t0=t - 15.0, t=t - 5.0)
    log.emit("recovery_point", step=1, at=t - 5.0, t=t - 3.0)
    log.emit("end", t=t)
    log.close()
    (line,) = checkpoint_lines(root, now=t + 86400.0)
    age = int(line.split("recovery point ")[1].split(" s old")[0])
    assert 5 <= age < 60 and "old at the run's end" in line, line  # its end: the last event (close's)
