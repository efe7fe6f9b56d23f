"""The node cache's files, keeper and listing in one process, on local files: what the
cache serves, what it evicts and which files a directory source holds. The cache actor,
its readers in other processes and S3 are tests/test_data_cache.py's."""

from __future__ import annotations

import os

from ray_goodput.data import CacheConfig, FileDataset
from ray_goodput.data._cache_files import CacheLayout
from ray_goodput.data._cache_keeper import CacheKeeper
from ray_goodput.data._file_readers import CacheReader
from ray_goodput.testing import wait_for


def _source(tmp_path, sizes: dict[str, int]) -> str:
    src = tmp_path / "src"
    src.mkdir()
    for name, size in sizes.items():
        (src / name).write_bytes(os.urandom(size))
    return str(src)


def _one_file(tmp_path, size: int) -> tuple[FileDataset, CacheLayout]:
    """A source of one file, ``a.bin`` of ``size`` bytes, read through a node cache of 1 MiB
    under ``tmp_path/cache`` (its directories made)."""
    cfg = CacheConfig(directory=str(tmp_path / "cache"), capacity_bytes=1 << 20)
    ds = FileDataset(_source(tmp_path, {"a.bin": size}), cache=cfg)
    layout = CacheLayout.of(cfg)
    layout.create()
    return ds, layout


def test_a_cache_file_cut_short_is_fetched_again_not_served(tmp_path):
    # A cache file renamed into place without an fsync can come back empty or cut short
    # after the host crashed; a hit was open() + read(), so every later run read the cut
    # file (a Parquet file failing to decode for good, a sample silently truncated).
    ds, layout = _one_file(tmp_path, 1000)
    cut = layout.data_path(ds.files.cache_key(0))
    cut.parent.mkdir(parents=True, exist_ok=True)
    cut.write_bytes(b"0123456789")
    reader = CacheReader(layout, 1 << 20)
    assert reader.read(ds.files, 0) == (tmp_path / "src" / "a.bin").read_bytes()
    assert cut.stat().st_size == 1000  # the cache holds the whole file again


def test_a_file_larger_than_the_cache_evicts_nothing(tmp_path):
    # The keeper made room for it before learning it could never fit: every file of the
    # node's cache went, those other ranks were about to read included, twice.
    src = _source(tmp_path, {**{f"f{i}.bin": 100 for i in range(5)}, "huge.bin": 2000})
    cfg = CacheConfig(directory=str(tmp_path / "cache"), capacity_bytes=1000)
    ds = FileDataset(src, cache=cfg)
    keeper = CacheKeeper(cfg)
    small = [i for i, p in enumerate(ds.files.paths) if not p.endswith("huge.bin")]
    fid = keeper.register(ds.files)
    keeper.prefetch(fid, small)
    wait_for(lambda: keeper.stats()["files"] == 5, timeout_s=30, what="the five small files cached")
    keeper.prefetch(fid, [next(i for i, p in enumerate(ds.files.paths) if p.endswith("huge.bin"))])
    wait_for(lambda: keeper.stats()["inflight"] == 0, timeout_s=30, what="the large file's prefetch to end")
    stats = keeper.stats()
    assert stats["evictions"] == 0 and stats["files"] == 5, stats
    assert any("capacity" in e for e in keeper.errors), keeper.errors


def test_a_file_of_unknown_size_found_larger_than_the_cache_evicts_nothing(tmp_path):
    # A list of file URIs carries no sizes: the download found the file too large, and
    # the keeper took that CacheFullError for a full disk, evicted a file other ranks
    # were about to read and downloaded the file again, to fail the same way.
    src = _source(tmp_path, {**{f"f{i}.bin": 100 for i in range(5)}, "huge.bin": 2000})
    cfg = CacheConfig(directory=str(tmp_path / "cache"), capacity_bytes=1000)
    ds = FileDataset([f"{src}/{name}" for name in sorted(os.listdir(src))], cache=cfg)
    assert set(ds.files.sizes) == {-1}
    keeper = CacheKeeper(cfg)
    huge = next(i for i, p in enumerate(ds.files.paths) if p.endswith("huge.bin"))
    fid = keeper.register(ds.files)
    keeper.prefetch(fid, [i for i in range(len(ds.files.paths)) if i != huge])
    wait_for(lambda: keeper.stats()["files"] == 5, timeout_s=30, what="the five small files cached")
    keeper.prefetch(fid, [huge])
    wait_for(lambda: keeper.stats()["inflight"] == 0, timeout_s=30, what="the large file's prefetch to end")
    stats = keeper.stats()
    assert stats["evictions"] == 0 and stats["files"] == 5, stats
    assert any("capacity" in e for e in keeper.errors), keeper.errors


def test_files_under_hidden_or_underscore_folders_of_a_source_are_skipped(tmp_path):
    # Only the file's own name was tested: a writer's staging folder (Spark's _temporary/,
    # Hive's .hive-staging*/) inside the source was listed, so ranks listing while it wrote
    # could see different files. A folder above the source may be named so.
    root = tmp_path / "_jobs" / "data"
    for rel in ("a.bin", "sub/b.bin", "_temporary/0/c.bin", ".hive-staging_1/d.bin", "sub/_x/e.bin", "sub/.f.bin"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    ds = FileDataset(str(root))
    assert [os.path.relpath(p, root) for p in ds.files.paths] == ["a.bin", "sub/b.bin"]


def test_a_fetch_stuck_behind_a_hung_lock_holder_raises_naming_it(tmp_path):
    # The key's flock was waited for without a bound: a process stopped while it held
    # the lock (SIGSTOP, a hung mount) froze every reader of the key on the node, and
    # the training loop with them, forever.
    import multiprocessing
    import time

    import pytest

    from ray_goodput.data import _cache_files
    from ray_goodput.errors import CacheLockTimeoutError
    from ray_goodput.storage import RetryPolicy

    ds, layout = _one_file(tmp_path, 100)
    key = ds.files.cache_key(0)
    ctx = multiprocessing.get_context("spawn")
    locked, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(layout.lock_path(key)), locked, release))
    holder.start()
    try:
        assert locked.wait(60), "the holder process never took the lock"
        began = time.monotonic()
        with pytest.raises(CacheLockTimeoutError) as err:
            _cache_files.fetch(
                layout, key, ds.files.fs, ds.files.paths[0], max_bytes=1 << 20, policy=RetryPolicy(), lock_wait_s=0.5
            )
        assert time.monotonic() - began < 30
        assert str(layout.lock_path(key)) in str(err.value) and f"pid {holder.pid}" in str(err.value)
        assert ds.files.paths[0] in str(err.value)
        assert not layout.data_path(key).exists()
        release.set()
        holder.join(30)
        # once the holder is gone the same fetch goes through
        got = _cache_files.fetch(layout, key, ds.files.fs, ds.files.paths[0], max_bytes=1 << 20, policy=RetryPolicy())
        assert got is not None and got[0] == 100
    finally:
        release.set()
        holder.join(30)
        if holder.is_alive():
            holder.kill()


def _hold_lock(path: str, locked, release) -> None:
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    locked.set()
    release.wait(120)


def test_each_cache_reader_of_a_process_does_not_leak_a_journal_file_handle(tmp_path):
    # Every CacheReader (one per DataLoader with num_workers=0, e.g. one per epoch) opened
    # its own journal file and kept it open, with an exit finalizer holding it, for the
    # life of the process: a job that built a loader per epoch ran out of descriptors.
    ds, layout = _one_file(tmp_path, 10)

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    CacheReader(layout, 1 << 20).read(ds.files, 0)  # the miss, and the process's journal
    before = fds()
    for _ in range(50):
        CacheReader(layout, 1 << 20).read(ds.files, 0)
    assert fds() - before <= 2, f"{fds() - before} descriptors more after 50 readers"
    assert len(list(layout.journal_dir.glob(f"{os.getpid()}-*.log"))) == 1


def test_a_loader_worker_that_exits_abruptly_still_reports_what_it_fetched(tmp_path):
    # Fetches were buffered with the hit counts and written at most once a second: a
    # loader worker ended by os._exit (or a kill) took its last fetches with it, and the
    # cache never counted those files, so it never evicted them either.
    from ray_goodput.data._journal import JournalReader

    ds, layout = _one_file(tmp_path, 321)
    reader = CacheReader(layout, 1 << 20)
    pid = os.fork()
    if pid == 0:
        try:
            reader.read(ds.files, 0)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    _, _, fetched = JournalReader(layout.journal_dir).poll()
    assert [(k, size) for k, size, _ in fetched] == [(ds.files.cache_key(0), 321)]


def test_a_fetch_waits_past_the_bound_while_the_lock_holder_makes_progress(tmp_path):
    # The bound was on the whole wait: readers of a large file whose healthy download took
    # longer than the bound raised, telling the user to end a process that was working.
    # It is now a bound on the holder making no progress: a downloader touches its lock file
    # as chunks arrive (of this file, or of another of the stripe), as the holder here does.
    import multiprocessing
    import time

    from ray_goodput.data import _cache_files
    from ray_goodput.storage import RetryPolicy

    ds, layout = _one_file(tmp_path, 100)
    key = ds.files.cache_key(0)
    ctx = multiprocessing.get_context("spawn")
    locked = ctx.Event()
    holder = ctx.Process(target=_hold_lock_downloading, args=(str(layout.lock_path(key)), locked, 6.0))
    holder.start()
    try:
        assert locked.wait(60), "the holder process never took the lock"
        began = time.monotonic()
        got = _cache_files.fetch(
            layout, key, ds.files.fs, ds.files.paths[0], max_bytes=1 << 20, policy=RetryPolicy(), lock_wait_s=2.5
        )
        assert time.monotonic() - began >= 5.0  # it waited out the download, more than twice the bound
        assert got is not None and got[0] == 100
    finally:
        holder.join(30)
        if holder.is_alive():
            holder.kill()


def _hold_lock_downloading(path: str, locked, seconds: float) -> None:
    import fcntl
    import time

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    locked.set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # a slow download, still moving: the library's _Beat
        os.utime(path)
        time.sleep(0.1)


def test_a_download_touches_its_lock_file_for_the_processes_waiting_for_it(tmp_path):
    import time

    from ray_goodput.data import _cache_files
    from ray_goodput.storage import RetryPolicy

    ds, layout = _one_file(tmp_path, 100)
    key = ds.files.cache_key(0)
    lock = layout.lock_path(key)
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    long_ago = time.time() - 3600
    os.utime(lock, (long_ago, long_ago))
    _cache_files.fetch(layout, key, ds.files.fs, ds.files.paths[0], max_bytes=1 << 20, policy=RetryPolicy())
    assert lock.stat().st_mtime > long_ago + 3000


def test_threads_reading_at_once_share_one_journal_file(tmp_path):
    # Readers of a process share one journal writer, set up at its first use: threads that
    # read for the first time at once each opened a journal file (one descriptor leaked,
    # one finalizer each), and one could write through the descriptor before it was set.
    import sys
    import threading

    from ray_goodput.data import _journal

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch inside the first use, as on a loaded machine
    try:
        for round_ in range(20):
            directory = tmp_path / f"j{round_}"
            writer = _journal.journal_writer(directory)
            start = threading.Barrier(8)

            def first_read(w=writer, b=start):
                b.wait()
                w.miss(("k", 1, 0.1))

            threads = [threading.Thread(target=first_read) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            files = list(directory.glob(f"{os.getpid()}-*.log"))
            assert len(files) == 1, (round_, files)
            assert files[0].read_text().count("f k 1") == 8, files[0].read_text()
    finally:
        sys.setswitchinterval(old)
