"""The restore's reads (``checkpoint/restore/_reader.py``, ``_tiered_fs.py``,
``_storage_fetch.py``, ``_mmap.py``): only the files a rank opens are checked, each file is
read from storage once and kept as the node-local copy, files over the memory budget go
to disk, files of local storage are mapped (checked in the page cache, linked as the
copy, unmapped after the load), the rank's own files are fetched early, and partial
restores read only the blocks they need."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest
import torch

from ray_goodput import Checkpointer
from ray_goodput.checkpoint.protocol import _catalog, _collective, _layout
from ray_goodput.checkpoint.protocol._manifest import read_manifest
from ray_goodput.checkpoint.restore._reader import TieredReader, wait_for_node_local_copies
from ray_goodput.errors import CheckpointCorruptError
from ray_goodput.storage import CRC32C, FileEntry, RetryPolicy, resolve
from ray_goodput.testing import FlakyProxy, wait_for
from tests._helpers import dead_pid as _dead_pid
from tests._helpers import mapped_paths as _mapped_paths
from tests._helpers import saved_at as _saved_at


def test_restore_never_checks_a_local_file_it_does_not_open(tmp_path):
    root, staging = str(tmp_path / "root"), tmp_path / "s"
    model = torch.nn.Linear(32, 32)
    with Checkpointer(root, staging_dir=str(staging), uploader="thread") as ckpt:
        ckpt.save(1, {"model": model})
    manifest = read_manifest(_catalog.step_location(resolve(root), 1))
    local_dir = next(staging.iterdir()) / _layout.step_dir(1)
    stranger = local_dir / "extras" / "rank-00009-unrelated.pkl"  # another rank's, damaged
    stranger.parent.mkdir(exist_ok=True)
    stranger.write_bytes(b"garbage")
    entries = {f.name: f for f in manifest.files}
    entries[str(stranger.relative_to(local_dir))] = FileEntry(
        name=str(stranger.relative_to(local_dir)), size=7, crc32=0, algorithm=CRC32C
    )
    reader = TieredReader(
        _catalog.step_location(resolve(root), 1), local_dir, set(entries), entries, policy=None, verified=False
    )
    reader.read_metadata()
    assert reader.local_reads == 1 and reader.remote_reads == 0
    assert str(stranger.relative_to(local_dir)) in reader.fs.unchecked  # never read, never checked
    with Checkpointer(root, staging_dir=str(staging), uploader="thread") as ckpt:
        fresh = torch.nn.Linear(32, 32)
        assert ckpt.restore({"model": fresh}) == 1
        assert ckpt.last_restore.remote_files == 0
    assert torch.equal(fresh.weight, model.weight)


def test_restore_from_storage_reads_each_file_once_and_keeps_the_node_local_copy_after_the_load(tmp_path, s3_server):
    proxy = FlakyProxy(s3_server.endpoint, 0.0)
    try:
        root = s3_server.bucket_uri("whole").replace(s3_server.endpoint, proxy.endpoint)
        model = torch.nn.Linear(1800, 1800)  # a 13 MB data file: two 8 MiB reads before
        with Checkpointer(root, staging_dir=str(tmp_path / "saved"), uploader="thread") as ckpt:
            ckpt.save(1, {"model": model})
        cold = tmp_path / "cold"
        before = proxy.gets(".distcp")
        with Checkpointer(root, staging_dir=str(cold), uploader="thread") as ckpt:
            fresh = torch.nn.Linear(1800, 1800)
            assert ckpt.restore({"model": fresh}) == 1
            assert ckpt.last_restore.remote_files > 0 and ckpt.last_restore.local_files == 0
        gets = {p: n - before.get(p, 0) for p, n in proxy.gets(".distcp").items()}
        assert list(gets.values()) == [1], gets  # the data file: one request, read whole
        assert torch.equal(fresh.weight, model.weight)
        # The fetched files go into the node-local copy once the load is over ...
        assert wait_for_node_local_copies(30)
        with Checkpointer(root, staging_dir=str(cold), uploader="thread") as ckpt:
            again = torch.nn.Linear(1800, 1800)
            assert ckpt.restore({"model": again}) == 1
            assert ckpt.last_restore.remote_files == 0  # ... and the next restore reads it there
        assert torch.equal(again.weight, model.weight)
    finally:
        proxy.close()


def test_a_file_over_the_memory_budget_is_downloaded_to_the_staging_dir_and_checked(tmp_path, s3_server):
    # Object storage: files of local storage are mapped, not held (next tests).
    root, staging = s3_server.bucket_uri("budget"), tmp_path / "s"
    with Checkpointer(root, staging_dir=str(tmp_path / "saved"), uploader="thread") as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(8, 8)})
    step_loc = _catalog.step_location(resolve(root), 1)
    entries = {f.name: f for f in read_manifest(step_loc).files}
    for budget, held in ((0, False), (1 << 20, True)):
        local_dir = staging / f"budget-{budget}"
        local_dir.mkdir(parents=True)
        reader = TieredReader(step_loc, local_dir, set(), entries, RetryPolicy(), hold_bytes=budget)
        reader.fs.prepare(_layout.DCP_METADATA)
        assert (_layout.DCP_METADATA in reader.fs.held) is held
        assert (local_dir / _layout.DCP_METADATA).exists() is not held  # downloaded: on disk now
        reader.release()
        assert reader.fs.held == {}
        reader.fs.prepare(_layout.DCP_METADATA)  # opened after the release: fetched again
        assert (_layout.DCP_METADATA in reader.fs.held) is held
        reader.release()
    damaged = entries[_layout.DCP_METADATA]
    entries[damaged.name] = FileEntry(damaged.name, damaged.size, damaged.crc32 ^ 1, damaged.algorithm)
    for budget in (0, 1 << 20):  # either way a mismatch is an error, and nothing is kept
        local_dir = staging / f"damaged-{budget}"
        local_dir.mkdir(parents=True)
        reader = TieredReader(step_loc, local_dir, set(), entries, RetryPolicy(), hold_bytes=budget)
        with pytest.raises(CheckpointCorruptError, match="manifest says"):
            reader.fs.prepare(_layout.DCP_METADATA)
        reader.release()
        assert wait_for_node_local_copies(30) and not (local_dir / _layout.DCP_METADATA).exists()


# ---- local files are mapped: checked in the page cache, copied from it ----------------------


def _saved_linear(root: str, staging: Path, size: int = 512) -> tuple[torch.nn.Module, Path, dict]:
    model = torch.nn.Linear(size, size)
    with Checkpointer(root, staging_dir=str(staging), uploader="thread") as ckpt:
        ckpt.save(1, {"model": model})
    step_loc = _catalog.step_location(resolve(root), 1)
    entries = {f.name: f for f in read_manifest(step_loc).files}
    return model, Path(step_loc.root), entries


def test_a_file_of_local_storage_is_mapped_checked_unmapped_after_the_load_and_linked_as_the_local_copy(tmp_path):
    root = str(tmp_path / "root")
    model, stored, entries = _saved_linear(root, tmp_path / "saved")
    data = next(n for n in entries if n.endswith(".distcp"))
    local_dir = tmp_path / "cold" / "step"
    local_dir.mkdir(parents=True)
    reader = TieredReader(
        _catalog.step_location(resolve(root), 1), local_dir, set(), entries, RetryPolicy(), hold_bytes=1 << 30
    )
    reader.fs.prepare(data)
    assert data in reader.fs.mapped and data not in reader.fs.held and reader.fs.hold_left == 1 << 30
    assert str(stored / data) in _mapped_paths()
    assert (local_dir / f".mapping-{os.getpid()}").exists()  # while mapped: see _mapped.MapGuard
    with reader.fs.create_stream(data, "rb") as f:
        assert f.read() == (stored / data).read_bytes()
    reader.release()
    assert wait_for_node_local_copies(30)
    assert str(stored / data) not in _mapped_paths()  # unmapped once the copy was made
    assert not (local_dir / f".mapping-{os.getpid()}").exists()
    assert os.stat(local_dir / data).st_ino == os.stat(stored / data).st_ino  # a link, no bytes written
    fresh = torch.nn.Linear(512, 512)
    with Checkpointer(root, staging_dir=str(tmp_path / "cold2"), uploader="thread") as ckpt:
        assert ckpt.restore({"model": fresh}) == 1
        assert ckpt.last_restore.remote_files > 0 and ckpt.last_restore.direct_tensors == 2
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert wait_for_node_local_copies(30)  # the load's mappings are closed in the background
    assert not any(p.startswith(str(tmp_path)) for p in _mapped_paths())


def test_a_node_local_copy_damaged_in_place_fails_its_mapped_check_and_storage_is_read(tmp_path):
    root, staging = str(tmp_path / "root"), tmp_path / "s"
    model, stored, _ = _saved_linear(root, staging)
    local = next(staging.rglob("__0_*.distcp"))
    damaged = bytearray(local.read_bytes())
    damaged[len(damaged) // 2] ^= 0x40  # same size: only the checksum can tell
    local.unlink()  # a hard link of the stored file: replaced, not written through
    local.write_bytes(damaged)
    fresh = torch.nn.Linear(512, 512)
    with Checkpointer(root, staging_dir=str(staging), uploader="thread") as ckpt:
        assert ckpt.restore({"model": fresh}) == 1
        assert ckpt.last_restore.remote_files == 1 and ckpt.last_restore.local_files > 0
    assert torch.equal(fresh.weight, model.weight)
    assert wait_for_node_local_copies(30)  # the load's mappings are closed in the background
    assert not any(p.startswith(str(tmp_path)) for p in _mapped_paths())


def test_a_stored_file_deleted_while_mapped_is_still_read_whole(tmp_path):
    """Retention (or an operator) deleting a checkpoint during a load must not change
    what the load reads: a mapped file stays readable until unmapped."""
    root = str(tmp_path / "root")
    _, stored, entries = _saved_linear(root, tmp_path / "saved")
    data = next(n for n in entries if n.endswith(".distcp"))
    expected = (stored / data).read_bytes()
    reader = TieredReader(_catalog.step_location(resolve(root), 1), tmp_path / "cold", set(), entries, RetryPolicy())
    reader.fs.prepare(data)
    (stored / data).unlink()
    with reader.fs.create_stream(data, "rb") as f:
        assert f.read() == expected
    reader.release()
    assert wait_for_node_local_copies(30)


def test_after_a_restore_died_with_files_mapped_the_next_one_reads_them_instead(tmp_path):
    """A failed read of a mapped file (a disk error, a stale NFS handle) kills the process
    (SIGBUS) instead of raising. The marker such a process leaves makes later restores of
    that step read the files, so damage is an error to fall back from, not a death loop."""
    root, staging = str(tmp_path / "root"), tmp_path / "s"
    model, _, _ = _saved_linear(root, staging)
    local_dir = next(staging.rglob("__0_*.distcp")).parent
    cold_dir = tmp_path / "cold" / local_dir.relative_to(staging)
    cold_dir.mkdir(parents=True)
    for directory in (local_dir, cold_dir):
        (directory / f".mapping-{_dead_pid()}").touch()
    for where, remote in ((tmp_path / "cold", True), (staging, False)):
        fresh = torch.nn.Linear(512, 512)
        with Checkpointer(root, staging_dir=str(where), uploader="thread") as ckpt:
            assert ckpt.restore({"model": fresh}) == 1
            assert (ckpt.last_restore.remote_files > 0) is remote
            assert ckpt.last_restore.direct_tensors == 2
        assert torch.equal(fresh.weight, model.weight)
    assert not list(local_dir.glob(f".mapping-{os.getpid()}"))  # none of its own left
    local = next(local_dir.glob("__0_*.distcp"))
    damaged = bytearray(local.read_bytes())
    damaged[7] ^= 0x01
    local.unlink()
    local.write_bytes(damaged)
    with Checkpointer(root, staging_dir=str(staging), uploader="thread") as ckpt:
        assert ckpt.restore({"model": torch.nn.Linear(512, 512)}) == 1
        assert ckpt.last_restore.remote_files == 1


def test_a_file_fetched_early_is_read_once_and_its_damage_raised_where_dcp_asks_for_it(tmp_path, s3_server):
    """The rank's own files are fetched in the background while DCP plans: DCP's read
    takes that fetch (no second request), a damaged file fails there like any other, and
    the memory reserved for it is given back either way."""
    proxy = FlakyProxy(s3_server.endpoint, 0.0)
    try:
        root = s3_server.bucket_uri("early").replace(s3_server.endpoint, proxy.endpoint)
        _, _, entries = _saved_linear(root, tmp_path / "saved")
        data = next(n for n in entries if n.endswith(".distcp"))
        step_loc = _catalog.step_location(resolve(root), 1)
        before = proxy.gets(".distcp")
        reader = TieredReader(step_loc, tmp_path / "cold", set(), entries, RetryPolicy(), hold_bytes=64 << 20)
        reader.fs.fetch_early([data, "not-in-the-manifest"])
        assert list(reader.fs.early) == [data] and reader.fs.hold_left == (64 << 20) - entries[data].size
        reader.fs.prepare(data, [(0, entries[data].size)])
        assert data in reader.fs.held and reader.remote_reads == 1 and not reader.fs.early
        reader.release()
        assert reader.fs.hold_left == 64 << 20
        gets = {p: n - before.get(p, 0) for p, n in proxy.gets(".distcp").items()}
        assert list(gets.values()) == [1], gets
        wrong = dict(entries)
        wrong[data] = FileEntry(data, entries[data].size, entries[data].crc32 ^ 1, entries[data].algorithm)
        reader = TieredReader(step_loc, tmp_path / "cold2", set(), wrong, RetryPolicy(), hold_bytes=64 << 20)
        reader.fs.fetch_early([data])
        with pytest.raises(CheckpointCorruptError, match="manifest says"):
            reader.fs.prepare(data)
        reader.release()
        assert reader.fs.hold_left == 64 << 20
    finally:
        proxy.close()


def test_a_restore_of_part_of_the_state_reads_only_the_blocks_it_needs_of_its_own_file(tmp_path, monkeypatch):
    """Found in review: the rank's own data file was fetched early, whole, whenever the
    world size was unchanged, also for a model-only restore of a model + optimizer
    checkpoint (on S3, ~3x the bytes it needs)."""
    from ray_goodput.storage import _checksum

    monkeypatch.setattr(_checksum, "BLOCK_BYTES", 64 << 10)  # small files, the same rule
    root = str(tmp_path / "root")
    model = torch.nn.Linear(512, 512)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    optim.step()
    with Checkpointer(root, staging_dir=str(tmp_path / "saved"), uploader="thread") as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
    data = next(f for f in read_manifest(_catalog.step_location(resolve(root), 1)).files if f.name.endswith(".distcp"))
    fresh = torch.nn.Linear(512, 512)
    with Checkpointer(root, staging_dir=str(tmp_path / "cold"), uploader="thread") as ckpt:
        assert ckpt.restore({"model": fresh}) == 1
        read = ckpt.last_restore.remote_bytes
    assert torch.equal(fresh.weight, model.weight)
    assert read < data.size / 2, (read, data.size)  # the model's blocks, not the moments'


def _restore_events(monkeypatch, root: str, staging: Path, state: dict) -> list[str]:
    """Restore ``state`` and return, in order, the files fetched early and the reads of
    ``.metadata`` (``"metadata"``)."""
    from ray_goodput.checkpoint.restore._tiered_fs import TieredFs

    events: list[str] = []
    real_fetch, real_metadata = TieredFs.fetch_early, TieredReader.read_metadata

    def fetch_early(self, names):
        events.extend("early " + ("data" if n.endswith(".distcp") else "other") for n in names)
        return real_fetch(self, names)

    def read_metadata(self, *args, **kwargs):
        events.append("metadata")
        return real_metadata(self, *args, **kwargs)

    monkeypatch.setattr(TieredFs, "fetch_early", fetch_early)
    monkeypatch.setattr(TieredReader, "read_metadata", read_metadata)
    with Checkpointer(root, staging_dir=str(staging), uploader="thread") as ckpt:
        assert ckpt.restore(state) == 1
    monkeypatch.setattr(TieredFs, "fetch_early", real_fetch)
    monkeypatch.setattr(TieredReader, "read_metadata", real_metadata)
    return events


def test_the_own_data_file_is_fetched_before_the_metadata_is_read_when_the_manifest_says_every_entry_loads(
    tmp_path, monkeypatch
):
    """The manifest carries a digest of the checkpoint's entry names: a restore of the
    whole state starts reading its own data file with the RNG blob, before ``.metadata``
    (was after it: one storage round trip, ~15 ms on the S3 server, in series)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from ray_goodput.checkpoint.protocol._dcp_parts import keys_digest

    root = str(tmp_path / "root")
    model, _, _ = _saved_at(root, tmp_path / "saved", size=64)
    loc = _catalog.step_location(resolve(root), 1)
    manifest = read_manifest(loc)
    with loc.fs.open_input_file(loc.join(_layout.DCP_METADATA)) as f:
        import pickle

        saved_keys = pickle.loads(f.read()).state_dict_metadata  # our own file
    assert manifest.state_keys == keys_digest(saved_keys)

    whole = {"model": torch.nn.Linear(64, 64)}
    whole["optim"] = torch.optim.AdamW(whole["model"].parameters())
    events = _restore_events(monkeypatch, root, tmp_path / "whole", whole)
    assert events[:3] == ["early other", "early data", "metadata"], events
    assert torch.equal(whole["model"].weight, model.weight)

    part = {"model": torch.nn.Linear(64, 64)}  # another digest: only the blocks it needs
    assert keys_digest(flatten_state_dict(part)[0]) != manifest.state_keys
    events = _restore_events(monkeypatch, root, tmp_path / "part", part)
    assert "early data" not in events, events
    assert torch.equal(part["model"].weight, model.weight)

    # A manifest written before the digest: the metadata decides, as before.
    record = json.loads(loc.fs.open_input_file(loc.join(_layout.COMMITTED)).read())
    del record["state_keys"]
    with loc.fs.open_output_stream(loc.join(_layout.COMMITTED)) as f:
        f.write(json.dumps(record).encode())
    assert read_manifest(loc).state_keys == ""
    old = {"model": torch.nn.Linear(64, 64)}
    old["optim"] = torch.optim.AdamW(old["model"].parameters())
    events = _restore_events(monkeypatch, root, tmp_path / "old", old)
    assert events.index("early data") > events.index("metadata"), events
    assert torch.equal(old["model"].weight, model.weight)


def test_the_loads_background_work_starts_after_the_restores_last_collective(tmp_path, monkeypatch):
    """Unmapping (which holds the process's memory map) and the node-local copy's writes
    start once the outcome is agreed; started at the end of the load, they ran during
    that last agreement and stretched it from ~1 ms to ~5-20 ms on 2 cores."""
    from ray_goodput.checkpoint.restore import _tiered_fs

    root = str(tmp_path / "root")
    model = torch.nn.Linear(64, 64)
    with Checkpointer(root, staging_dir=str(tmp_path / "saved"), uploader="thread") as ckpt:
        ckpt.save(1, {"model": model})
    order: list[str] = []
    real_agree, real_background = _collective.agree, _tiered_fs._in_background

    def agree(error):
        order.append("agree")
        return real_agree(error)

    def in_background(target, args, name):
        order.append(name)
        return real_background(target, args, name)

    monkeypatch.setattr(_collective, "agree", agree)
    monkeypatch.setattr(_tiered_fs, "_in_background", in_background)
    fresh = torch.nn.Linear(64, 64)
    with Checkpointer(root, staging_dir=str(tmp_path / "cold"), uploader="thread") as ckpt:
        assert ckpt.restore({"model": fresh}) == 1
        assert wait_for_node_local_copies(30)
        local = ckpt.staging / _layout.step_dir(1)
    assert torch.equal(fresh.weight, model.weight)
    first_background = min(order.index(n) for n in ("rg-restore-unmap", "rg-node-local-copy") if n in order)
    assert "agree" not in order[first_background:] and order.count("agree") >= 1, order
    assert "rg-node-local-copy" in order and any(p.suffix == ".distcp" for p in local.iterdir()), order


def test_an_early_fetch_nobody_takes_is_unmapped_when_the_load_ends(tmp_path):
    root = str(tmp_path / "root")
    _, stored, entries = _saved_linear(root, tmp_path / "saved")
    data = next(n for n in entries if n.endswith(".distcp"))
    reader = TieredReader(_catalog.step_location(resolve(root), 1), tmp_path / "cold", set(), entries, RetryPolicy())
    reader.fs.fetch_early([data])
    wait_for(lambda: str(stored / data) in _mapped_paths(), timeout_s=30, what="the early fetch's mapping")
    reader.release()  # e.g. the metadata did not fit the state: DCP never asked for the file
    assert not reader.fs.early
    wait_for(lambda: str(stored / data) not in _mapped_paths(), timeout_s=30, what="the unmap of a dropped fetch")


def test_closing_a_mapping_while_a_view_of_it_is_held_defers_the_unmap(tmp_path):
    from ray_goodput.checkpoint.restore._mmap import map_file

    path = tmp_path / "f"
    path.write_bytes(b"abcdef")
    mapped = map_file(path)
    view = mapped.read_at(1, 3)
    mapped.close()  # no BufferError: unmapped when the view goes
    assert bytes(view) == b"bcd"
    del view
    assert str(path) not in _mapped_paths()
    (tmp_path / "empty").write_bytes(b"")
    assert map_file(tmp_path / "empty") is None and map_file(tmp_path / "missing") is None


def test_a_mapping_marker_under_a_pid_a_later_process_reuses_still_counts_as_a_death(tmp_path):
    """A restore that died with files mapped leaves its marker; a container restarted on
    the same host path can give the next process (this one, here) the dead one's pid, or
    give it to another live process. The guard asked only whether the pid ran, so it mapped
    the files again and could die the same way again. A marker older than the process
    that now has its pid is a dead process's; this process's own current marker is not."""
    from ray_goodput.checkpoint.restore._mmap import MapGuard

    stale = tmp_path / f".mapping-{os.getpid()}"
    stale.touch()
    old = psutil.Process().create_time() - 3600  # before this process started
    os.utime(stale, (old, old))
    assert MapGuard(tmp_path).allowed is False
    stale.unlink()
    alive = MapGuard(tmp_path)  # a guard of this process marks when it maps
    mapped = tmp_path / "f"
    mapped.write_bytes(b"x" * 16)
    assert alive.map(mapped) is not None and (tmp_path / f".mapping-{os.getpid()}").exists()
    assert MapGuard(tmp_path).allowed is True  # a marker of this process, now: a live restore
    alive.done()
