"""DataLoader over local files and Parquet: resume contract, epochs, errors, DCP (no Ray)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch.distributed.checkpoint as dcp

from ray_goodput.data import CacheConfig, DataError, DataLoader, FileDataset, ParquetDataset
from ray_goodput.errors import ConfigError, StorageError
from ray_goodput.storage import RetryPolicy
from ray_goodput.testing import wait_for

N = 53  # prime: every (world, batch) below leaves a ragged tail


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("files")
    for i in range(N):
        (d / f"s{i:03d}.txt").write_text(str(i))
    return d


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pq")
    start = 0
    for f, rows in enumerate([17, 5, 31]):
        table = pa.table(
            {"id": list(range(start, start + rows)), "x": [float(i) * 0.5 for i in range(start, start + rows)]}
        )
        pq.write_table(table, d / f"part-{f}.parquet", row_group_size=6)
        start += rows
    return d


def _files(files_dir, tmp_path, **kw) -> FileDataset:
    return FileDataset(
        str(files_dir), decode=lambda b: int(b), seed=7, cache=CacheConfig(directory=str(tmp_path / "cache")), **kw
    )


def _ids(batch) -> list[int]:
    return [int(x) for x in (batch["id"] if isinstance(batch, dict) else batch)]


def _lockstep(loaders, steps=None) -> list[list[int]]:
    """Runs ranks step by step like a Ray Train loop; returns ids per rank."""
    seen = [[] for _ in loaders]
    iters = [iter(dl) for dl in loaders]
    for step in itertools.count():
        if steps is not None and step == steps:
            break
        batches = [next(it, None) for it in iters]
        if all(b is None for b in batches):
            break
        assert all(b is not None for b in batches), "ranks ran different step counts"
        for r, b in enumerate(batches):
            seen[r].extend(_ids(b))
    return seen


def _make(ds, world, batch, workers):
    return [DataLoader(ds, batch, num_workers=workers, rank=r, world_size=world) for r in range(world)]


@pytest.mark.parametrize(
    "w1,w2,batch,workers,k", [(2, 3, 4, 0, 2), (2, 1, 4, 2, 3), (3, 2, 2, 2, 4), (1, 4, 3, 0, 1), (4, 4, 1, 2, 5)]
)
def test_resume_any_world_covers_epoch_once(files_dir, tmp_path, w1, w2, batch, workers, k):
    ds = _files(files_dir, tmp_path)
    first = _make(ds, w1, batch, workers)
    before = _lockstep(first, steps=k)
    states = [dl.state_dict() for dl in first]  # global position: the same on every rank
    assert all(s == states[0] for s in states)
    state = states[0]
    assert state["consumed"] == k * w1 * batch
    resumed = _make(ds, w2, batch, workers)
    for dl in resumed:
        dl.load_state_dict(state)
    after = _lockstep(resumed)
    union = [i for r in before + after for i in r]
    assert len(union) == len(set(union))
    perm = ds.permutation(0).tolist()
    end = state["consumed"] + (N - state["consumed"]) // (w2 * batch) * (w2 * batch)
    assert sorted(union) == sorted(perm[:end])  # the epoch's samples less the dropped tail
    assert all(dl.epoch == 1 and dl.consumed == 0 for dl in resumed)


def test_resume_mid_second_epoch_and_epochs_differ(files_dir, tmp_path):
    ds = _files(files_dir, tmp_path)
    dl = DataLoader(ds, 5, num_workers=2, rank=0, world_size=2)
    epoch0 = [i for b in dl for i in _ids(b)]
    assert dl.epoch == 1 and len(epoch0) == (N // 10) * 5
    it = iter(dl)
    part1 = [i for _ in range(2) for i in _ids(next(it))]
    state = dl.state_dict()
    assert state["epoch"] == 1 and state["consumed"] == 20
    dl2 = DataLoader(ds, 5, num_workers=0)  # world 1 now
    dl2.load_state_dict(state)
    dl2.set_epoch(1)  # same epoch: keeps the resumed position
    rest = [i for b in dl2 for i in _ids(b)]
    perm1 = ds.permutation(1).tolist()
    assert part1 == [perm1[j] for j in (0, 1, 2, 3, 4, 10, 11, 12, 13, 14)]  # rank 0 stripes
    assert rest == perm1[20:50]
    assert epoch0 != [perm1[j] for j in range(len(epoch0))]
    dl2.set_epoch(5)
    assert dl2.consumed == 0 and len(dl2) == N // 5


def test_fetch_seconds_and_len(files_dir, tmp_path):
    dl = DataLoader(_files(files_dir, tmp_path), 4, num_workers=0)
    assert len(dl) == N // 4
    batches = list(dl)
    assert len(batches) == N // 4 and dl.steps == len(batches)
    assert 0 < dl.last_fetch_seconds <= dl.total_fetch_seconds


def test_the_loops_wait_for_the_node_cache_to_answer_its_hints_is_a_data_stall(files_dir, tmp_path, monkeypatch):
    """Before each batch the loader tells the node cache which files come next; when the
    cache actor died that call re-creates it and blocks (seconds, up to 120 s per file
    list). It ran before the batch's fetch timer started, so the goodput ledger booked
    that wait as productive step time, not as a data stall. Here the hint blocks 0.3 s."""
    import time

    from ray_goodput.data import _loader

    monkeypatch.setattr(_loader._Hints, "advance", lambda self, position: time.sleep(0.3))
    dl = DataLoader(_files(files_dir, tmp_path), 4, num_workers=0)
    next(iter(dl))
    assert dl.last_fetch_seconds >= 0.3


def test_parquet_rows_resume_and_columns(parquet_dir, tmp_path):
    total = 17 + 5 + 31
    ds = ParquetDataset(str(parquet_dir), seed=1, cache=CacheConfig(directory=str(tmp_path / "c")))
    assert len(ds) == total
    assert ds[20] == {"id": 20, "x": 10.0}
    before = _lockstep(_make(ds, 2, 3, 2), steps=3)
    resumed = _make(ds, 3, 3, 0)
    for dl in resumed:
        dl.load_state_dict({"epoch": 0, "consumed": 18, "seed": 1, "fingerprint": ds.fingerprint})
    after = _lockstep(resumed)
    union = [i for r in before + after for i in r]
    assert len(union) == len(set(union)) == 18 + (total - 18) // 9 * 9
    only_id = ParquetDataset(str(parquet_dir), columns=["id"], cache=None)
    assert set(only_id[0]) == {"id"}


def test_state_from_another_dataset_or_seed_is_rejected(files_dir, parquet_dir, tmp_path):
    dl = DataLoader(_files(files_dir, tmp_path), 4, num_workers=0)
    other = DataLoader(ParquetDataset(str(parquet_dir), cache=None), 4, num_workers=0)
    with pytest.raises(DataError, match="another dataset"):
        dl.load_state_dict(other.state_dict())
    with pytest.raises(DataError, match="seed"):
        dl.load_state_dict({**dl.state_dict(), "seed": 99})
    with pytest.raises(DataError, match="lacks"):
        dl.load_state_dict({"epoch": 0})
    with pytest.raises(ConfigError, match="another dataset"):
        dl.load_state_dict({**dl.state_dict(), "consumed": N + 1})


def test_clear_errors_name_the_input(files_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="holds no files"):
        FileDataset(str(empty))
    with pytest.raises(DataError, match="empty list"):
        FileDataset([])
    missing = FileDataset(
        [str(files_dir / "s000.txt"), str(files_dir / "nope.txt")], cache=CacheConfig(directory=str(tmp_path / "c"))
    )
    with pytest.raises(StorageError, match="nope.txt"):
        missing[1]
    bad = FileDataset(str(files_dir), decode=lambda b: 1 / 0, cache=None)
    with pytest.raises(DataError, match=r"s0\d\d.txt"):
        bad[0]
    ds = _files(files_dir, tmp_path)
    with pytest.raises(ConfigError, match="rank 3 is outside"):
        DataLoader(ds, 2, rank=3, world_size=2)
    with pytest.raises(ConfigError, match="both rank= and world_size="):
        DataLoader(ds, 2, rank=0)
    with pytest.raises(DataError, match="lower batch_size"):
        DataLoader(ds, 30, rank=0, world_size=2)
    with pytest.raises(DataError, match="not a readable Parquet"):
        ParquetDataset(str(files_dir), suffixes=(".txt",), cache=None)


def test_state_round_trips_through_dcp_as_stateful(files_dir, tmp_path):
    ds = _files(files_dir, tmp_path)
    dl = DataLoader(ds, 4, num_workers=0)
    it = iter(dl)
    next(it), next(it), next(it)
    dcp.save({"loader": dl}, checkpoint_id=str(tmp_path / "ckpt"))
    fresh = DataLoader(ds, 4, num_workers=0)
    dcp.load({"loader": fresh}, checkpoint_id=str(tmp_path / "ckpt"))
    assert fresh.state_dict() == dl.state_dict() and fresh.consumed == 12
    assert _ids(next(iter(fresh))) == _ids(next(it))


def test_dataset_without_our_loader_and_uncached_reads(files_dir, tmp_path):
    ds = _files(files_dir, tmp_path)
    assert ds[5] == 5 and ds[5] == 5  # second read is a cache hit
    cached = list((tmp_path / "cache" / "data").rglob("*"))
    assert any(p.is_file() and p.read_bytes() == b"5" for p in cached)
    plain = FileDataset(str(files_dir), decode=int, cache=None)
    assert sorted(plain[i] for i in range(len(plain))) == list(range(N))


def test_forked_worker_does_not_inherit_a_held_fetch_lock(tmp_path):
    """A prefetch thread holds a lock stripe while the main thread forks loader workers:
    the child must still get that lock once the parent releases it (no deadlock)."""
    import os
    import signal
    import threading
    import time

    from ray_goodput.data import _cache_files

    layout = _cache_files.CacheLayout(tmp_path)
    layout.create()
    key = "ab" * 16
    held = threading.Event()

    def holder():
        with _cache_files.flock(layout.lock_path(key)):
            held.set()
            time.sleep(1.0)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait()
    pid = os.fork()
    if pid == 0:  # child: a deadlock ends in SIGALRM, i.e. a failing exit status
        signal.alarm(10)
        with _cache_files.flock(layout.lock_path(key)):
            os._exit(0)
    thread.join()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_bad_cache_config_names_the_setting():
    for kwargs, name in (
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"lookahead": -1}, "lookahead"),
        ({"fetch_concurrency": 0}, "fetch_concurrency"),
        ({"job_check_interval_s": 0}, "job_check_interval_s"),
    ):
        with pytest.raises(ConfigError, match=f"CacheConfig.{name} must"):
            CacheConfig(**kwargs)


_RANK_WITH_LOADER_WORKERS = """
import json, sys, time
import psutil
import torch.utils.data._utils.worker as torch_worker
from ray_goodput.data import DataLoader, FileDataset
from ray_goodput.testing import publish_file
torch_worker.MP_STATUS_CHECK_INTERVAL = 3600.0  # torch's own 5 s orphan check: only ours can end them
loader = DataLoader(FileDataset(sys.argv[1], decode=int, seed=0, cache=None), 2, num_workers=2,
                    rank=0, world_size=1, persistent_workers=True)
it = iter(loader)
next(it)
publish_file(sys.argv[2], json.dumps([c.pid for c in psutil.Process().children()]))
time.sleep(300)
"""


def test_a_killed_process_not_yet_reaped_by_its_parent_is_not_alive():
    """A SIGKILLed rank stays a zombie until its parent (the raylet) reaps it: liveness
    by ``kill(pid, 0)`` alone took it for alive, and its orphaned loader workers stayed."""
    import signal
    import subprocess
    import sys

    from ray_goodput.runtime import pid_alive

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        assert pid_alive(child.pid)
        child.send_signal(signal.SIGKILL)
        wait_for(lambda: _is_zombie(child.pid), timeout_s=30, what="the killed child to become a zombie")
        assert not pid_alive(child.pid)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert not pid_alive(child.pid)  # reaped


def _is_zombie(pid: int) -> bool:
    import psutil

    return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_loader_worker_that_starts_after_its_rank_died_exits_at_once():
    """A worker whose rank was killed before the worker's init ran found itself orphaned
    and started no watch: it lived until torch's next 5 s status check."""
    import os
    import subprocess
    import sys

    from ray_goodput.data._loader import _ExitWithRank

    init = _ExitWithRank()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    init.rank_pid = dead.pid  # a rank that is gone (reaped)
    pid = os.fork()
    if pid == 0:  # the worker: exit 0 from the init, or 3 when it returns to run batches
        try:
            init(0)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_a_loader_built_in_a_process_that_is_gone_still_starts_its_workers(files_dir, tmp_path):
    """The rank is the process that iterates (starts the workers), not the one that built
    the loader: one built elsewhere and pickled (a driver passing it in the train loop's
    config) named a process that is not the workers' parent, and once that one was gone
    its workers would take themselves for orphans and exit at their init."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    loader = DataLoader(
        FileDataset(str(files_dir), decode=int, seed=0, cache=None), 2, num_workers=1, rank=0, world_size=1
    )
    loader.worker_init_fn.rank_pid = dead.pid  # as unpickled from a process that is gone
    first = next(iter(loader))
    assert len(_ids(first)) == 2


def test_loader_workers_exit_at_once_when_their_rank_is_killed(files_dir, tmp_path):
    """A forked loader worker holds its rank's inherited sockets: Ray saw a SIGKILLed rank
    die only when its workers noticed, at torch's next 5 s status check (found in the LM
    example: 5.1 s from the kill to the retry with one loader worker, 0.17 s with none)."""
    import contextlib
    import json
    import signal
    import subprocess
    import sys

    import psutil

    from ray_goodput.testing import wait_for_file

    pids_file = tmp_path / "pids.json"
    rank = subprocess.Popen([sys.executable, "-c", _RANK_WITH_LOADER_WORKERS, str(files_dir), str(pids_file)])
    try:
        workers = json.loads(wait_for_file(pids_file, timeout_s=120, what="the rank's loader workers").read_text())
        assert len(workers) == 2, workers
    finally:
        rank.send_signal(signal.SIGKILL)
        rank.wait(timeout=30)

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    # torch's own check is off in the rank (an hour): the workers end only by the library's
    # watch (a 0.1 s poll) or at their init; the bound only stops a test that would hang.
    try:
        wait_for(
            lambda: all(gone(p) for p in workers),
            timeout_s=60,
            what=f"loader workers {workers} to exit after their rank was SIGKILLed",
        )
    finally:  # none left behind for an hour when the watch failed
        for pid in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()


def test_a_parquet_row_group_read_failing_in_transit_is_retried_not_ended_as_bad_data(parquet_dir, s3_server):
    """A 5xx or a reset connection while reading a row group is a storage error to retry,
    not a DataError (which Recovery does not retry: one network blip would end the run)."""
    import pyarrow.fs as pafs

    from ray_goodput.testing import FlakyProxy

    uri = s3_server.bucket_uri("pq")
    bucket = uri[len("s3://") :].split("/")[0]
    fs = pafs.S3FileSystem(endpoint_override=s3_server.endpoint, scheme="http")
    for path in sorted(parquet_dir.iterdir()):
        with fs.open_output_stream(f"{bucket}/pq/{path.name}") as out:
            out.write(path.read_bytes())
    proxy = FlakyProxy(s3_server.endpoint)
    try:
        ds = ParquetDataset(
            f"s3://{bucket}/pq?endpoint_override={proxy.endpoint}&scheme=http",
            cache=None,
            retry=RetryPolicy(attempts=8, initial_delay=0.2, max_delay=0.5),
        )
        # Now most requests fail: some of the row-group reads fail through the S3 client's
        # own retries in place (5 failures in a row: 17 % of requests).
        proxy.failure_rate = 0.7
        rows = [ds[i]["id"] for i in range(len(ds))]
    finally:
        proxy.close()
    assert rows == list(range(17 + 5 + 31))
    assert proxy.counts["failed"] >= 1


def test_a_state_saved_with_shuffle_on_is_refused_by_a_loader_with_shuffle_off(files_dir, tmp_path):
    """The order of an epoch depends on ``shuffle``: a position in one order resumed in the
    other repeats some samples and never reads others."""
    shuffled = DataLoader(FileDataset(str(files_dir), seed=7, cache=None), 4, num_workers=0)
    state = shuffled.state_dict()
    plain = DataLoader(FileDataset(str(files_dir), seed=7, shuffle=False, cache=None), 4, num_workers=0)
    with pytest.raises(DataError, match="shuffle=True"):
        plain.load_state_dict(state)
    again = DataLoader(FileDataset(str(files_dir), seed=7, cache=None), 4, num_workers=0)
    again.load_state_dict(state)  # the same settings resume
    unshuffled = plain.state_dict()
    with pytest.raises(DataError, match="shuffle=False"):
        again.load_state_dict(unshuffled)
    # A state saved before the order was recorded (the dataset's fingerprint alone) still
    # loads into either: it cannot say which order it counted in.
    legacy = {**unshuffled, "fingerprint": plain.dataset.fingerprint}
    plain.load_state_dict(legacy)
    again.load_state_dict(legacy)


def test_a_cached_file_rewritten_with_another_size_is_read_again_not_served_stale(tmp_path):
    """The cache key names the listed size: a dataset rewritten in place (new sizes) is
    fetched again by the next job instead of being served from the old copy."""
    data, cache = tmp_path / "data", CacheConfig(directory=str(tmp_path / "cache"))
    data.mkdir()
    for i in range(2):
        (data / f"f{i}.bin").write_bytes(b"old-%d" % i)
    first = FileDataset(str(data), decode=bytes, cache=cache, shuffle=False)
    assert [first[i] for i in range(2)] == [b"old-0", b"old-1"]
    for i in range(2):
        (data / f"f{i}.bin").write_bytes(b"rewritten-%d" % i)
    second = FileDataset(str(data), decode=bytes, cache=cache, shuffle=False)
    assert [second[i] for i in range(2)] == [b"rewritten-0", b"rewritten-1"]


def test_a_cached_file_rewritten_in_place_with_the_same_size_is_read_again_not_served_stale(tmp_path):
    """Fixed-size records rewritten in place keep every file's size: the cache key also
    names the listed modification time, so the next job reads the new bytes."""
    data, cache = tmp_path / "data", CacheConfig(directory=str(tmp_path / "cache"))
    data.mkdir()
    for i in range(2):
        (data / f"f{i}.bin").write_bytes(b"old-%d" % i)
        os.utime(data / f"f{i}.bin", ns=(1_000_000_000, 1_000_000_000))
    first = FileDataset(str(data), decode=bytes, cache=cache, shuffle=False)
    assert [first[i] for i in range(2)] == [b"old-0", b"old-1"]
    for i in range(2):
        (data / f"f{i}.bin").write_bytes(b"new-%d" % i)  # same size, a later time
    second = FileDataset(str(data), decode=bytes, cache=cache, shuffle=False)
    assert [second[i] for i in range(2)] == [b"new-0", b"new-1"]
    assert second.files.cache_id() != first.files.cache_id()  # the node cache's list too


def test_the_default_capacity_counts_the_bytes_the_cache_already_holds(tmp_path, monkeypatch):
    """A new cache keeper (a new job's actor) sizes its capacity from the free disk plus
    what the cache already holds; from the free disk alone it would evict most of a warm
    cache at start. The disk's size is a stand-in: the rule is pure arithmetic."""
    import shutil as _shutil

    from ray_goodput.data._cache_keeper import CacheKeeper

    config = CacheConfig(directory=str(tmp_path / "cache"))
    keeper = CacheKeeper(config)
    for i in range(8):  # a warm cache left by a previous keeper: 8 files of 1000 bytes
        key = f"{i:02d}" + "0" * 30
        path = keeper.layout.data_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 1000)
    keeper.close(timeout_s=5)
    real = _shutil.disk_usage
    monkeypatch.setattr(
        "ray_goodput.data._cache_keeper.shutil.disk_usage",
        lambda p: real(p)._replace(free=2000),  # the cache filled the disk but 2000 bytes
    )
    warm = CacheKeeper(config)
    try:
        assert warm.capacity == int(0.8 * (2000 + 8000))
        stats = warm.stats()
        assert (stats["evictions"], stats["files"], stats["bytes_used"]) == (0, 8, 8000)
    finally:
        warm.close(timeout_s=5)


def test_two_concurrent_polls_of_the_cache_journals_count_each_event_once(tmp_path):
    """The node cache actor serves ``stats()`` beside its maintenance loop: two polls of
    the readers' journals at once must not both count the same lines."""
    import os
    import threading

    from ray_goodput.data._journal import JournalReader

    for trial in range(30):
        directory = tmp_path / f"j{trial}"
        directory.mkdir()
        for j in range(8):  # 8 readers' journals of this (live) process
            (directory / f"{os.getpid()}-{j:08x}.log").write_text("h 1000\n" * 200)
        reader, counted = JournalReader(directory), []
        barrier = threading.Barrier(2)

        def poll(reader=reader, counted=counted, barrier=barrier):
            barrier.wait()
            counted.append(reader.poll()[0])

        threads = [threading.Thread(target=poll) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert sum(counted) + reader.poll()[0] == 8 * 200 * 1000, f"trial {trial}: {counted}"


def test_a_files_cache_identity_names_its_endpoint_and_host_not_only_the_scheme(monkeypatch):
    """An S3 endpoint set by RAY_GOODPUT_S3_ENDPOINT gave the same identity as AWS's own,
    and two HDFS namenodes one identity: the same bucket and key on two endpoints shared a
    cache file, one served for the other."""
    from ray_goodput.data._sources import _ident

    monkeypatch.delenv("RAY_GOODPUT_S3_ENDPOINT", raising=False)
    aws = _ident("s3://bucket/train/a.bin")
    monkeypatch.setenv("RAY_GOODPUT_S3_ENDPOINT", "http://minio.internal:9000")
    minio = _ident("s3://bucket/train/a.bin")
    assert aws != minio
    assert "endpoint_override=http://minio.internal:9000" in minio
    assert _ident("hdfs://nn-a:8020/data") != _ident("hdfs://nn-b:8020/data")
    assert _ident("s3://one/x") == _ident("s3://two/y")  # the bucket is in each file's path
    # The node cache's id of a file list names its filesystem too: the same bucket, keys and
    # sizes on two endpoints are two lists (else prefetch fetched the first one's files).
    import pyarrow.fs as pafs

    from ray_goodput.data._sources import FileSet

    lists = [FileSet(ident=i, fs=pafs.LocalFileSystem(), paths=("b/k",), sizes=(5,)) for i in (aws, minio)]
    assert lists[0].cache_id() != lists[1].cache_id()


def test_parquet_that_does_not_decode_is_bad_data_at_once_not_a_storage_error_retried(tmp_path):
    """pyarrow raises OSError for a damaged page header too ("Couldn't deserialize
    thrift"): retried as storage, a damaged file took every retry, then every restart
    Recovery gave it, and was named a storage failure. Only the file's reads are retried."""
    import time

    path = tmp_path / "d" / "a.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"id": list(range(100))}), path)
    raw = bytearray(path.read_bytes())
    offset = pq.ParquetFile(path).metadata.row_group(0).column(0).data_page_offset
    for k in range(offset, offset + 16):  # the page header; the footer stays intact
        raw[k] ^= 0xFF
    path.write_bytes(bytes(raw))
    ds = ParquetDataset(str(path.parent), cache=None, retry=RetryPolicy(attempts=6, initial_delay=1.0, max_delay=1.0))
    began = time.monotonic()
    with pytest.raises(DataError, match="row group 0"):
        ds[0]
    assert time.monotonic() - began < 1.0  # no retry waited
    # A footer that does not decode is bad data too, found when the dataset is made.
    footer = tmp_path / "f" / "a.parquet"
    footer.parent.mkdir()
    pq.write_table(pa.table({"id": list(range(100))}), footer)
    raw = bytearray(footer.read_bytes())
    begins = len(raw) - 8 - int.from_bytes(raw[-8:-4], "little")  # the footer: thrift, length, PAR1
    for k in range(begins, begins + 16):
        raw[k] ^= 0xFF
    footer.write_bytes(bytes(raw))
    began = time.monotonic()
    with pytest.raises(DataError, match="not a readable Parquet file"):
        ParquetDataset(str(footer.parent), cache=None, retry=RetryPolicy(attempts=6, initial_delay=1.0, max_delay=1.0))
    assert time.monotonic() - began < 1.0


def test_a_state_saved_when_wide_seeds_were_cut_to_32_bits_is_refused_not_resumed_in_another_order(files_dir):
    """Seeds outside [0, 2**32) were cut to their low 32 bits; they now keep their own order.
    A state saved mid-epoch before that loaded silently, and the rest of its epoch was read
    in the new order: samples repeated, others skipped."""
    for seed in (-1, 2**40 + 3):
        loader = DataLoader(FileDataset(str(files_dir), seed=seed, cache=None), 4, num_workers=0)
        state = {**loader.state_dict(), "consumed": 8}  # mid-epoch
        loader.load_state_dict(state)  # a state of this version resumes
        old = {**state, "fingerprint": state["fingerprint"] & ~(1 << 65)}  # as the earlier version saved it
        with pytest.raises(DataError, match="32 bits"):
            loader.load_state_dict(old)
        loader.load_state_dict({**old, "consumed": 0})  # at an epoch's start: nothing read in the old order
        plain = DataLoader(FileDataset(str(files_dir), seed=seed, shuffle=False, cache=None), 4, num_workers=0)
        unshuffled = {**plain.state_dict(), "consumed": 8}
        plain.load_state_dict({**unshuffled, "fingerprint": unshuffled["fingerprint"] & ~(1 << 65)})  # no seed used
    in_range = DataLoader(FileDataset(str(files_dir), seed=7, cache=None), 4, num_workers=0)
    in_range.load_state_dict(in_range.state_dict())  # its order never changed: no flag needed
