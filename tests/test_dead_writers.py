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
import time
import uuid
from types import SimpleNamespace

import psutil
import pytest

from ray_goodput.checkpoint.uploader import _held
from ray_goodput.data import CacheConfig
from ray_goodput.data._cache_keeper import CacheKeeper
from ray_goodput.data._journal import JournalReader
from ray_goodput.runtime import pid_alive
from tests._helpers import dead_pid

LONG_AGO_S = 600  # before this process started: well past pid_alive's slack


def _set_back(path, seconds: float = LONG_AGO_S) -> None:
    t = psutil.Process().create_time() - seconds
    os.utime(path, (t, t))


@pytest.fixture
def node():
    node_id = f"test-{uuid.uuid4().hex}"
    yield node_id
    shutil.rmtree(_held.held_dir(node_id), ignore_errors=True)


def _job(pid: int, step: int) -> SimpleNamespace:
    # Stands in for a ShardJob: a held file needs its owner's pid, its key and its step.
    return SimpleNamespace(owner_pid=pid, key=f"job-{pid}-{step}", step=step)


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


def test_a_held_job_whose_pid_now_runs_a_later_process_is_taken_as_a_dead_workers(node):
    # Before: the live process under the pid kept the dead worker's save from ever being taken.
    _set_back(_held.hold(node, _job(os.getpid(), 3), None))

    assert [job.step for _, job, _ in _held.orphans(node)] == [3]


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
