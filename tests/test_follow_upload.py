"""Uploading a shard's data file to object storage while DCP writes it (``checkpoint/uploader/_follow_upload.py``):
real S3 (moto over HTTP), real writer threads, real DCP writes."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from ray_goodput import Checkpointer
from ray_goodput.checkpoint.protocol import _catalog
from ray_goodput.checkpoint.protocol._manifest import read_manifest
from ray_goodput.checkpoint.uploader._follow_upload import FollowUpload
from ray_goodput.storage import CRC32C, checksum, file_crc32, resolve
from ray_goodput.testing import FlakyProxy, wait_for


def _write_slowly(path, chunks: list[bytes], pause_s: float = 0.01) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            f.flush()
            time.sleep(pause_s)


def _sent(proxy: FlakyProxy, name: str) -> bool:
    """Whether a request that writes ``name`` (a part, or the object) reached the server."""
    return any(method != "GET" and name in path for (method, path) in list(proxy.requests))


def _exists(loc, name: str) -> bool:
    return loc.fs.get_file_info(loc.join(name)).type.name != "NotFound"


def test_a_file_followed_while_it_is_written_is_uploaded_whole_with_its_checksums(s3_server, tmp_path):
    proxy = FlakyProxy(s3_server.endpoint)
    loc = resolve(s3_server.bucket_uri("follow-ok").replace(s3_server.endpoint, proxy.endpoint))
    path = tmp_path / "part" / "__0_0.distcp"
    chunks = [bytes([i]) * (1 << 20) for i in range(24)]  # over one part: a multipart upload
    follow = FollowUpload(path, tmp_path / "final", loc, "f.distcp", CRC32C)  # started before the file exists
    held: list[bool] = []

    def write() -> None:
        # The last chunks wait until a part was sent: sending must begin before the write
        # ends (asserting the writer was still alive raced the follower under load).
        _write_slowly(path, chunks[:20], 0.01)
        try:
            held.append(
                bool(
                    wait_for(
                        lambda: _sent(proxy, "f.distcp"), timeout_s=60, what="a part sent while the file is written"
                    )
                )
            )
        except TimeoutError:
            held.append(False)
        with open(path, "ab") as f:
            for chunk in chunks[20:]:
                f.write(chunk)

    writer = threading.Thread(target=write)
    writer.start()
    writer.join(timeout=120)
    assert not writer.is_alive() and held == [True]  # sending began before the write ended
    follow.writer_done(ok=True)
    entry = follow.result(path, timeout_s=60, stop_s=10)
    data = b"".join(chunks)
    assert entry is not None and (entry.size, entry.crc32) == (len(data), checksum(data, CRC32C))
    assert (entry.size, entry.crc32) == file_crc32(path, CRC32C)
    with loc.fs.open_input_file(loc.join("f.distcp")) as f:
        assert f.read() == data
    proxy.close()


def test_a_write_that_fails_while_followed_leaves_no_object_and_no_entry(s3_server, tmp_path):
    proxy = FlakyProxy(s3_server.endpoint)
    loc = resolve(s3_server.bucket_uri("follow-fail").replace(s3_server.endpoint, proxy.endpoint))
    path = tmp_path / "part" / "__0_0.distcp"
    follow = FollowUpload(path, tmp_path / "final", loc, "f.distcp", CRC32C)
    _write_slowly(path, [b"x" * (1 << 20)] * 16)
    wait_for(lambda: _sent(proxy, "f.distcp"), timeout_s=60, what="a part of the followed file sent")
    follow.abandon(timeout_s=60)  # e.g. the staging disk filled up
    assert not _exists(loc, "f.distcp")  # what was sent is taken back before abandon returns
    assert follow.result(path, timeout_s=1, stop_s=1) is None
    proxy.close()


def test_a_follower_that_followed_another_file_than_the_one_written_is_not_used(s3_server, tmp_path):
    """Found in review: a file a killed writer left at the same path, of the same size,
    was taken for the new one (sizes alone were compared): the renamed file must be the
    very file followed (its inode)."""
    loc = resolve(s3_server.bucket_uri("follow-other"))
    path, final = tmp_path / "part" / "__0_0.distcp", tmp_path / "final"
    follow = FollowUpload(path, final, loc, "f.distcp", CRC32C)
    _write_slowly(path, [b"y" * 1000])
    # As the writer does: renamed, then done. (Done without the rename, a follower that had
    # not opened the file yet on a loaded machine looked for it under the final name in vain.)
    path.rename(final)
    follow.writer_done(ok=True)
    other = tmp_path / "written.distcp"
    other.write_bytes(b"z" * 1000)  # same size, another file
    assert follow.result(other, timeout_s=60, stop_s=10) is None  # the caller uploads the file itself
    assert follow.result(final, timeout_s=60, stop_s=10) is not None


def test_on_object_storage_each_data_file_is_uploaded_while_dcp_writes_it(s3_server, tmp_path, caplog):
    root = s3_server.bucket_uri("follow-save")
    model = torch.nn.Linear(600, 600)
    with caplog.at_level(logging.DEBUG, logger="ray_goodput.checkpoint.uploader._shard_job"):
        with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
            ckpt.save(1, {"model": model})
            ckpt.wait()
    assert "uploaded while it was written" in caplog.text
    manifest = read_manifest(_catalog.step_location(resolve(root), 1))
    data = next(f for f in manifest.files if f.name.endswith(".distcp"))
    staged = next((tmp_path / "s").rglob(data.name))  # the node-local copy, the same bytes
    assert (data.size, data.crc32) == file_crc32(staged, data.algorithm) and data.blocks
    fresh = torch.nn.Linear(600, 600)
    with Checkpointer(root, staging_dir=str(tmp_path / "cold"), uploader="thread") as ckpt:
        assert ckpt.restore({"model": fresh}) == 1
    assert torch.equal(fresh.weight, model.weight)


@pytest.mark.parametrize("ok", [True, False])
def test_a_follower_whose_file_never_appears_ends_when_told(s3_server, tmp_path, ok):
    loc = resolve(s3_server.bucket_uri(f"follow-none-{ok}"))
    follow = FollowUpload(tmp_path / "never" / "__0_0.distcp", tmp_path / "never" / "final", loc, "f.distcp", CRC32C)
    follow.writer_done(ok=ok)
    assert follow.result(tmp_path / "never", timeout_s=30, stop_s=10) is None and not _exists(loc, "f.distcp")


def test_a_write_over_before_the_follower_looked_is_read_under_its_final_name(s3_server, tmp_path):
    """A small file is written and renamed before the follower first polls (found on a
    1.4 MB shard: the follower gave up, and the file was uploaded a second time)."""
    loc = resolve(s3_server.bucket_uri("follow-late"))
    final = tmp_path / "final.distcp"
    final.write_bytes(b"w" * 5000)
    follow = FollowUpload(tmp_path / "part" / "__0_0.distcp", final, loc, "f.distcp", CRC32C)
    follow.writer_done(ok=True)
    entry = follow.result(final, timeout_s=60, stop_s=10)
    assert entry is not None and (entry.size, entry.crc32) == file_crc32(final, CRC32C)


def test_a_followed_upload_records_blocks_of_the_size_uploads_use_now(s3_server, tmp_path, monkeypatch):
    """Found by `benchmarks/storage_requests.py`: the follower took the block size at
    import, so with blocks set to 64 KiB a rank read every other rank's file whole again
    (2.00x its own shard at world 2, against 1.03x before the follower)."""
    from ray_goodput.storage import _checksum

    monkeypatch.setattr(_checksum, "BLOCK_BYTES", 64 << 10)
    root = s3_server.bucket_uri("follow-blocks")
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(600, 600)})
    manifest = read_manifest(_catalog.step_location(resolve(root), 1))
    data = next(f for f in manifest.files if f.name.endswith(".distcp"))
    assert data.block_bytes == 64 << 10 and len(data.blocks) == -(-data.size // (64 << 10))
