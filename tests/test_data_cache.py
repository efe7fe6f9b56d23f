"""NodeCache against a real S3 endpoint behind a recording HTTP proxy, with real Ray."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import ray

from ray_goodput.data import CacheConfig, CacheFullError, DataLoader, FileDataset, cache_status
from ray_goodput.data._cache_actor import KIND, get_cache
from ray_goodput.data._cache_client import CacheClient
from ray_goodput.data._cache_files import CacheLayout
from ray_goodput.runtime import _services
from ray_goodput.testing import FlakyProxy, wait_for

ROOT = str(Path(__file__).resolve().parents[1])


pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture(autouse=True)
def fresh_cache():
    _services.shutdown(KIND, drain_timeout_s=10)  # each test picks its own cache config
    yield
    _services.shutdown(KIND, drain_timeout_s=10)


def _upload(s3_server, prefix: str, blobs: dict[str, bytes]) -> tuple[str, str]:
    """Writes blobs straight to S3; returns (bucket, prefix)."""
    uri = s3_server.bucket_uri(prefix)
    bucket = uri[len("s3://") :].split("/")[0]
    fs = pafs.S3FileSystem(endpoint_override=s3_server.endpoint, scheme="http")
    for name, data in blobs.items():
        with fs.open_output_stream(f"{bucket}/{prefix}/{name}") as out:
            out.write(data)
    return bucket, prefix


def _via(proxy: FlakyProxy, bucket: str, prefix: str) -> str:
    return f"s3://{bucket}/{prefix}?endpoint_override={proxy.endpoint}&scheme=http"


def _blobs(n: int, size: int) -> dict[str, bytes]:
    return {f"f{i:03d}.bin": (f"{i:08d}".encode() * (size // 8 + 1))[:size] for i in range(n)}


def _data_files(cache_dir: Path) -> list[Path]:
    return [p for p in (cache_dir / "data").rglob("*") if p.is_file()]


def _describe_diff(got: list[bytes], want: list[bytes], proxy: FlakyProxy) -> str:
    def name(b: bytes) -> str:
        return f"{b[:8]!r}..x{len(b)} set={sorted(set(b[i : i + 8] for i in range(0, len(b), 8)))[:3]}"

    missing = [name(b) for b in want if b not in got]
    extra = [name(b) for b in got if b not in want or got.count(b) > 1]
    return f"missing {missing}, extra {extra}, GETs>1 {[p for p, n in proxy.gets().items() if n > 1]}"


@ray.remote(num_cpus=0)
def _read_everything(uri: str, cache_dir: str, workers: int, ready_dir: str, readers: int) -> list[bytes]:
    ds = FileDataset(uri, seed=1, cache=CacheConfig(directory=cache_dir, lookahead=16))
    loader = DataLoader(ds, 2, num_workers=workers, rank=0, world_size=1, collate_fn=list)
    ready = Path(ready_dir)
    (ready / f"{os.getpid()}").touch()  # all readers start together: a file barrier
    wait_for(lambda: len(list(ready.iterdir())) >= readers, timeout_s=60, what=f"{readers} readers ready in {ready}")
    return sorted(x for batch in loader for x in batch)


@pytest.mark.slow
def test_single_flight_across_processes_and_loader_workers(s3_server, tmp_path):
    blobs = _blobs(40, 2000)
    bucket, prefix = _upload(s3_server, "sf", blobs)
    proxy = FlakyProxy(s3_server.endpoint, latency_s=0.03)
    try:
        uri = _via(proxy, bucket, prefix)
        ready = tmp_path / "ready"
        ready.mkdir()
        refs = [_read_everything.remote(uri, str(tmp_path / "cache"), w, str(ready), 4) for w in (2, 2, 0, 3)]
        results = ray.get(refs, timeout=120)
        for got in results:
            want = sorted(blobs.values())
            assert got == want, _describe_diff(got, want, proxy)
        gets = proxy.gets(".bin")
        assert len(gets) == 40, gets
        assert {p: proxy.sequential_gets(p) for p in gets} == dict.fromkeys(gets, 0), gets
        retried = {p: n for p, n in gets.items() if n > 1}
        assert len(retried) <= 4, f"too many client-side retries to judge: {retried}"
        stats = cache_status()[0]
        assert stats["files"] == 40 and stats["bytes_used"] == 40 * 2000
        assert stats["bytes_fetched"] == 40 * 2000 and stats["hits"] + stats["misses"] >= 160
    finally:
        proxy.close()


def test_lru_eviction_under_small_capacity(s3_server, tmp_path):
    blobs = _blobs(30, 1000)
    bucket, prefix = _upload(s3_server, "ev", blobs)
    cfg = CacheConfig(directory=str(tmp_path), capacity_bytes=5500, lookahead=2)
    ds = FileDataset(f"s3://{bucket}/{prefix}?endpoint_override={s3_server.endpoint}&scheme=http", cache=cfg)
    loader = DataLoader(ds, 1, num_workers=0, collate_fn=list)
    for _epoch in range(2):
        assert sorted(x for b in loader for x in b) == sorted(blobs.values())
    # The cache's own prefetches (lookahead) may still be landing: a file is on disk a moment
    # before the cache counts it (and evicts to make room). Compare once none is in flight.
    cache = get_cache(cfg)
    wait_for(
        lambda: ray.get(cache.stats.remote())["inflight"] == 0, timeout_s=30, what="the cache's prefetches to land"
    )
    stats = ray.get(cache.stats.remote())
    assert stats["bytes_used"] <= 5500 and stats["files"] <= 5
    assert stats["evictions"] >= 2 * 30 - 5 - 5  # lookahead may keep a few extra fetches
    on_disk = _data_files(tmp_path)
    assert len(on_disk) == stats["files"]
    keys = {ds.files.cache_key(i): i for i in range(len(ds.files.paths))}
    for path in on_disk:  # every survivor is complete and is the right file
        assert path.read_bytes() == blobs[ds.files.paths[keys[path.name]].rsplit("/", 1)[1]]


def test_file_larger_than_capacity_is_a_clear_error(s3_server, tmp_path):
    bucket, prefix = _upload(s3_server, "big", {"big.bin": b"x" * 1000})
    ds = FileDataset(
        f"s3://{bucket}/{prefix}?endpoint_override={s3_server.endpoint}&scheme=http",
        cache=CacheConfig(directory=str(tmp_path), capacity_bytes=500),
    )
    DataLoader(ds, 1, num_workers=0)  # connects the node cache
    with pytest.raises(CacheFullError, match=r"big.bin.*capacity_bytes"):
        ds[0]
    assert _data_files(tmp_path) == []


def test_killed_mid_download_leaves_no_corrupt_file_and_is_recreated(s3_server, tmp_path):
    blob = os.urandom(3 << 20)
    bucket, prefix = _upload(s3_server, "kill", {"big.bin": blob})
    proxy = FlakyProxy(s3_server.endpoint)
    proxy.stall("big.bin")
    try:
        cfg = CacheConfig(directory=str(tmp_path))
        ds = FileDataset(_via(proxy, bucket, prefix), cache=cfg)
        service = CacheClient(cfg)
        fid = service.register(ds.files)
        service.prefetch(fid, [0])
        final = CacheLayout(tmp_path).data_path(ds.files.cache_key(0))
        wait_for(
            lambda: list(final.parent.glob(".*.part-*")), timeout_s=30, what="the download to start (a .part file)"
        )
        old = _services.find(KIND)
        ray.kill(next(iter(old.values())), no_restart=True)
        wait_for(lambda: not _services.find(KIND), timeout_s=30, what="the killed cache actor to be gone")
        assert not final.exists()  # its process is dead: nothing can rename the part file now
        proxy.release()

        def announce() -> bool:  # the first call fails on the dead actor; a later one
            service.prefetch(fid, [0])  # notices: reconnects, the cache is recreated, refetches
            return final.exists()

        wait_for(announce, timeout_s=30, what="the recreated cache to fetch big.bin", interval_s=0.1)
        assert final.read_bytes() == blob
        assert not list(final.parent.glob(".*.part-*"))  # the dead writer's temp is gone
        new = _services.find(KIND)
        assert list(new) == list(old) and new[list(new)[0]]._actor_id != old[list(old)[0]]._actor_id
        assert ds[0] == blob
    finally:
        proxy.close()


def test_cache_recreated_by_another_rank_gets_file_lists_again(s3_server, tmp_path):
    blobs = _blobs(4, 100)
    bucket, prefix = _upload(s3_server, "rr", blobs)
    cfg = CacheConfig(directory=str(tmp_path))
    ds = FileDataset(f"s3://{bucket}/{prefix}?endpoint_override={s3_server.endpoint}&scheme=http", cache=cfg)
    service = CacheClient(cfg)
    fid = service.register(ds.files)
    _services.shutdown(KIND, drain_timeout_s=10)
    ray.get(get_cache(cfg).describe.remote())  # another rank starts a new cache first
    service.prefetch(fid, [0, 1])  # answered -1: unknown file list ...
    layout = CacheLayout(tmp_path)
    paths = [layout.data_path(ds.files.cache_key(i)) for i in range(len(ds.files.paths))]

    def announce() -> bool:  # ... noticed by a later call: registers again and announces
        service.prefetch(fid, [2, 3])
        return paths[2].exists()

    wait_for(announce, timeout_s=30, what="f002.bin fetched after registering again", interval_s=0.1)
    assert paths[2].read_bytes() == blobs["f002.bin"]


def test_status_reports_each_node_and_hit_rate(s3_server, tmp_path):
    blobs = _blobs(8, 100)
    bucket, prefix = _upload(s3_server, "st", blobs)
    ds = FileDataset(
        f"s3://{bucket}/{prefix}?endpoint_override={s3_server.endpoint}&scheme=http",
        cache=CacheConfig(directory=str(tmp_path), lookahead=0),
    )
    loader = DataLoader(ds, 2, num_workers=0)
    for _ in range(3):
        list(loader)
    rows = cache_status()
    assert len(rows) == 1
    row = rows[0]
    assert row["node_id"] == ray.get_runtime_context().get_node_id()
    assert row["files"] == 8 and row["bytes_used"] == 800
    assert row["hits"] >= 16 and 0.5 < row["hit_rate"] <= 1.0
    assert row["directory"] == str(tmp_path)


def _creator_job(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A driver (its own Ray job) that creates the node cache (job check every 0.5 s),
    prints its directory and job id, and exits once the returned file is created."""
    address = ray.get_runtime_context().gcs_address  # this test's cluster, not any other
    go = tmp_path / "go"
    script = (
        f"import ray\nfrom ray_goodput.data import CacheConfig\n"
        f"from ray_goodput.data._cache_actor import get_cache\n"
        f"from ray_goodput.testing import wait_for_file\n"
        f"ray.init(address={address!r}, namespace='x')\n"
        f"h = get_cache(CacheConfig(directory={str(tmp_path / 'c')!r}, job_check_interval_s=0.5))\n"
        f"print(ray.get(h.describe.remote())['directory'])\n"
        f"print('job', ray.get_runtime_context().get_job_id(), flush=True)\n"
        f"wait_for_file({str(go)!r}, timeout_s=60)\n"
    )
    creator = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    wait_for(
        lambda: _services.find(KIND) or creator.poll() is not None, timeout_s=120, what="the creator job's node cache"
    )
    return creator, go


def test_cache_exits_when_its_job_is_gone(tmp_path):
    creator, go = _creator_job(tmp_path)
    try:
        assert _services.find(KIND), "the creator job did not start its cache"
        go.touch()
        assert str(tmp_path / "c") in creator.communicate(timeout=60)[0]
    finally:
        creator.kill()
    wait_for(lambda: not _services.find(KIND), timeout_s=40, what="the orphaned cache to exit", interval_s=0.2)


def test_cache_in_use_by_a_live_job_outlives_the_job_that_created_it(s3_server, tmp_path):
    """Found when the data-resume test's second world (a new Ray job) got ActorDiedError
    from ``register``: the cache exited once the job that created it ended, under the
    reader of a job still running."""
    creator, go = _creator_job(tmp_path)
    try:
        client = CacheClient(CacheConfig(directory=str(tmp_path / "c")))  # this job attaches
        before = set(_services.find(KIND))
        go.touch()
        job = creator.communicate(timeout=60)[0].split("job ")[-1].strip()
    finally:
        creator.kill()
    wait_for(lambda: not _services.job_alive(job), timeout_s=60, what=f"job {job} to be marked dead")
    time.sleep(2.0)  # four job checks of the cache: it must not exit
    assert before and set(_services.find(KIND)) == before, "the cache exited while this job still used it"
    blobs = _blobs(4, 10)
    bucket, prefix = _upload(s3_server, "live", blobs)
    files = FileDataset(
        f"s3://{bucket}/{prefix}?endpoint_override={s3_server.endpoint}&scheme=http",
        cache=CacheConfig(directory=str(tmp_path / "c")),
    ).files
    assert client.register(files)
    client.close()
