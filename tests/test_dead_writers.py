"""Files left by processes that died, as the node services find them: the uploader's look
for dead workers' held jobs (``checkpoint/uploader/_held.py``), the cache's journals and
fetch temps (``data/_journal.py``, ``data/_cache_keeper.py``), all through
``runtime.pid_alive``. Real processes and files; the held jobs' use end to end (a worker
killed before its uploader answered) is in test_uploader_faults.

A pid comes round again: a later process can run under a dead writer's pid. Each test of
that case sets a file's time back to long before this process started, which is what a
service sees when the process under the writer's pid is a later one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from ray_goodput.checkpoint.save._arena_files import claim
from ray_goodput.checkpoint.uploader import _held
from ray_goodput.data import CacheConfig
from ray_goodput.data._cache_keeper import CacheKeeper
from ray_goodput.data._journal import JournalReader
from ray_goodput.runtime import pid_alive
from tests._helpers import dead_pid

LONG_AGO_S = 600  # before this process started: well past pid_alive's slack

# A process that takes a node's orphaned held jobs, begins each (claims its snapshot, as an
# uploader does before it reads one), prints their steps and exits: an uploader that died
# in the middle of them.
TAKE_AND_DIE = """
import sys
from ray_goodput.checkpoint.save import _arena_files
from ray_goodput.checkpoint.uploader import _held
taken = _held.orphans(sys.argv[1])
for _, job, _ in taken:
    assert _arena_files.claim(job.arena_path, job.key)
print(*[job.step for _, job, _ in taken])
"""


def _set_back(path, seconds: float = LONG_AGO_S) -> None:
    t = psutil.Process().create_time() - seconds
    os.utime(path, (t, t))


@pytest.fixture
def node():
    node_id = f"test-{uuid.uuid4().hex}"
    yield node_id
    shutil.rmtree(_held.held_dir(node_id), ignore_errors=True)


def _job(pid: int, step: int, arena: Path | None = None) -> SimpleNamespace:
    # Stands in for a ShardJob: a held file needs its owner's pid, its key, its step and its
    # snapshot arena (none: no tensors).
    return SimpleNamespace(
        owner_pid=pid,
        key=f"job-{pid}-{step}",
        step=step,
        slots=(1,) if arena else (),
        arena_path=str(arena or ""),
    )


def test_pid_alive_since_tells_the_process_that_wrote_a_file_from_a_later_one_with_its_pid():
    started = psutil.Process().create_time()
    assert pid_alive(os.getpid())
    assert pid_alive(os.getpid(), since=time.time())  # this process ran then
    assert not pid_alive(os.getpid(), since=started - LONG_AGO_S)  # long before it started
    assert not pid_alive(dead_pid(), since=time.time())


def test_the_held_jobs_of_a_dead_worker_are_taken_oldest_first_and_a_live_workers_are_left(node):
    dead = dead_pid()
    _held.hold(node, _job(dead, 9), None)
    _held.hold(node, _job(dead, 4), None)
    mine = _held.hold(node, _job(os.getpid(), 5), None)

    taken = _held.orphans(node)

    assert [job.step for _, job, _ in taken] == [4, 9]
    assert all(path.suffix == ".taken" and path.exists() for path, _, _ in taken)
    assert mine.exists()
    assert _held.orphans(node) == []  # each is taken once


def test_the_pending_held_jobs_are_the_live_workers_jobs_nobody_took(node):
    """What a wait for a run's uploads must also wait for: a save a live worker (maybe in
    its teardown) still holds, not yet handed over. A dead worker's is the look's to take."""
    mine = _held.hold(node, _job(os.getpid(), 5), b"root")
    _held.hold(node, _job(dead_pid(), 9), None)
    assert [(job.step, root) for job, root in _held.pending(node)] == [(5, b"root")]
    _held.remove(mine, _job(os.getpid(), 5))  # handed over
    assert _held.pending(node) == []


def test_a_held_job_whose_pid_now_runs_a_later_process_is_taken_as_a_dead_workers(node):
    # Before: the live process under the pid kept the dead worker's save from ever being taken.
    _set_back(_held.hold(node, _job(os.getpid(), 3), None))

    assert [job.step for _, job, _ in _held.orphans(node)] == [3]


def test_a_held_job_whose_uploader_died_in_the_middle_of_it_is_taken_again_and_runs(node, tmp_path):
    # Before: the taker's rename to .taken hid the job from every later look, and the claim
    # it had made on the snapshot would have read as the worker's (superseded): a save that
    # had returned was lost with the uploader that took it.
    arena = tmp_path / "rank-00000-1-0-0.arena"
    arena.write_bytes(b"x")
    job = _job(dead_pid(), 7, arena)
    _held.hold(node, job, None)
    taker = subprocess.run(
        [sys.executable, "-c", TAKE_AND_DIE, node], capture_output=True, text=True, timeout=120, check=False
    )
    assert taker.returncode == 0, taker.stderr
    assert taker.stdout.split() == ["7"]  # that process took it, began it and exited

    again = _held.orphans(node)

    assert [j.step for _, j, _ in again] == [7]
    assert claim(arena, job.key)  # its snapshot is this uploader's to read
    assert _held.orphans(node) == []  # this live process holds it now


def test_a_dead_workers_held_job_it_had_superseded_is_dropped_not_run(node, tmp_path):
    # Its arena holds the newer save's snapshot. Dropped when first taken, it can never be
    # taken again after a taker's death, where the claim found is removed as the taker's.
    arena = tmp_path / "rank-00000-1-0-0.arena"
    arena.write_bytes(b"x")
    job = _job(dead_pid(), 3, arena)
    _held.hold(node, job, None)
    assert claim(arena, job.key)  # the worker claimed the waiting job's snapshot for a newer save

    assert _held.orphans(node) == []
    assert list(_held.held_dir(node).iterdir()) == []


def test_a_job_taken_by_a_live_uploader_is_not_run_again_by_its_worker_or_another_look(node):
    dead = dead_pid()
    job = _job(dead, 2)
    _held.hold(node, job, None)
    [(path, _, _)] = _held.orphans(node)

    assert not _held.take(node, job)  # the same job handed over by its worker is a duplicate
    assert _held.orphans(node) == []
    _held.remove(path, job)
    assert list(_held.held_dir(node).iterdir()) == []


def test_held_jobs_left_under_a_node_gone_for_an_hour_are_swept_and_recent_ones_kept(node):
    # Before: a node's held jobs stayed in /tmp for ever once no uploader of that node came up.
    gone_node = f"{node}-gone"
    old = _held.hold(gone_node, _job(dead_pid(), 1), None)
    _set_back(old, _held.OTHER_NODE_SWEEP_AGE_S + LONG_AGO_S)
    recent_node = f"{node}-recent"
    recent = _held.hold(recent_node, _job(dead_pid(), 2), None)
    mine = _held.hold(node, _job(dead_pid(), 3), None)
    _set_back(mine, _held.OTHER_NODE_SWEEP_AGE_S + LONG_AGO_S)
    try:
        _held.sweep_other_nodes(node)

        assert not _held.held_dir(gone_node).exists()
        assert recent.exists()  # an uploader of that node may still come up and take it
        assert mine.exists()  # this node's own: its uploader takes it
    finally:
        shutil.rmtree(_held.held_dir(recent_node), ignore_errors=True)
        shutil.rmtree(_held.held_dir(gone_node), ignore_errors=True)


def test_the_journal_of_a_reader_whose_pid_now_runs_a_later_process_is_read_then_removed(tmp_path):
    gone = tmp_path / f"{os.getpid()}-0000aaaa.log"
    gone.write_text("h 3\nm 1\n")
    _set_back(gone)
    live = tmp_path / f"{os.getpid()}-0000bbbb.log"
    live.write_text("h 2\n")

    hits, misses, _ = JournalReader(tmp_path).poll()

    assert (hits, misses) == (5, 1)  # both read to the end
    assert not gone.exists()  # its writer is gone: nothing more will come
    assert live.exists()


def test_a_fetch_temp_whose_pid_now_runs_a_later_process_is_deleted_at_the_cache_scan(tmp_path):
    keeper = CacheKeeper(CacheConfig(directory=str(tmp_path), capacity_bytes=1 << 20))
    sub = keeper.layout.root / "data" / "ab"
    sub.mkdir(parents=True, exist_ok=True)
    gone = sub / f".abcd.part-{os.getpid()}-0"
    gone.write_bytes(b"partial")
    _set_back(gone)
    live = sub / f".abce.part-{os.getpid()}-1"
    live.write_bytes(b"partial")

    try:
        keeper._scan(index=False)
    finally:
        keeper.close(timeout_s=10)

    assert not gone.exists()
    assert live.exists()


def test_held_jobs_live_in_this_users_private_directory_and_are_never_read_from_another(node):
    """The node uploader unpickles the held jobs it takes. They lived in
    ``$TMPDIR/ray_goodput/held``, shared by the node's users: anyone who could write there
    could have a pickle of theirs loaded by our uploader."""
    from ray_goodput.runtime._private_dirs import is_private

    path = _held.hold(node, _job(dead_pid(), 6), None)
    root = _held.held_dir(node).parent
    assert is_private(root) and root.stat().st_uid == os.getuid()
    root.chmod(0o777)  # as if someone else had made it, or opened it up
    try:
        assert _held.orphans(node) == []
        assert path.exists()  # not taken, not read
    finally:
        root.chmod(0o700)
    assert [job.step for _, job, _ in _held.orphans(node)] == [6]
