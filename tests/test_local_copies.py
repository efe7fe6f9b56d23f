"""Node-local copies of a save (``checkpoint/save/_local_copies.py``, and local storage's
uploads in ``ray_goodput.storage``): on local storage the staged files are taken as hard
links (the bytes written once, not read back for their checksums), and superseded or
abandoned copies are deleted off the saving thread."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import torch

from ray_goodput import Checkpointer
from ray_goodput.checkpoint.protocol import _catalog, _layout
from ray_goodput.checkpoint.protocol._manifest import read_manifest
from ray_goodput.storage import resolve
from ray_goodput.testing import wait_for
from tests._helpers import dead_pid as _dead_pid


def _staged_and_stored(root: str, staging: Path, step: int) -> list[tuple[Path, Path]]:
    loc = _catalog.step_location(resolve(root), step)
    local_dir = next(staging.iterdir()) / _layout.step_dir(step)
    # What the rank uploaded (the commit writes .metadata into both places itself).
    return [
        (local_dir / f.name, Path(loc.join(f.name)))
        for f in read_manifest(loc).files
        if (local_dir / f.name).exists() and f.name != _layout.DCP_METADATA
    ]


def test_local_storage_on_the_staging_file_system_takes_the_staged_files_as_hard_links(tmp_path):
    import tempfile

    model = torch.nn.Linear(64, 64)
    root = str(tmp_path / "root")
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.save(1, {"model": model})
    pairs = _staged_and_stored(root, tmp_path / "s", 1)
    assert len(pairs) >= 3  # the shard, the rank's extras and metadata part
    assert all(a.stat().st_ino == b.stat().st_ino for a, b in pairs)  # written once
    # Another file system (/dev/shm is tmpfs): a copy, as for any remote storage.
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        assert Path(shm).stat().st_dev != tmp_path.stat().st_dev
        with Checkpointer(root, staging_dir=shm, uploader="thread") as ckpt:
            ckpt.save(2, {"model": model})
        pairs = _staged_and_stored(root, Path(shm), 2)
        assert pairs and all(a.stat().st_ino != b.stat().st_ino and b.stat().st_nlink == 1 for a, b in pairs)
    fresh = torch.nn.Linear(64, 64)
    with Checkpointer(root, staging_dir=str(tmp_path / "s2"), uploader="thread") as ckpt:
        assert ckpt.restore({"model": fresh}) == 2  # its staged copies are gone: read from storage
    assert torch.equal(fresh.weight, model.weight)


def test_a_staged_data_file_taken_as_a_hard_link_is_not_read_back_for_its_checksum(tmp_path, monkeypatch):
    """Its checksums are computed while DCP writes it (was: a second pass over the page
    cache, 40-55 ms per 72 MiB here); the manifest still matches every byte."""
    from ray_goodput.storage import _transfer

    read_back: list[str] = []
    real = _transfer.file_crc32
    monkeypatch.setattr(
        _transfer, "file_crc32", lambda path, *a, **k: read_back.append(str(path)) or real(path, *a, **k)
    )
    root = str(tmp_path / "root")
    model = torch.nn.Linear(256, 256)
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.save(1, {"model": model})
    assert read_back and not any(".distcp" in p for p in read_back), read_back  # the small files are
    step_loc = _catalog.step_location(resolve(root), 1)
    manifest = read_manifest(step_loc)
    assert _catalog.verify(step_loc, manifest, checksums=True) == []
    data = next(f for f in manifest.files if f.name.endswith(".distcp"))
    assert data.blocks and data.block_bytes  # block checksums too, for sparse reads


def test_a_superseded_node_local_copy_is_deleted_off_the_thread_that_saves(tmp_path):
    """Deleting a node-local copy frees its bytes: on the H200 run wait() took 4.8-5.0 s
    while a 14 GB copy was deleted on the caller's thread (inside save() too, at each
    outcome agreement). It must run elsewhere, and still happen."""
    staging = tmp_path / "s"
    on_caller: list[bool] = []

    def hook(event: str, args: tuple) -> None:
        if event == "shutil.rmtree" and str(args[0]).startswith(str(staging)):
            on_caller.append(threading.current_thread() is threading.main_thread())

    # An audit hook cannot be removed: it stays for the rest of the session, recording only
    # deletions under this test's own directory.
    sys.addaudithook(hook)
    state = {"model": torch.nn.Linear(64, 64)}
    with Checkpointer(str(tmp_path / "root"), staging_dir=str(staging), uploader="thread") as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        run_dir = next(staging.iterdir())
        assert (run_dir / _layout.step_dir(1)).is_dir()
        ckpt.save(2, state)
        ckpt.wait()  # step 2 reported: step 1's node-local copy goes
        assert not (run_dir / _layout.step_dir(1)).exists()  # gone from view at once
        wait_for(
            lambda: not [p for p in run_dir.iterdir() if p.name.startswith(".dropped-")],
            timeout_s=30,
            what="the superseded node-local copy to be deleted",
        )
    assert (run_dir / _layout.step_dir(2)).is_dir()
    assert on_caller and not any(on_caller), f"deleted on the saving thread: {on_caller}"


def test_node_local_copies_a_dead_worker_was_deleting_are_collected_by_the_next_checkpointer(tmp_path):
    """A worker killed while its background delete ran leaves a renamed copy (a whole
    shard). The next Checkpointer of the run on the node deletes it at its start, without
    waiting for a commit; a live process's renamed copies are left to that process."""
    root, staging = str(tmp_path / "root"), tmp_path / "s"
    with Checkpointer(root, staging_dir=str(staging), uploader="thread") as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(8, 8)})
    run_dir = next(staging.iterdir())
    dead = _dead_pid()
    left = run_dir / f".dropped-{dead}-{_layout.step_dir(0)}-0123abcd"
    busy = run_dir / f".dropped-{os.getpid()}-{_layout.step_dir(0)}-4567cdef"
    for path in (left, busy):
        (path / "shard").mkdir(parents=True)
        (path / "shard" / "data").write_bytes(b"x" * 1024)
    with Checkpointer(root, staging_dir=str(staging), uploader="thread"):
        wait_for(lambda: not left.exists(), timeout_s=30, what="the dead worker's renamed copy to go")
    assert busy.is_dir()
