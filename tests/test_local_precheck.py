"""The guess (``checkpoint/restore/_local_precheck.py``): while rank 0 still chooses, the
rank's own node-local data file is mapped and checked in the background; the load takes
that check when the choice names the file, and a guess the choice does not name, or
whose load fails first, is stopped, unmapped and its marker removed."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from ray_goodput import Checkpointer
from ray_goodput.checkpoint.protocol import _layout
from ray_goodput.checkpoint.restore._reader import wait_for_node_local_copies
from ray_goodput.testing import wait_for
from tests._helpers import mapped_paths as _mapped_paths
from tests._helpers import saved_at as _saved_at


def _checksummed_files(monkeypatch) -> list[tuple[str, str, int | None]]:
    """(thread name, path, size) of every check of a mapped file from now on (size None:
    to the end of the file)."""
    from ray_goodput.checkpoint.restore._mmap import MappedFile

    calls: list[tuple[str, str, int | None]] = []
    real = MappedFile.checksum

    def checksum(self, algorithm, offset=0, size=None):
        calls.append((threading.current_thread().name, self.path, size))
        return real(self, algorithm, offset, size)

    monkeypatch.setattr(MappedFile, "checksum", checksum)
    return calls


def _slow_choice(monkeypatch, seconds: float) -> None:
    """Make rank 0's choice take ``seconds`` longer (a slow object store)."""
    from ray_goodput.checkpoint.restore import _choose_and_load

    real = _choose_and_load.choose

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(_choose_and_load, "choose", slow)


def _own_file(local: Path, step: int) -> Path:
    return next((local / _layout.step_dir(step)).glob("__0_*.distcp"))


def _restored(root: str, staging: Path, state: dict):
    """Restore step 1 into ``state`` with a new Checkpointer; its RestoreInfo, once the
    load's background work (unmapping, node-local copy) is done."""
    with Checkpointer(root, staging_dir=str(staging), uploader="thread") as ckpt:
        assert ckpt.restore(state) == 1
        info = ckpt.last_restore
        assert wait_for_node_local_copies(30)
    return info


def _fresh_state(size: int = 256) -> dict:
    model = torch.nn.Linear(size, size)
    return {"model": model, "optim": torch.optim.AdamW(model.parameters())}


def test_the_own_node_local_data_file_is_checked_while_the_checkpoint_is_chosen_and_not_again(tmp_path, monkeypatch):
    """Restoring from the node-local copy, the rank's own data file is mapped and checked
    in the background while the choice runs (rank 0's listing and commit read: storage
    round trips), then taken by the load when the choice names that very file."""
    root, staging = str(tmp_path / "root"), tmp_path / "saved"
    model, _, local = _saved_at(root, staging)
    own = str(_own_file(local, 1))
    checks = _checksummed_files(monkeypatch)
    _slow_choice(monkeypatch, 0.3)  # the guess's check ends first
    fresh = _fresh_state()
    info = _restored(root, staging, fresh)
    assert torch.equal(fresh["model"].weight, model.weight) and info.remote_files == 0 and info.local_files >= 1
    own_checks = [thread for thread, name, _ in checks if name == own]
    assert own_checks and set(own_checks) == {"rg-restore-guess"}, checks  # checked once, in the guess
    assert str(local) not in "".join(_mapped_paths())
    assert not list(local.rglob(".mapping-*"))


def _checks_until_stopped(monkeypatch, seen: list) -> None:
    """Each chunk of a guess's check records whether a marker of its directory exists,
    then waits (up to 10 s) until the guess is stopped: a check that is never stopped
    takes seconds, so a stopped one is known to have been stopped mid-way. Rank 0's
    choice waits (bounded) for the first chunk: on local storage it can come before the
    guess's thread checked anything, and stop it there."""
    from ray_goodput.checkpoint.restore import _choose_and_load, _local_precheck

    made: list = []  # (guess, its directory), recorded before its thread starts
    checking = threading.Event()
    real_init, real_guess, real_combine = (
        _local_precheck.LocalGuess.__init__,
        _local_precheck._guess,
        _local_precheck.combine_checksums,
    )
    real_choose = _choose_and_load.choose

    def choose(*args, **kwargs):
        checking.wait(30)
        return real_choose(*args, **kwargs)

    def init(self, *args, **kwargs):
        made.append([self, None])
        real_init(self, *args, **kwargs)

    def guess(*args, **kwargs):
        step, path = real_guess(*args, **kwargs)
        made[-1][1] = path.parent if path is not None else None
        return step, path

    def combine(*args):
        guess, directory = made[-1]
        seen.append(bool(list(directory.glob(".mapping-*"))))
        checking.set()
        guess._stop.wait(10)
        return real_combine(*args)

    monkeypatch.setattr(_choose_and_load, "choose", choose)
    monkeypatch.setattr(_local_precheck.LocalGuess, "__init__", init)
    monkeypatch.setattr(_local_precheck, "_guess", guess)
    monkeypatch.setattr(_local_precheck, "combine_checksums", combine)


def test_a_guess_the_choice_does_not_name_is_stopped_unmapped_and_the_chosen_step_loads(tmp_path, monkeypatch):
    """The newest node-local step never committed (a save in flight when the job died):
    its file is guessed, then stopped mid-check and dropped when rank 0 picks the
    committed one, which loads as before."""
    from ray_goodput.checkpoint.restore import _local_precheck

    root, staging = str(tmp_path / "root"), tmp_path / "saved"
    model, _, local = _saved_at(root, staging)
    stray = local / _layout.step_dir(9) / "__0_g000099-deadbeef.distcp"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(os.urandom(8 << 20))
    monkeypatch.setattr(_local_precheck, "CHUNK_BYTES", 64 << 10)  # 128 chunks
    seen: list[bool] = []
    _checks_until_stopped(monkeypatch, seen)
    checks = _checksummed_files(monkeypatch)
    fresh = _fresh_state()
    info = _restored(root, staging, fresh)
    assert torch.equal(fresh["model"].weight, model.weight) and info.remote_files == 0
    stray_checks = [thread for thread, path, _ in checks if path == str(stray)]
    assert stray_checks and set(stray_checks) == {"rg-restore-guess"}, checks[:5]  # it was guessed
    assert len(stray_checks) < 128, len(stray_checks)  # and stopped before the end
    assert seen and all(seen)  # its directory was marked while it read
    assert str(stray) not in _mapped_paths()
    assert not list(local.rglob(".mapping-*"))


def test_a_taken_guess_whose_load_fails_first_is_stopped_and_its_marker_outlives_its_reads(tmp_path, monkeypatch):
    """Found in review: when the load failed before DCP asked for the file (here a shape
    mismatch), the reader removed the directory's marker at once while the guess, taken
    as the file's early fetch, went on reading the mapping to its end (a SIGBUS there
    would have left no marker). Dropping the fetch now stops the guess, and the marker
    goes only once it has stopped."""
    from ray_goodput.checkpoint.restore import _local_precheck
    from ray_goodput.errors import StateMismatchError

    root, staging = str(tmp_path / "root"), tmp_path / "saved"
    _, _, local = _saved_at(root, staging, size=512)
    monkeypatch.setattr(_local_precheck, "CHUNK_BYTES", 16 << 10)
    seen: list[bool] = []
    _checks_until_stopped(monkeypatch, seen)
    checks = _checksummed_files(monkeypatch)
    other = torch.nn.Linear(512, 256)  # the same entry names, another shape
    with Checkpointer(root, staging_dir=str(staging), uploader="thread") as ckpt:
        with pytest.raises(StateMismatchError):
            ckpt.restore({"model": other, "optim": torch.optim.AdamW(other.parameters())})
        assert wait_for_node_local_copies(30)
    own = str(_own_file(local, 1))
    chunks = own_size = Path(own).stat().st_size
    guessed = [thread for thread, path, _ in checks if path == own]
    assert guessed and set(guessed) == {"rg-restore-guess"}, checks[:5]
    assert len(guessed) < chunks // (16 << 10), (len(guessed), own_size)  # stopped mid-way
    assert seen and all(seen)  # marked for every read
    # The guess's thread unmaps, then (as the dropped fetch's last reader) removes the marker.
    wait_for(
        lambda: own not in _mapped_paths() and not list(local.rglob(".mapping-*")),
        timeout_s=30,
        what="the stopped guess's unmap and the marker's removal",
    )


def test_a_guessed_own_file_that_fails_its_check_is_read_from_storage(tmp_path, monkeypatch):
    """The guess's checksum does not match the manifest's: the load reads the file from
    storage, as for any damaged node-local file, and the damaged copy is replaced."""
    root, staging = str(tmp_path / "root"), tmp_path / "saved"
    model, _, local = _saved_at(root, staging)
    own = _own_file(local, 1)
    damaged = bytearray(own.read_bytes())
    damaged[100] ^= 0xFF
    own.unlink()  # (a hard link of the stored file: local storage shares the file system)
    own.write_bytes(bytes(damaged))
    checks = _checksummed_files(monkeypatch)
    fresh = _fresh_state()
    info = _restored(root, staging, fresh)
    assert torch.equal(fresh["model"].weight, model.weight) and info.remote_files >= 1
    node_local_checks = {thread for thread, path, _ in checks if path == str(own)}
    assert node_local_checks == {"rg-restore-guess"}, checks  # the guess's verdict was used
    assert own.read_bytes() != bytes(damaged)  # the node-local copy is the stored file again
    assert not list(local.rglob(".mapping-*"))


def test_a_partial_restore_from_the_node_local_copy_checks_only_the_blocks_it_needs(tmp_path, monkeypatch):
    """Found in review: the guess made a model-only restore of a model + optimizer
    checkpoint wait for a whole-file check of the own data file (3x the bytes). A state
    that does not load every entry drops the guess; the load checks only its blocks."""
    from ray_goodput.storage import _checksum

    monkeypatch.setattr(_checksum, "BLOCK_BYTES", 64 << 10)  # small files, the same rule
    root, staging = str(tmp_path / "root"), tmp_path / "saved"
    model, _, local = _saved_at(root, staging, size=512)
    own = _own_file(local, 1)
    checks = _checksummed_files(monkeypatch)
    _slow_choice(monkeypatch, 0.3)  # the guess would have finished: its result must go unused
    fresh = torch.nn.Linear(512, 512)
    info = _restored(root, staging, {"model": fresh})
    assert torch.equal(fresh.weight, model.weight) and info.remote_files == 0
    loads = [size for thread, path, size in checks if path == str(own) and thread != "rg-restore-guess"]
    assert loads and all(size is not None and size < own.stat().st_size / 2 for size in loads), checks
