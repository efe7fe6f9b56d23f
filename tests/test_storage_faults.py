"""Checkpoints through a storage endpoint that fails a share of requests, and onto a
staging disk that is full: retried and committed, or failed loudly while training goes on."""

from __future__ import annotations

import logging
import subprocess

import pyarrow.fs as pafs
import pytest
import torch

from ray_goodput import Checkpointer, CheckpointError, list_checkpoints, storage
from ray_goodput.checkpoint.protocol import _catalog
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


@pytest.fixture
def tiny_disk(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_staging_disk_fails_that_save_loudly_and_training_goes_on(tiny_disk, tmp_path, caplog):
    root = str(tmp_path / "root")
    small = {"model": torch.nn.Linear(8, 8)}
    big = {"model": torch.nn.Linear(8, 8), "extra": torch.nn.Linear(512, 512)}  # 1 MiB > disk
    ckpt = Checkpointer(root, staging_dir=str(tiny_disk), uploader="thread")
    ckpt.save(1, small)
    ckpt.wait()
    with caplog.at_level(logging.ERROR):
        ckpt.save(2, big)  # returns: the failure happens in the background
        with pytest.raises(CheckpointError, match="No space left|Errno 28"):
            ckpt.wait()  # (waited for before the next save, which would
    ckpt.save(3, small)  # supersede it); training goes on and checkpoints again
    ckpt.wait()
    assert ckpt.stats.failed_saves == 1 and "step 2" in ckpt.stats.last_error
    assert "checkpoint of step 2 failed" in caplog.text
    ckpt.close()
    committed = [i.step for i in list_checkpoints(root) if i.committed]
    assert committed == [1, 3]


def test_a_staging_write_that_fails_while_its_upload_follows_it_leaves_no_object_in_storage(
    tiny_disk, tmp_path, s3_server
):
    """On object storage the data file is uploaded while DCP writes it (``_follow_upload``): a
    write that fails midway (the staging disk filled up) must fail that save alone and
    take back what was sent, not leave a partial object under the file's name."""
    root = s3_server.bucket_uri("tiny-follow")
    small = {"model": torch.nn.Linear(8, 8)}
    big = {"model": torch.nn.Linear(8, 8), "extra": torch.nn.Linear(512, 512)}  # 1 MiB > disk
    ckpt = Checkpointer(root, staging_dir=str(tiny_disk), uploader="thread")
    ckpt.save(1, small)
    ckpt.wait()
    ckpt.save(2, big)
    with pytest.raises(CheckpointError, match="No space left|Errno 28"):
        ckpt.wait()
    ckpt.save(3, small)
    ckpt.wait()
    ckpt.close()
    step2 = _catalog.step_location(storage.resolve(root), 2)
    left = [i.path for i in step2.fs.get_file_info(pafs.FileSelector(step2.root, allow_not_found=True, recursive=True))]
    assert not [p for p in left if p.endswith(".distcp")], left
    assert [i.step for i in list_checkpoints(root) if i.committed] == [1, 3]
