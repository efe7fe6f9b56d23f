"""Checkpoints through a storage endpoint that fails a share of requests, and onto a
staging disk that is full: retried and committed, or failed loudly while training goes on."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
import subprocess
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from ray_goodput import Checkpointer, CheckpointError, list_checkpoints, storage
from ray_goodput.checkpoint.protocol import _catalog
from ray_goodput.checkpoint.save._arena import open_slots
from ray_goodput.checkpoint.uploader import _direct_upload, _shard_job
from ray_goodput.checkpoint.uploader._thread_backend import ThreadBackend
from ray_goodput.cli import main
from ray_goodput.storage import RetryPolicy
from ray_goodput.testing import FlakyProxy


@pytest.fixture
def flaky_uri(s3_server):
    proxy = FlakyProxy(s3_server.endpoint, failure_rate=0.2, seed=7)
    bucket_uri = s3_server.bucket_uri("flaky")  # created directly, not through the proxy
    yield bucket_uri.replace(s3_server.endpoint, proxy.endpoint), proxy
    proxy.close()


def test_flaky_endpoint_is_retried_and_commits_with_matching_checksums(flaky_uri, tmp_path, capsys):
    uri, proxy = flaky_uri
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    retry = RetryPolicy(attempts=10, initial_delay=0.05, max_delay=0.5)
    with Checkpointer(uri, staging_dir=str(tmp_path / "s"), retry=retry, uploader="thread") as ckpt:
        for step in (1, 2, 3):  # one at a time: a save still waiting when the next
            ckpt.save(step, {"model": model})  # comes would be superseded
            ckpt.wait()
        assert ckpt.stats.committed == [1, 2, 3] and ckpt.stats.failed_saves == 0
    assert proxy.counts["failed"] >= 5, proxy.counts  # the faults really happened
    assert [i.step for i in list_checkpoints(uri) if i.committed] == [1, 2, 3]
    assert main(["verify", uri]) == 0  # every file's checksum, through the flaky endpoint
    out = capsys.readouterr().out
    assert out.count(": ok") == 3, out
    fresh = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    with Checkpointer(uri, staging_dir=str(tmp_path / "other"), retry=retry) as ckpt:
        assert ckpt.restore({"model": fresh}) == 3
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def _tmpfs(path: Path, size: str) -> Path:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    return path


@pytest.fixture
def tiny_disk(tmp_path):
    mount = _tmpfs(tmp_path / "tiny", "256k")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(mount: Path) -> Path:
    """Write ``mount`` full, to its last byte."""
    fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    return mount


@pytest.fixture
def small_memory(tmp_path, monkeypatch):
    """Memory (where a shard's small files go when staging is full) with room for them, not
    for a copy of a BIG shard."""
    mount = _tmpfs(tmp_path / "small-memory", "1m")
    monkeypatch.setattr(_direct_upload, "MEMORY_DIR", mount)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def full_memory(tmp_path, monkeypatch):
    """Memory with no room for anything: no snapshot's files can be made at all."""
    mount = _fill(_tmpfs(tmp_path / "full-memory", "256k"))
    monkeypatch.setattr(_direct_upload, "MEMORY_DIR", mount)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


SMALL = {"model": torch.nn.Linear(8, 8)}
BIG = {"model": torch.nn.Linear(8, 8), "extra": torch.nn.Linear(512, 512)}  # 1 MiB > the tiny disk


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_full_staging_disk_sends_the_shard_straight_from_its_snapshot_with_one_warning(
    where, tiny_disk, small_memory, tmp_path, s3_server, caplog
):
    """A full staging disk failed the run; then the shard went to storage through a copy in
    memory, and failed when memory could not hold that copy either. It goes to storage
    straight from its snapshot now, without a node-local copy or one in memory (on S3,
    after the upload that followed the cut-short write took back what it sent)."""
    root = str(tmp_path / "root") if where == "local" else s3_server.bucket_uri("tiny-degrade")
    big = {"model": torch.nn.Linear(8, 8), "extra": torch.nn.Linear(512, 512)}
    with caplog.at_level(logging.WARNING), Checkpointer(root, staging_dir=str(tiny_disk), uploader="thread") as ckpt:
        ckpt.save(1, SMALL)
        ckpt.wait()
        for step in (2, 3):
            ckpt.save(step, big)
            ckpt.wait()
        assert ckpt.stats.committed == [1, 2, 3] and ckpt.stats.failed_saves == 0
    warned = [r.getMessage() for r in caplog.records if "straight from its snapshot" in r.getMessage()]
    assert len(warned) == 1, warned  # once per staging dir
    assert str(tiny_disk) in warned[0] and "bytes free" in warned[0], warned[0]
    assert not list(tiny_disk.rglob("*.distcp")), list(tiny_disk.rglob("*"))  # no node-local copy
    assert not [p for p in small_memory.rglob("*") if p.is_file()], list(small_memory.rglob("*"))  # nor in memory
    fresh = {"model": torch.nn.Linear(8, 8), "extra": torch.nn.Linear(512, 512)}
    with Checkpointer(root, staging_dir=str(tmp_path / "r"), uploader="thread") as ckpt:
        assert ckpt.restore(fresh) == 3
    for name in ("model", "extra"):
        for a, b in zip(big[name].state_dict().values(), fresh[name].state_dict().values()):
            assert torch.equal(a, b)


def _layers() -> dict[str, torch.nn.Module]:
    """12 MiB in several tensors: past the S3 client's part size, so the upload is sent in
    parts while DCP writes the file (a failed part fails a write inside torch.save)."""
    return {
        "model": torch.nn.Linear(8, 8),
        "layers": torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(3))),
    }


def test_a_shard_sent_from_its_snapshot_is_written_again_from_it_after_a_storage_outage(
    tiny_disk, small_memory, tmp_path, s3_server, caplog
):
    """With the staging dir full there is no staged file to upload again: when an outage
    outlasts the retry policy, each later round writes the data file again from the
    snapshot, which stays held until the upload ends. A write that failed inside
    torch.save must fail as the storage error it is, or no round retries it."""
    proxy = FlakyProxy(s3_server.endpoint)
    direct = s3_server.bucket_uri("direct-retry")
    retry = RetryPolicy(attempts=2, initial_delay=0.05, max_delay=0.1)
    state = _layers()
    try:
        with (
            caplog.at_level(logging.WARNING),
            Checkpointer(
                direct.replace(s3_server.endpoint, proxy.endpoint),
                staging_dir=str(tiny_disk),
                retry=retry,
                uploader="thread",
            ) as ckpt,
        ):
            for step in (1, 2, 3):
                if step == 2:
                    proxy.outage(3.0)  # longer than the policy's 2 attempts
                ckpt.save(step, state)
                ckpt.wait()
            assert ckpt.stats.committed == [1, 2, 3] and ckpt.stats.failed_saves == 0
    finally:
        proxy.close()
    rounds = [r.getMessage() for r in caplog.records if "storage is out" in r.getMessage()]
    assert [m for m in rounds if "from the snapshot" in m], rounds  # the data file was written again
    assert main(["verify", direct]) == 0  # what storage holds matches every manifest
    fresh = _layers()
    with Checkpointer(direct, staging_dir=str(tmp_path / "r"), uploader="thread") as ckpt:
        assert ckpt.restore(fresh) == 3
    for name in ("model", "layers"):
        saved, loaded = state[name].state_dict().values(), fresh[name].state_dict().values()
        assert all(torch.equal(a, b) for a, b in zip(saved, loaded))
    assert not [p for p in small_memory.rglob("*") if p.is_file()]


def test_full_staging_disk_and_memory_fail_that_save_loudly_and_training_goes_on(
    tiny_disk, full_memory, tmp_path, caplog
):
    root = str(tmp_path / "root")
    ckpt = Checkpointer(root, staging_dir=str(tiny_disk), uploader="thread")
    ckpt.save(1, SMALL)
    ckpt.wait()
    with caplog.at_level(logging.ERROR):
        ckpt.save(2, BIG)  # returns: the failure happens in the background
        with pytest.raises(CheckpointError, match="No space left|Errno 28") as err:
            ckpt.wait()  # (waited for before the next save, which would supersede it)
    assert f"{full_memory} has" in str(err.value) and "too few for the shard's small files" in str(err.value)
    ckpt.save(3, SMALL)  # training goes on and checkpoints again
    ckpt.wait()
    assert ckpt.stats.failed_saves == 1 and "step 2" in ckpt.stats.last_error
    assert "checkpoint of step 2 failed" in caplog.text
    ckpt.close()
    committed = [i.step for i in list_checkpoints(root) if i.committed]
    assert committed == [1, 3]


def test_a_full_staging_disk_names_the_bytes_the_shard_needs_also_for_tensors_passed_as_plain_values(
    tiny_disk, full_memory, tmp_path
):
    """The message said "the shard needs ~0" for 24 MiB of tensors in a plain dict: it
    counted the arena's tensors only, not the pickled plain values."""
    params = {"params": {str(i): torch.zeros(64, 1024) for i in range(4)}}  # 1 MiB, plain values
    needed = sum(t.numel() * t.element_size() for t in params["params"].values())
    ckpt = Checkpointer(str(tmp_path / "root"), staging_dir=str(tiny_disk), uploader="thread")
    ckpt.save(1, params)
    with pytest.raises(CheckpointError, match="out of space") as err:
        ckpt.wait()
    ckpt._release()
    shown = int(re.search(r"the shard needs ~(\d+)", str(err.value)).group(1))
    assert needed <= shown < 2 * needed, str(err.value)


def test_a_staging_write_that_fails_while_its_upload_follows_it_leaves_no_object_in_storage(
    tiny_disk, full_memory, tmp_path, s3_server
):
    """On object storage the data file is uploaded while DCP writes it (``_follow_upload``): a
    write that fails midway (the staging disk filled up, and memory has no room either) must
    fail that save alone and take back what was sent, not leave a partial object under the
    file's name."""
    root = s3_server.bucket_uri("tiny-follow")
    ckpt = Checkpointer(root, staging_dir=str(tiny_disk), uploader="thread")
    ckpt.save(1, SMALL)
    ckpt.wait()
    ckpt.save(2, BIG)
    with pytest.raises(CheckpointError, match="No space left|Errno 28"):
        ckpt.wait()
    ckpt.save(3, SMALL)
    ckpt.wait()
    ckpt.close()
    step2 = _catalog.step_location(storage.resolve(root), 2)
    left = [i.path for i in step2.fs.get_file_info(pafs.FileSelector(step2.root, allow_not_found=True, recursive=True))]
    assert not [p for p in left if p.endswith(".distcp")], left
    assert [i.step for i in list_checkpoints(root) if i.committed] == [1, 3]


class _Recording(ThreadBackend):
    """The thread uploader, recording each job with a copy of its snapshot's tensors."""

    def __init__(self) -> None:
        super().__init__(concurrency=1, policy=RetryPolicy())
        self.jobs: list[tuple[_shard_job.ShardJob, dict[str, torch.Tensor]]] = []

    def submit(self, job):
        tensors = open_slots(job.arena_path, list(job.slots)) if job.slots else {}
        self.jobs.append((job, {k: v.clone() for k, v in tensors.items()}))
        return super().submit(job)


def test_a_rank_that_finds_staging_full_leaves_its_node_peers_staged_shard_alone(tiny_disk, tmp_path):
    """The ranks of a node stage one step into one directory. A rank whose write ran out of
    room cleared the whole directory before going to memory, so the shard of a peer, staged
    or being staged there, vanished under it (the fault soak at world 2: the peer's save
    failed with FileNotFoundError, and the run with it)."""
    recording = _Recording()
    with Checkpointer(str(tmp_path / "root"), staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt._uploader = recording
        for step, state in ((1, SMALL), (2, BIG)):
            ckpt.save(step, state)
            ckpt.wait()
    (small, small_tensors), (big, big_tensors) = recording.jobs
    step_dir = tiny_disk / "run" / "step-000000001"
    peer = dataclasses.replace(small, rank=1, local_dir=str(step_dir))
    names = _shard_job.write_local(peer, small_tensors)  # the peer's shard fits
    mine = dataclasses.replace(big, rank=0, step=1, local_dir=str(step_dir))
    with pytest.raises(_shard_job.StagingFullError) as full:
        _shard_job.write_local(mine, big_tensors)
    moved, _ = _direct_upload.prepare(mine, full.value)
    try:
        assert all((step_dir / n).is_file() for n in names), sorted(p.name for p in step_dir.rglob("*"))
        assert not [p for p in step_dir.rglob("*") if p.name.startswith(".part-0-")]  # its cut-short write is gone
        assert Path(moved.local_dir).parent != step_dir.parent
    finally:
        _direct_upload.remove(Path(moved.local_dir).parent)  # its run's dir too, once empty


def test_telling_a_full_disk_from_an_error_ends_on_a_cause_chain_that_loops():
    """An error re-raised while handling itself makes its own ``__context__`` chain a loop:
    looking for ENOSPC along it spun forever (a save's upload thread stuck at 100 % CPU
    after a storage outage, its wait() never returning)."""
    first, second = OSError("connection reset"), RuntimeError("unexpected pos")
    first.__context__, second.__context__ = second, first
    assert _direct_upload.out_of_space(second) is False
    full = OSError(errno.ENOSPC, "No space left on device")
    second.__cause__ = full
    assert _direct_upload.out_of_space(first) is True
