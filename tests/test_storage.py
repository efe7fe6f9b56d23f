"""Storage module against a local directory and a real S3 endpoint (moto server over HTTP)."""

from __future__ import annotations

import errno
import os
import zlib
from pathlib import Path

import pytest

from ray_goodput import storage
from ray_goodput.errors import ConfigError, StorageError, StorageUnusableError


@pytest.fixture(params=["local", "s3"])
def location(request, tmp_path, s3_server):
    if request.param == "local":
        return storage.resolve(str(tmp_path / "root"))
    return storage.resolve(s3_server.bucket_uri("root"))


def test_upload_download_round_trip(location, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    blobs = {f"d/f{i}.bin": os.urandom(1000 * (i + 1)) for i in range(5)}
    pairs = []
    for name, data in blobs.items():
        p = src / name.replace("/", "_")
        p.write_bytes(data)
        pairs.append((p, name))
    entries = storage.upload_files(pairs, location, concurrency=3)
    assert [e.name for e in entries] == list(blobs)
    for e in entries:
        assert e.size == len(blobs[e.name]) and e.crc32 == zlib.crc32(blobs[e.name])
    listed = {i.path.rsplit("/", 1)[-1]: i.size for i in storage.list_dir(location, "d")}
    assert listed == {n.split("/")[1]: len(b) for n, b in blobs.items()}
    got = storage.download_files(list(blobs), location, tmp_path / "dst", concurrency=2)
    for e, (name, data) in zip(got, blobs.items()):
        assert (tmp_path / "dst" / name).read_bytes() == data
        assert e.crc32 == zlib.crc32(data)
    storage.delete_dir(location, "d")
    assert storage.list_dir(location, "d") == []


def test_small_objects_and_missing(location):
    storage.write_bytes(location, "x/meta.json", b"{}")
    assert storage.read_bytes(location, "x/meta.json") == b"{}"
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(location, "x/nope.json")


def test_probe_succeeds_on_usable_storage(location):
    location.probe()
    assert [i for i in storage.list_dir(location) if "probe" in i.path] == []


def test_probe_names_uri_when_directory_is_read_only(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root ignores mode bits; a file in the way fails for everyone
        blocker = tmp_path / "file"
        blocker.write_text("x")
        target = blocker / "sub"
    else:
        target = ro / "sub"
    with pytest.raises(StorageUnusableError, match="not usable"):
        storage.resolve(str(target)).probe()


def test_bad_uri_is_config_error():
    with pytest.raises(ConfigError, match="storage_path"):
        storage.resolve("")
    with pytest.raises(ConfigError, match="cannot resolve"):
        storage.resolve("nosuchscheme://x/y")


def test_env_endpoint_applies_to_plain_s3_uri(monkeypatch, s3_server):
    uri = s3_server.bucket_uri("p")
    plain = uri.split("?")[0]
    monkeypatch.setenv("RAY_GOODPUT_S3_ENDPOINT", f"http://{s3_server.endpoint}")
    loc = storage.resolve(plain)
    loc.probe()


def test_a_local_upload_is_fsynced_before_it_is_renamed_into_place_and_a_failed_write_leaves_no_temp(
    tmp_path, monkeypatch
):
    """The local upload renamed its file into place, then fsynced it: after a crash the
    final name (a replayed upload's, replacing a committed file) could hold a short file.
    And a small write whose fsync or move failed left its temp file beside COMMITTED."""
    import os

    from ray_goodput.storage import _transfer

    loc = storage.resolve(str(tmp_path / "dest"))
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 4096)
    calls: list[str] = []
    real_fsync, real_replace = _transfer.fsync_file, os.replace
    monkeypatch.setattr(_transfer, "fsync_file", lambda p: (calls.append(f"fsync {Path(p).name}"), real_fsync(p)))
    monkeypatch.setattr(
        _transfer.os, "replace", lambda a, b: (calls.append(f"rename {Path(a).name}"), real_replace(a, b))
    )
    for link in (False, True):
        calls.clear()
        storage.upload_file(src, loc, f"copy-{link}.bin", link=link)
        tmp = next(c.split()[1] for c in calls if c.startswith("rename"))
        assert calls.index(f"fsync {tmp}") < calls.index(f"rename {tmp}"), calls

    def broken(path):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(_transfer, "fsync_file", broken)
    with pytest.raises(StorageError):
        storage.write_bytes(loc, "COMMITTED", b"{}", policy=storage.RetryPolicy(attempts=1))
    assert sorted(p.name for p in Path(loc.root).iterdir() if "COMMITTED" in p.name) == []


def test_a_name_too_long_is_not_retried():
    """pyarrow raises a plain OSError with the errno: ENAMETOOLONG went through every retry
    (about 4 s and five warnings by default), as if the name could get shorter."""
    import errno

    assert not storage.is_transient(OSError(errno.ENAMETOOLONG, "File name too long"))
    assert storage.is_transient(OSError(errno.ECONNRESET, "Connection reset by peer"))


def test_retry_policy_retries_transient_only():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError("AWS Error NETWORK_CONNECTION during PutObject: connection reset")
        return "ok"

    policy = storage.RetryPolicy(attempts=4, initial_delay=0.01, max_delay=0.02)
    assert policy.call("op", flaky) == "ok" and len(calls) == 3


@pytest.mark.parametrize(
    "permanent",
    [
        FileNotFoundError(2, "no such key"),
        PermissionError(13, "denied"),
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EROFS, "read-only"),
    ],
)
def test_permanent_errors_are_classified_by_type_and_not_retried(permanent):
    calls = []

    def fail():
        calls.append(1)
        raise permanent

    policy = storage.RetryPolicy(attempts=4, initial_delay=0.01, max_delay=0.02)
    with pytest.raises(StorageError, match="op failed after 1 attempt"):
        policy.call("op", fail)
    assert len(calls) == 1


def test_untyped_refusal_is_retried_to_the_bound_then_raised_naming_the_attempts():
    """pyarrow raises S3 refusals (403, missing bucket on write) as a plain OSError with no
    errno: indistinguishable by type from a reset, so retried a bounded number of times.
    (Refusals at start are caught by the probe as StorageUnusableError.)"""
    calls = []

    def denied():
        calls.append(1)
        raise OSError("AWS Error ACCESS_DENIED during PutObject")

    policy = storage.RetryPolicy(attempts=3, initial_delay=0.01, max_delay=0.02)
    with pytest.raises(StorageError, match="op failed after 3 attempt"):
        policy.call("op", denied)
    assert len(calls) == 3


def test_a_write_into_a_directory_removed_right_after_its_creation_re_creates_it(tmp_path):
    """Retention removes a checkpoint directory once empty; a rank that had just created it
    for its first file lost that write (FileNotFoundError) and with it the save."""
    from ray_goodput.storage._transfer import _into_dir

    loc = storage.resolve(str(tmp_path / "root"))
    parent = loc.join("step-000000001", "extras")
    removed = []

    def write() -> int:
        if not removed:  # the retention pass, between our mkdir and our write
            os.rmdir(parent)
            removed.append(parent)
        with open(os.path.join(parent, "f"), "wb") as out:
            return out.write(b"data")

    assert _into_dir(loc, parent, write) == 4 and removed
    with pytest.raises(FileNotFoundError):  # a missing source still fails
        _into_dir(loc, parent, lambda: open(tmp_path / "no-such-file", "rb"))  # noqa: SIM115 - the open must fail: nothing to close


def test_listing_a_directory_created_while_it_is_listed_never_fails(tmp_path):
    """A restore lists ``checkpoints/`` while the generation claim may be creating it.
    pyarrow's local listing looks for the directory only after a failed listing, so one
    created between the two raised FileNotFoundError (a CI failure of a fresh-start restore).
    Here a thread creates and removes the directory without pause to hit that window."""
    import threading
    import time

    loc = storage.resolve(str(tmp_path / "root"))
    os.makedirs(loc.root)
    target = os.path.join(loc.root, "d")
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            os.mkdir(target)
            os.rmdir(target)

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    failures: list[BaseException] = []
    deadline = time.monotonic() + 2.0
    try:
        for _ in range(20_000):  # before the fix: about one listing in 30 failed
            try:
                assert storage.list_dir(loc, "d") == []
            except (StorageError, FileNotFoundError) as exc:
                failures.append(exc)
            if time.monotonic() > deadline:
                break
    finally:
        stop.set()
        flipper.join(timeout=10)
    assert not flipper.is_alive()
    assert failures == []


def test_a_small_write_to_s3_is_one_request_not_a_three_request_multipart_upload(s3_server):
    """pyarrow's S3 output stream starts a multipart upload when opened: every marker,
    manifest and metadata part cost three round trips (POST, PUT, POST) instead of one PUT."""
    from ray_goodput.testing import FlakyProxy

    proxy = FlakyProxy(s3_server.endpoint)
    try:
        uri = s3_server.bucket_uri("small").replace(s3_server.endpoint, proxy.endpoint)
        loc = storage.resolve(uri)
        proxy.requests.clear()
        storage.write_bytes(loc, "marker.json", b'{"rank": 0}')
        assert {m for m, _ in proxy.requests} == {"PUT"} and sum(proxy.requests.values()) == 1, dict(proxy.requests)
        assert storage.read_bytes(loc, "marker.json") == b'{"rank": 0}'
    finally:
        proxy.close()


def test_a_missing_bucket_fails_the_probe_at_start_although_streams_open_lazily(s3_server):
    """With lazily opened S3 streams the error comes at close, not at open: the probe still
    meets it, at start."""
    uri = f"s3://no-such-bucket-{os.getpid()}/run?endpoint_override={s3_server.endpoint}&scheme=http"
    with pytest.raises(StorageUnusableError, match="not usable"):
        storage.resolve(uri).probe()


def test_a_failing_s3_request_is_retried_by_the_retry_policy_not_dozens_of_times_by_the_client(s3_server):
    """pyarrow's S3 client retries on its own under RetryPolicy: a read of an endpoint that
    answers every request with an error took 6 s and ~40 requests before RetryPolicy saw it,
    so a policy of 6 attempts meant minutes, not the bound it states. The client now makes
    ``S3_CLIENT_RETRIES`` quick retries (~0.4 s in all), also on a location passed to an actor."""
    import pickle

    from ray_goodput.storage._uri import S3_CLIENT_RETRIES
    from ray_goodput.testing import FlakyProxy

    proxy = FlakyProxy(s3_server.endpoint, failure_rate=1.0)
    try:
        loc = storage.resolve(s3_server.bucket_uri("failing").replace(s3_server.endpoint, proxy.endpoint))
        for where in (loc, pickle.loads(pickle.dumps(loc))):
            before = proxy.counts["failed"]
            with pytest.raises(OSError):
                with where.fs.open_input_file(where.join("obj")) as f:
                    f.read()
            # (curl itself sends a request once more when a reused connection was reset)
            assert proxy.counts["failed"] - before <= 2 * (1 + S3_CLIENT_RETRIES), proxy.counts
    finally:
        proxy.close()


@pytest.mark.parametrize("algorithm", [storage.CRC32, storage.CRC32C])
def test_block_checksums_check_each_block_and_combine_into_the_whole_files(algorithm, tmp_path):
    import io

    data = os.urandom(3 * 1000 + 517)
    blocks: list[int] = []
    size, crc = storage.copy_stream(
        io.BytesIO(data), algorithm=algorithm, chunk_bytes=700, blocks=blocks, block_bytes=1000
    )  # chunks cross block edges
    assert (size, crc) == (len(data), storage.checksum(data, algorithm))
    assert blocks == [storage.checksum(data[i : i + 1000], algorithm) for i in range(0, len(data), 1000)]
    for cut in (0, 1, 999, 1000, len(data)):
        head, tail = data[:cut], data[cut:]
        assert storage.combine_checksums(
            storage.checksum(head, algorithm), storage.checksum(tail, algorithm), len(tail), algorithm
        ) == storage.checksum(data, algorithm)
    path = tmp_path / "f"
    path.write_bytes(data)
    again: list[int] = []
    assert storage.file_crc32(path, algorithm, blocks=again, block_bytes=1000) == (size, crc) and again == blocks


def test_a_file_entry_keeps_its_block_checksums_and_older_entries_have_none():
    entry = storage.FileEntry("a", 2500, 7, storage.CRC32C, block_bytes=1000, blocks=(1, 2, 3))
    assert storage.FileEntry.from_json(entry.to_json()) == entry
    old = storage.FileEntry.from_json({"name": "a", "size": 2500, "crc32": 7})
    assert old.blocks == () and old.block_bytes == 0 and old.algorithm == storage.CRC32
    with pytest.raises(ValueError, match="3 block checksums"):
        storage.FileEntry("a", 2500, 7, storage.CRC32C, block_bytes=1000, blocks=(1, 2))


def test_an_upload_over_an_existing_local_file_replaces_it_and_a_mapping_of_the_old_keeps_its_bytes(tmp_path):
    """A restore may have a stored file mapped (``checkpoint/_mapped``): an upload of the
    same name (a retried or replayed one) must replace the file, not truncate and rewrite
    it under the mapping (SIGBUS, or bytes changed after their check)."""
    import mmap

    loc = storage.resolve(str(tmp_path / "store"))
    first, second = tmp_path / "a", tmp_path / "b"
    first.write_bytes(b"A" * 8192)
    second.write_bytes(b"B" * 4096)
    storage.upload_file(first, loc, "f.distcp")
    stored = tmp_path / "store" / "f.distcp"
    with open(stored, "rb") as f:
        old = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    inode = stored.stat().st_ino
    storage.upload_file(second, loc, "f.distcp")
    assert stored.read_bytes() == b"B" * 4096 and stored.stat().st_ino != inode
    assert old[:] == b"A" * 8192  # the mapped file was never cut short or rewritten
    old.close()
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["f.distcp"]  # nothing left aside


# ---- checksums computed while a file is written ---------------------------------------------


@pytest.mark.parametrize("writeback", [False, True])
def test_a_file_checksummed_as_written_matches_reading_it_back_block_by_block(tmp_path, writeback):
    data = os.urandom(3 * 4096 + 123)
    path = tmp_path / "f"
    with storage.ChecksummedWrite(open(path, "wb"), storage.CRC32C, 4096, writeback=writeback) as out:
        for start, end in ((0, 1), (1, 5000), (5000, 5000), (5000, 12000), (12000, len(data))):
            out.write(memoryview(data)[start:end])  # torch.save writes memoryviews
        assert out.tell() == len(data)
    blocks: list[int] = []
    assert storage.file_crc32(path, storage.CRC32C, blocks=blocks, block_bytes=4096) == (len(data), out.result().crc32)
    assert out.result() == storage.Written(
        size=len(data), crc32=out.result().crc32, algorithm=storage.CRC32C, block_bytes=4096, blocks=tuple(blocks)
    )
    assert path.read_bytes() == data


def test_a_seek_while_written_leaves_the_checksum_unknown(tmp_path):
    with storage.ChecksummedWrite(open(tmp_path / "f", "wb"), storage.CRC32C, 4096, writeback=False) as out:
        out.write(b"abcd")
        out.seek(0)
        out.write(b"x")
    assert out.result() is None  # the upload reads such a file back


def test_a_linked_upload_takes_known_checksums_only_for_the_file_they_describe(tmp_path):
    src, root = tmp_path / "staged", tmp_path / "root"
    src.write_bytes(b"payload")
    loc = storage.resolve(str(root))
    right = storage.Written(
        size=7,
        crc32=storage.checksum(b"payload", storage.CRC32C),
        algorithm=storage.CRC32C,
        block_bytes=storage.upload_block_bytes(),
        blocks=(storage.checksum(b"payload"),),
    )
    entry = storage.upload_file(src, loc, "a", algorithm=storage.CRC32C, link=True, known=right)
    assert (entry.size, entry.crc32, entry.blocks) == (7, right.crc32, right.blocks)
    wrong_size = storage.Written(
        size=8, crc32=1, algorithm=storage.CRC32C, block_bytes=storage.upload_block_bytes(), blocks=(1,)
    )
    entry = storage.upload_file(src, loc, "b", algorithm=storage.CRC32C, link=True, known=wrong_size)
    assert entry.crc32 == right.crc32  # read back: the known sums describe another file
    # The writer chose its block size from a size hint: its sums are taken with that size.
    other_blocks = storage.Written(
        size=7, crc32=right.crc32, algorithm=storage.CRC32C, block_bytes=4096, blocks=right.blocks
    )
    entry = storage.upload_file(src, loc, "c", algorithm=storage.CRC32C, link=True, known=other_blocks)
    assert (entry.block_bytes, entry.blocks) == (4096, right.blocks)


def test_a_large_file_gets_larger_blocks_so_its_entry_lists_at_most_max_blocks(tmp_path, monkeypatch):
    """At 1 MiB blocks a 16 GiB shard would list 16k checksums, in every manifest read."""
    from ray_goodput.storage import _checksum

    monkeypatch.setattr(_checksum, "BLOCK_BYTES", 1024)
    monkeypatch.setattr(_checksum, "MAX_BLOCKS", 8)
    src = tmp_path / "f"
    src.write_bytes(os.urandom(3 * 8 * 1024 + 5))
    entry = storage.upload_file(src, storage.resolve(str(tmp_path / "root")), "f", algorithm=storage.CRC32C)
    blocks: list[int] = []
    assert storage.file_crc32(src, storage.CRC32C, blocks=blocks, block_bytes=4096) == (entry.size, entry.crc32)
    assert entry.block_bytes == 4096 and entry.blocks == tuple(blocks) and len(blocks) == 7
    assert storage.upload_block_bytes(8 * 1024) == 1024  # at the cap: the set size


def test_checksums_of_buffers_over_a_slice_match_the_whole_buffer_checksum_for_every_buffer_kind():
    """checksum() computes a buffer over GIL_SLICE_BYTES in slices (google-crc32c holds the
    GIL through a call); the result must be the one-call checksum for every kind of buffer
    callers pass (bytes, bytearray, pyarrow buffers, memoryviews of other formats)."""
    import array

    import google_crc32c
    import pyarrow as pa

    from ray_goodput.storage import _checksum

    slice_bytes = _checksum.GIL_SLICE_BYTES
    for size in (0, 1, slice_bytes - 1, slice_bytes, slice_bytes + 1, 3 * slice_bytes + 7):
        data = os.urandom(size - size % 4)
        floats = array.array("f")
        floats.frombytes(data)
        for buf in (data, bytearray(data), pa.py_buffer(data), memoryview(data), memoryview(floats)):
            assert storage.checksum(buf, storage.CRC32C) == google_crc32c.value(data), (size, type(buf))
            assert storage.checksum(buf, storage.CRC32) == zlib.crc32(data), (size, type(buf))
