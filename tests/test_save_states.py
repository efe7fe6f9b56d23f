"""The save state machine and the Checkpointer's bookkeeping, fast: transitions, agreement
across ranks, supersede and failure handling against a fake UploadBackend (futures the
test completes by hand), and the fault hooks. The real-process counterparts are in
test_crash_consistency.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import Future

import pytest
import torch

from ray_goodput import Checkpointer, _faults
from ray_goodput.checkpoint._outcomes import AGE_FLOOR_S, AGE_INTERVALS
from ray_goodput.checkpoint.save._arena_files import claim, drop_claim
from ray_goodput.checkpoint.save._handoff import Handoff
from ray_goodput.checkpoint.save._save_state import IllegalTransitionError, SaveRecord, SaveState, agree
from ray_goodput.checkpoint.uploader._shard_job import ShardJob, ShardResult
from ray_goodput.errors import CheckpointError, ConfigError, InjectedFault, RecoveryPointTooOldError

S = SaveState


# ---- the machine -----------------------------------------------------------------------


def test_a_save_walks_snapshotted_staged_uploaded_committed():
    record = SaveRecord(1, "g000001-abcdef0123")
    for state in (S.STAGED, S.UPLOADED, S.COMMITTED):
        record.advance(state)
    assert record.history == [S.SNAPSHOTTED, S.STAGED, S.UPLOADED, S.COMMITTED]
    assert record.state.terminal


@pytest.mark.parametrize(
    "path",
    [
        [S.COMMITTED],  # cannot commit before it is uploaded
        [S.STAGED, S.SUPERSEDED, S.UPLOADED],  # given way to a newer save (storage out): over
        [S.STAGED, S.UPLOADED, S.COMMITTED, S.FAILED],  # terminal states stay put
        [S.SUPERSEDED, S.STAGED],
    ],
)
def test_illegal_transitions_raise(path):
    record = SaveRecord(1, "x")
    with pytest.raises(IllegalTransitionError):
        for state in path:
            record.advance(state, "boom" if state is S.FAILED else None)


def test_failed_needs_an_error_and_only_failed_takes_one():
    with pytest.raises(IllegalTransitionError):
        SaveRecord(1, "x").advance(S.FAILED)
    with pytest.raises(IllegalTransitionError):
        SaveRecord(1, "x").advance(S.STAGED, "why")
    record = SaveRecord(1, "x")
    record.advance(S.FAILED, "disk full")
    assert record.error == "disk full"


def test_reach_takes_the_implied_path():
    record = SaveRecord(1, "x")
    record.reach(S.COMMITTED)
    assert record.history == [S.SNAPSHOTTED, S.STAGED, S.UPLOADED, S.COMMITTED]
    record = SaveRecord(2, "y")
    record.reach(S.SUPERSEDED)
    assert record.history == [S.SNAPSHOTTED, S.SUPERSEDED]


@pytest.mark.parametrize(
    "states,outcome",
    [
        ([S.UPLOADED, S.COMMITTED], S.COMMITTED),
        ([S.SUPERSEDED, S.UPLOADED], S.SUPERSEDED),  # can never commit; not a failure
        ([S.FAILED, S.SUPERSEDED], S.FAILED),
        ([S.UPLOADED, S.UPLOADED], None),  # the caller decides (did not commit)
        ([S.UPLOADED], None),
    ],
)
def test_every_rank_agrees_on_the_outcome(states, outcome):
    assert agree(states) is outcome
    assert agree(list(reversed(states))) is outcome


# ---- the Checkpointer against a fake backend -------------------------------------------


class FakeBackend:
    """Accepts jobs; the test decides when each starts, is released and ends. A job
    starts as the uploader's lane starts one: it claims its snapshot first, and ends
    superseded when its worker claimed it before (``_arena_files.claim``)."""

    def __init__(self) -> None:
        self.jobs: dict[int, ShardJob] = {}
        self.handoffs: dict[int, Handoff] = {}

    def submit(self, job: ShardJob) -> Handoff:
        handoff = Handoff(released=Future(), durable=Future(), key=job.key)
        self.jobs[job.step], self.handoffs[job.step] = job, handoff
        return handoff

    def start(self, step: int, release: bool = True) -> bool:
        """False (and the job ended superseded) when its worker had claimed it."""
        job = self.jobs[step]
        if not claim(job.arena_path, job.key):
            self.end(step, S.SUPERSEDED)
            return False
        if release:
            self.handoffs[step].released.set_result(None)
        return True

    def end(self, step: int, state: SaveState = S.COMMITTED, error: Exception | None = None) -> None:
        handoff = self.handoffs[step]
        drop_claim(self.jobs[step].arena_path, self.jobs[step].key)  # as the lane does when a job ends
        if not handoff.released.done():
            handoff.released.set_result(None)
        if error is not None:
            handoff.durable.set_exception(error)
        else:
            handoff.durable.set_result(
                ShardResult(step=step, rank=0, num_bytes=1, write_seconds=0.0, upload_seconds=0.0, state=state)
            )

    def close(self) -> None:
        for job in self.jobs.values():  # the jobs it never ended: an uploader would end them
            drop_claim(job.arena_path, job.key)


def _state() -> dict:
    return {"model": torch.nn.Linear(8, 8)}


@pytest.fixture
def fake(tmp_path):
    backend = FakeBackend()
    ckpt = Checkpointer(str(tmp_path / "root"), staging_dir=str(tmp_path / "s"), uploader=backend)
    yield ckpt, backend
    ckpt._release()


def test_a_third_save_supersedes_the_waiting_one_without_asking_the_uploader(fake):
    # It asked the uploader to cancel the waiting job and waited for the answer and the
    # arena's release: 1.48-2.37 s per save with a busy uploader. Here the backend answers
    # nothing until the test says: save 3 must return on the worker's decision alone.
    ckpt, backend = fake
    ckpt.save(1, _state())
    assert backend.start(1, release=False)  # step 1 is being written: its arena is busy
    ckpt.save(2, _state())  # waits in the second arena
    ckpt.save(3, _state())  # both busy: the worker claims 2's snapshot, 3 takes its arena
    assert not backend.handoffs[2].durable.done()  # the uploader has not been asked
    assert backend.jobs[3].arena_path == backend.jobs[2].arena_path != backend.jobs[1].arena_path
    backend.end(1)
    assert not backend.start(2)  # the lane comes to 2: its worker claimed it, nothing is read
    assert backend.handoffs[2].durable.result().state is S.SUPERSEDED
    assert backend.start(3)
    backend.end(3)
    ckpt.wait()
    assert ckpt.stats.committed == [1, 3] and ckpt.stats.superseded == [2]
    assert ckpt.stats.failed_saves == 0


def test_a_failed_save_is_raised_once_by_wait(fake):
    ckpt, backend = fake
    ckpt.save(1, _state())
    backend.end(1, error=OSError("bucket gone"))
    with pytest.raises(CheckpointError, match="bucket gone"):
        ckpt.wait()
    ckpt.wait()  # reported once
    assert ckpt.stats.failed_saves == 1


def test_an_older_failed_save_left_behind_by_a_newer_commit_is_counted_not_raised(fake):
    """A storage outage that fails one background save must not end a run whose later
    saves commit (it ended the run at close(), with a committed newest step)."""
    ckpt, backend = fake
    ckpt.save(1, _state())
    backend.end(1, error=OSError("outage"))
    ckpt.save(2, _state())
    backend.end(2)
    ckpt.wait()  # the newest committed: nothing to raise
    ckpt.close()
    assert ckpt.stats.failed_saves == 1 and "outage" in ckpt.stats.last_error
    assert ckpt.stats.committed == [2] and ckpt.stats.recovery_step == 2


def test_an_older_save_settled_after_a_newer_commit_does_not_set_the_recovery_step_back(fake):
    """A sync settles a committed step while an older one still runs (a rank's outcome
    that comes late, by the actor-call path); the older one settled later set
    stats.recovery_step back to itself until the next commit."""
    ckpt, backend = fake
    ckpt.save(1, _state())
    assert backend.start(1)  # still uploading
    ckpt.save(2, _state())
    assert backend.start(2)
    backend.end(2)
    ckpt._resolve(block=False)
    assert ckpt.stats.committed == [2] and ckpt.stats.recovery_step == 2
    backend.end(1)  # committed late
    ckpt.wait()
    assert ckpt.stats.committed == [2, 1] and ckpt.stats.recovery_step == 2


def _superseded_on_one_rank_while_the_other_commits(rank: int, world_size: int, root: str, staging: str) -> dict:
    backend = FakeBackend()
    ckpt = Checkpointer(root, staging_dir=f"{staging}/{rank}", uploader=backend, sync_every=1)
    try:
        ckpt.save(1, _state())
        if rank == 0:  # marker written, then an outage in its commit: it gave way to a newer save
            backend.end(1, S.SUPERSEDED)
        else:
            backend.start(1)  # still uploading
        ckpt.save(2, _state())  # a sync: step 1 is superseded on rank 0, running on rank 1
        if rank == 1:  # it finds every rank's marker and commits step 1
            backend.end(1)
        backend.end(2)
        ckpt.wait()
        return {"committed": ckpt.stats.committed, "superseded": ckpt.stats.superseded}
    finally:
        ckpt._release()
        backend.close()


def test_a_step_one_rank_gave_up_on_is_not_settled_while_another_rank_may_still_commit_it(tmp_path):
    """A rank's job gives way to a newer save when storage goes out after its marker was
    written, and the step can still commit: another rank's job sees every marker and writes
    COMMITTED. A sync while that job ran settled the step as superseded on every rank: a
    commit never reported to Ray Train, nor counted in the recovery point (or, had the
    giving-up rank failed, "the newest checkpoint save failed" raised for a committed
    save). Real gloo between two ranks; the uploads are the fake backend's."""
    from ray_goodput.testing import run_world

    out = run_world(
        _superseded_on_one_rank_while_the_other_commits, 2, str(tmp_path / "root"), str(tmp_path / "s"), timeout_s=240
    )
    assert out == [{"committed": [1, 2], "superseded": []}] * 2, out


def test_a_save_that_failed_with_its_own_timeout_error_is_not_reported_as_the_wait_running_out(fake):
    """On Python 3.11 ``concurrent.futures.TimeoutError`` is ``TimeoutError``: a job that
    failed with one (the uploader's own wait for its result ran out) was reported as this
    wait's bound, naming ``wait_timeout_s``, and its real cause was lost."""
    ckpt, backend = fake
    ckpt.save(1, _state())
    backend.end(1, error=TimeoutError("the uploader's wait for step 1 ran out"))
    with pytest.raises(CheckpointError, match="the uploader's wait for step 1 ran out") as raised:
        ckpt.wait()
    assert "wait_timeout_s" not in str(raised.value)


def test_the_newest_save_failing_is_raised_by_close(fake):
    ckpt, backend = fake
    ckpt.save(1, _state())
    backend.end(1)
    ckpt.save(2, _state())
    backend.end(2, error=OSError("outage at the end"))
    with pytest.raises(CheckpointError, match="newest checkpoint save failed.*outage at the end"):
        ckpt.close()


def test_a_recovery_point_older_than_its_bound_is_raised_at_the_next_sync_naming_age_storage_and_error(tmp_path):
    backend = FakeBackend()
    ckpt = Checkpointer(
        str(tmp_path / "root"),
        staging_dir=str(tmp_path / "s"),
        uploader=backend,
        sync_every=2,
        max_recovery_point_age_s=0.5,
    )
    try:
        ckpt.save(1, _state())
        backend.end(1)
        ckpt.save(2, _state())  # no sync yet (every 2nd save)
        backend.end(2, error=OSError("bucket unreachable"))
        time.sleep(0.6)  # step 1 (the recovery point) is now older than the bound
        assert ckpt.recovery_point_age_s > 0.5
        with pytest.raises(RecoveryPointTooOldError) as err:
            ckpt.save(3, _state())  # the 2nd save syncs: outcomes agreed, the bound checked
        text = str(err.value)
        age = float(re.search(r"\(committed step 1\) is (\d+\.\d) s old, over the bound of 0\.5 s", text).group(1))
        assert age >= 0.5, text
        assert str(tmp_path / "root") in text and "bucket unreachable" in text
        assert "max_recovery_point_age_s" in text
        assert ckpt.stats.recovery_step == 1 and ckpt.stats.recovery_point_age_s > 0.5
    finally:
        ckpt._release()


def test_the_default_recovery_point_bound_follows_the_save_interval(fake):
    ckpt, backend = fake
    assert ckpt._outcomes.bound_s == AGE_FLOOR_S  # no interval measured yet
    ckpt.save(1, _state())
    ckpt._outcomes.pending[1].saved_at -= 2 * AGE_FLOOR_S  # as if saved long ago
    ckpt._outcomes._first_save_at = ckpt._outcomes.pending[1].saved_at
    ckpt.save(2, _state())
    assert ckpt._outcomes.bound_s == pytest.approx(AGE_INTERVALS * 2 * AGE_FLOOR_S, rel=0.01)
    with pytest.raises(ConfigError, match="max_recovery_point_age_s"):
        Checkpointer(str(ckpt.root.uri), uploader=backend, max_recovery_point_age_s=0)


def test_an_auto_interval_learns_each_saves_time_to_durable_from_its_commit(tmp_path):
    backend = FakeBackend()
    ckpt = Checkpointer(str(tmp_path / "root"), staging_dir=str(tmp_path / "s"), uploader=backend, every="auto")
    try:
        ckpt.save(1, _state())
        saved_at = ckpt._outcomes.pending[1].saved_at
        result = ShardResult(
            step=1,
            rank=0,
            num_bytes=1,
            write_seconds=0.0,
            upload_seconds=0.0,
            state=S.COMMITTED,
            committed_at=saved_at + 5.0,
        )
        backend.handoffs[1].released.set_result(None)
        backend.handoffs[1].durable.set_result(result)
        ckpt.wait()
        assert ckpt._schedule._auto.durable_s == pytest.approx(5.0)  # what the interval waits out
    finally:
        ckpt._release()


def test_durable_everywhere_but_never_committed_is_a_failure(fake):
    ckpt, backend = fake
    ckpt.save(1, _state())
    backend.end(1, S.UPLOADED)
    with pytest.raises(CheckpointError, match="did not commit"):
        ckpt.wait()


def test_a_submit_that_raises_is_a_failed_save_not_a_crash_of_save(fake, monkeypatch):
    ckpt, backend = fake

    def refuse(job):
        raise OSError("uploader unreachable")

    monkeypatch.setattr(backend, "submit", refuse)
    ckpt.save(1, _state())  # returns: the failure is agreed and raised by wait()
    with pytest.raises(CheckpointError, match="uploader unreachable"):
        ckpt.wait()


# ---- fault hooks -------------------------------------------------------------------------


def test_fault_spec_errors_name_the_fix():
    assert _faults.parse("retention:0.5, save.copying:1:raise") == {
        "retention": (0.5, "kill"),
        "save.copying": (1.0, "raise"),
    }
    for bad in ("nosuch:1", "retention", "retention:2", "retention:1:explode"):
        with pytest.raises(ConfigError, match="RAY_GOODPUT_FAULT"):
            _faults.parse(bad)


def test_fault_point_raises_when_asked_and_is_silent_when_unset(monkeypatch):
    _faults.fault_point("retention")  # unset: nothing
    # Armed inside the running process: read again because the variable changed.
    monkeypatch.setenv("RAY_GOODPUT_FAULT", "retention:1:raise")
    with pytest.raises(InjectedFault, match="retention"):
        _faults.fault_point("retention")
    _faults.fault_point("save.copying")  # another point: nothing
    monkeypatch.setenv("RAY_GOODPUT_FAULT", "retention:0:raise")
    _faults.fault_point("retention")  # disarmed


def test_fault_point_kill_sigkills_the_process():
    env = {**os.environ, "RAY_GOODPUT_FAULT": "commit.before_committed:1", "RAY_GOODPUT_FAULT_SEED": "3"}
    code = "from ray_goodput._faults import fault_point; fault_point('commit.before_committed'); print('alive')"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == -9 and "alive" not in out.stdout, (out.returncode, out.stderr[-500:])
