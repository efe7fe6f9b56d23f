"""A snapshot arena: one memory-mapped file that outlives the worker process.

``save()`` copies tensors into an arena (a memcpy, or a device-to-host copy on GPU) and
returns; the node's uploader maps the same file when it accepts the job and writes DCP
files from it. If the worker is killed right after ``save()`` returned, the snapshot is
still there; once mapped, unlinking the file cannot take it away. Each rank has two
(one being written out, one waiting). The file lives in /dev/shm when it has room, else
in the staging directory.

Whether a waiting job's snapshot is still wanted is settled by a *claim* beside the arena
(:func:`claim`): the first of the worker (superseding the job, to reuse the arena) and the
uploader (starting to read it) to create the job's claim file wins, with no message and no
wait between the two processes.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import itertools
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ray_goodput._faults import fault_point
from ray_goodput.errors import CheckpointError
from ray_goodput.runtime import pid_alive

logger = logging.getLogger(__name__)
_ALIGN = 64
_PAGE = 4096
_SHM = Path("/dev/shm")
_ARENA_NAME = r"^rank-\d+-(\d+)(?:-\d+)?(?:-[0-9a-f]+)?\.arena"  # group 1: the worker's pid
_NAME_RE = re.compile(_ARENA_NAME + "$")
_CLAIM_RE = re.compile(_ARENA_NAME + r"\.[0-9a-f]+\.claim$")
_HELD_RE = re.compile(_ARENA_NAME + r"\.[0-9a-f]+\.held$")
#: A dead worker's claim files older than this are swept: an uploader has looked at its
#: claim long before (a job waits at most for the running one's deadline).
_CLAIM_SWEEP_AGE_S = 24 * 3600.0
#: Another run's arenas and claims of dead workers are swept once untouched this long: by
#: then its node's uploader has run or given up every job that could still read them.
OTHER_RUN_SWEEP_AGE_S = 3600.0
_SHM_ROOT = _SHM / "ray_goodput"

_instances = itertools.count()


def arena_names(rank: int) -> tuple[str, str]:
    """The file names of a new Checkpointer's two arenas: its process and its own number
    in it (two Checkpointers of one process on one run, a trainer's and one that only
    restores, say, must not share files)."""
    pid, instance = os.getpid(), next(_instances)
    return tuple(f"rank-{rank:05d}-{pid}-{index}-{instance:x}.arena" for index in (0, 1))


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in an arena. ``offset``/``nbytes`` in bytes."""

    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def pick_dir(staging: Path, need_bytes: int) -> Path:
    """/dev/shm when it has twice ``need_bytes`` free, else ``staging``."""
    if _SHM.is_dir() and shutil.disk_usage(_SHM).free > 2 * need_bytes:
        return _SHM_ROOT
    return staging


def sweep_dead(directory: Path, *, other_runs: bool | None = None) -> None:
    """Remove arenas of processes that died (a killed worker cannot remove its own), and
    their claim files once old (an uploader may still look at a young one).

    ``directory`` is one run's. With ``other_runs`` (by default: when it is in /dev/shm,
    where a left arena holds memory until the node reboots) the other runs' directories
    beside it are swept too, of dead workers' arenas and claims untouched for
    ``OTHER_RUN_SWEEP_AGE_S``, and removed once empty: a run whose workers were all killed
    leaves them, and no later worker of that run may come to sweep them."""
    now = time.time()
    for path in directory.glob("rank-*.arena") if directory.is_dir() else []:
        match = _NAME_RE.match(path.name)
        written = _mtime(path)
        if match is None or written is None:
            continue
        pid = int(match.group(1))
        if pid_alive(pid, since=written):  # a later process given its pid is not its worker
            continue
        if _held_for_a_job(path, now):
            logger.info("kept the snapshot arena of dead process %d: a job of it waits for an uploader", pid)
            continue
        path.unlink(missing_ok=True)
        logger.info("removed the snapshot arena of dead process %d", pid)
    for path in directory.glob("rank-*.claim") if directory.is_dir() else []:
        match = _CLAIM_RE.match(path.name)
        written = _mtime(path)
        if match is None or written is None or pid_alive(int(match.group(1)), since=written):
            continue
        if now - written > _CLAIM_SWEEP_AGE_S:
            path.unlink(missing_ok=True)
    for path in directory.glob("rank-*.held") if directory.is_dir() else []:
        if not path.with_name(path.name.split(".arena.", 1)[0] + ".arena").exists():  # nothing to keep
            path.unlink(missing_ok=True)
    if other_runs if other_runs is not None else directory.parent == _SHM_ROOT:
        for run in _dirs(directory.parent):
            if run != directory:
                _sweep_other_run(run, now)


def held_for_a_job(arena: Path) -> bool:
    """Whether a job no uploader has mapped yet still needs ``arena`` (see ``mark_held``)."""
    return _held_for_a_job(arena, time.time())


def _held_for_a_job(arena: Path, now: float) -> bool:
    """Whether a job no uploader has mapped yet still needs ``arena`` (``mark_held``): a
    mark younger than ``OTHER_RUN_SWEEP_AGE_S`` whose uploader, if it names one, lives (a
    mark that does not is removed)."""
    keep = False
    for mark in arena.parent.glob(arena.name + ".*.held"):
        written = _mtime(mark)
        if written is not None and now - written <= OTHER_RUN_SWEEP_AGE_S and _reader_alive(mark, written):
            keep = True
        else:
            mark.unlink(missing_ok=True)
    return keep


def _reader_alive(mark: Path, written: float) -> bool:
    """Whether the uploader a mark names (none: a job in a file, which any uploader takes)
    still runs."""
    try:
        text = mark.read_text().strip()
    except OSError:  # removed meanwhile, or unreadable: keep the arena
        return True
    return not text.isdigit() or pid_alive(int(text), since=written)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # removed meanwhile
        return None


def _dirs(root: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _sweep_other_run(run: Path, now: float) -> None:
    """Another run's directory: its dead workers' old arenas and claims, then the directory
    itself when that left it empty or it was empty and old (``Arena._ensure`` makes it
    again if one of its workers is about to write there)."""
    removed = 0
    try:
        old_dir = now - run.stat().st_mtime > OTHER_RUN_SWEEP_AGE_S
        entries = list(os.scandir(run))
    except FileNotFoundError:
        return
    for entry in entries:
        match = _NAME_RE.match(entry.name) or _CLAIM_RE.match(entry.name) or _HELD_RE.match(entry.name)
        if match is None:
            continue
        try:
            written = entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        if now - written > OTHER_RUN_SWEEP_AGE_S and not pid_alive(int(match.group(1)), since=written):
            Path(entry.path).unlink(missing_ok=True)
            removed += 1
    if removed:
        logger.info("removed %d snapshot files of dead processes left by another run in %s", removed, run)
    if removed == len(entries) and (removed or old_dir):
        try:
            run.rmdir()
        except OSError:  # not empty (written meanwhile) or gone: left as it is
            pass


def claim_path(arena_path: str | os.PathLike, key: str) -> Path:
    """The claim file of job ``key`` on the arena at ``arena_path``."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    return Path(f"{os.fspath(arena_path)}.{digest}.claim")


def claim(arena_path: str | os.PathLike, key: str) -> bool:
    """Claim job ``key``'s snapshot: True for the first caller only, of the worker (to
    supersede the job and reuse its arena) and the uploader (to start reading it). One
    atomic creation of an empty file (``O_EXCL``; microseconds on tmpfs, no data block
    even on a full disk): neither side waits for the other, however busy, niced or
    starved it is."""
    try:
        os.close(os.open(claim_path(arena_path, key), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


def drop_claim(arena_path: str | os.PathLike, key: str) -> None:
    """Remove job ``key``'s claim file (the uploader, once the job ended: nobody looks at
    it again; a worker claiming an ended job afterwards only reuses a free arena)."""
    claim_path(arena_path, key).unlink(missing_ok=True)


def held_path(arena_path: str | os.PathLike, key: str) -> Path:
    """The mark that job ``key``, not yet mapped by an uploader, needs the arena at ``arena_path``."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    return Path(f"{os.fspath(arena_path)}.{digest}.held")


def mark_held(arena_path: str | os.PathLike, key: str, reader: int | None = None) -> None:
    """Keep the arena of job ``key`` from the sweep of dead workers' arenas (``sweep_dead``)
    until an uploader mapped it: the worker may die before that. Made before the job is
    written to a file of the node or to an uploader's socket; removed by
    :func:`unmark_held` once an uploader mapped the arena, or the job ended without one.
    ``reader``: the pid of the uploader whose socket holds the job; the mark protects the
    arena only while that process lives (its unread frames die with it)."""
    held_path(arena_path, key).write_text("" if reader is None else str(reader))


def forget_reader(directory: Path, reader: int) -> None:
    """Remove the marks in ``directory`` that name uploader ``reader`` (it exits with no
    frame left to read)."""
    for mark in directory.glob("rank-*.held") if directory.is_dir() else []:
        try:
            if mark.read_text().strip() == str(reader):
                mark.unlink(missing_ok=True)
        except OSError:  # removed meanwhile
            continue


def unmark_held(arena_path: str | os.PathLike, key: str) -> None:
    held_path(arena_path, key).unlink(missing_ok=True)


def aligned(nbytes: int) -> int:
    """The bytes a slot of ``nbytes`` takes in an arena."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _u8(path: Path, size: int, mode: str) -> torch.Tensor:
    mm = np.memmap(path, dtype=np.uint8, mode=mode, shape=(max(size, 1),))
    return torch.from_numpy(mm)


def _view(buf: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    return buf[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def _cuda_register(buf: torch.Tensor, size: int, path: Path) -> bool:
    """Page-lock ``buf`` (a mapped file) for CUDA, so device-to-host copies into it run
    at pinned bandwidth and truly asynchronously. False (copies still work, pageable)
    when the driver refuses: over the locked-memory limit, or (Linux 6.5 on) a file
    outside tmpfs, whose shared mappings the kernel does not let anyone pin for long."""
    cudart = torch.cuda.cudart()
    ok = cudart.cudaHostRegister(buf.data_ptr(), size, 0) == cudart.cudaError.success
    if not ok:
        _clear_last_cuda_error()
        logger.warning(
            "could not pin the %d-byte snapshot arena %s for CUDA; device-to-host copies "
            "run at pageable speed. Give /dev/shm room for twice the rank's state (the "
            "arena goes there when it fits; the kernel pins no shared file mapping "
            "outside tmpfs), or raise the memlock limit (ulimit -l)",
            size,
            path,
        )
    return ok


def _clear_last_cuda_error() -> None:
    """Take a failed ``cudaHostRegister``'s error off the CUDA runtime. It stays there as
    the thread's last error, and torch's check after the next kernel launch would raise
    it in the user's training step. That check reads and clears it; a launch here takes
    it instead (torch exposes no ``cudaGetLastError``)."""
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:  # torch.AcceleratorError: the registration's error, now cleared
        torch.zeros(1, device="cuda")  # a real device fault raises again, to the caller


def _cuda_unregister(buf: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


class Arena:
    """Writer side: reusable, grows when the state grows. Not thread-safe.

    On CUDA the mapped file is registered as pinned host memory ahead of the first save
    (:meth:`prefault`), else at the first snapshot of a GPU tensor (and again after it grows)."""

    def __init__(self, path: Path, fallback: Path | None = None) -> None:
        self.path = path
        self._fallback = fallback  # where it moves when the filesystem of ``path`` is full
        self._buf: torch.Tensor | None = None
        self.size = 0
        self.pinned = False
        self.device: torch.device | None = None  # the CUDA device it is pinned for
        self._refused_size = -1

    def _pin(self, device: torch.device) -> None:
        """Register the arena for CUDA, once per size: after a refusal the same mapping is
        not tried again at every save (each try costs a failed call and a warning)."""
        if self.pinned or self._buf is None or not self.size or self._refused_size == self.size:
            return
        with torch.cuda.device(device):  # a failure's error is taken off this device's runtime
            self.pinned = _cuda_register(self._buf, self.size, self.path)
        self.device = device if self.pinned else None
        if not self.pinned:
            self._refused_size = self.size

    def _unpin(self) -> None:
        if self.pinned and self._buf is not None:
            _cuda_unregister(self._buf)
        self.pinned = False

    def _ensure(self, size: int) -> torch.Tensor:
        if self._buf is None or size > self.size:
            self._unpin()
            self._create(size)
            self._buf, self.size = _u8(self.path, size, "r+"), size
        return self._buf

    def _create(self, size: int) -> None:
        """Make the file ``size`` bytes long, its blocks allocated where the filesystem can
        (tmpfs, ext4, xfs, btrfs; others leave it sparse).

        Allocated, not sparse: a write through the mapping into a hole the filesystem has
        no room for is a SIGBUS, which kills the training process, and each rank of a node
        finds /dev/shm roomy enough alone while together they may not fit. When it has no
        room the arena moves to its ``fallback`` directory (the staging directory, on
        disk), and where that has none either it is a CheckpointError naming the fix."""
        try:
            self._reserve(size)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            if self._fallback is None or self.path.parent == self._fallback:
                raise CheckpointError(
                    f"no room for a {size >> 20} MiB snapshot arena at {self.path} ({exc.strerror}): free "
                    "space there, or give the Checkpointer a staging_dir on a disk with room"
                ) from exc
            logger.warning(
                "no room for a %d MiB snapshot arena at %s (%s): it moves to %s",
                size >> 20,
                self.path,
                exc.strerror,
                self._fallback,
            )
            # The old file and its mapping go first: nothing may copy into them again.
            self._unpin()
            self._buf, self.size = None, 0
            self.path.unlink(missing_ok=True)
            self.path = self._fallback / self.path.name
            try:
                self._create(size)
            except BaseException:
                self.path.unlink(missing_ok=True)  # the next save makes it again
                raise

    def _reserve(self, size: int) -> None:
        """Grow the file to ``size`` bytes, its blocks allocated, and make its
        directory first: another run's sweep removes an empty run directory
        (``sweep_dead``), so one found here may go before the file is in it; it is made
        again once."""
        for last in (False, True):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            except FileNotFoundError:
                if last:
                    raise
                continue
            try:
                old = os.fstat(fd).st_size
                if size > old:
                    _allocate(fd, old, size - old)
                os.ftruncate(fd, max(size, old))
            finally:
                os.close(fd)
            return

    def prefault(self, size: int, device: torch.device | None = None) -> None:
        """Map ``size`` bytes and touch each page, and pin them for CUDA ``device`` (when
        given), so that the first snapshot copies at the speed of later ones (run before
        it, off the save path; not concurrently with it). A failure is logged: the
        snapshot maps, faults and pins the pages itself."""
        try:
            buf = self._ensure(size)
            if self.path.is_relative_to(_SHM):  # a file on disk would write the zeros out too
                buf[::_PAGE].fill_(0)
            if device is not None and device.type == "cuda":
                self._pin(device)  # seconds for GBs: the first GPU save did it before
        except Exception as exc:  # noqa: BLE001 - an optimisation
            logger.warning("could not prepare the snapshot arena %s ahead of the first save: %s", self.path, exc)

    def snapshot(self, tensors: dict[str, torch.Tensor]) -> list[TensorSlot]:
        """Copy ``tensors`` into the arena; blocks until the copy is complete."""
        slots, offset = [], 0
        for fqn, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            slots.append(TensorSlot(fqn, t.dtype, tuple(t.shape), offset, nbytes))
            offset += aligned(nbytes)
        buf = self._ensure(offset)
        device = next((t.device for t in tensors.values() if t.device.type == "cuda"), None)
        if device is not None:
            self._pin(device)
        gpus: set[torch.device] = set()
        half = len(slots) // 2
        for n, (slot, t) in enumerate(zip(slots, tensors.values())):
            if n == half:
                fault_point("save.copying")
            if t.device.type == "cuda":
                gpus.add(t.device)
            _view(buf, slot).copy_(t.detach(), non_blocking=t.device.type == "cuda")
        for gpu in gpus:  # each copy runs on its source's device: wait for every one of them
            torch.cuda.synchronize(gpu)
        return slots

    def close(self, *, keep_file: bool = False) -> None:
        """Unlink the file; jobs that accepted a snapshot from it keep their mapping.
        ``keep_file``: a job not mapped yet still needs it (the sweeps remove it later)."""
        self._unpin()
        self._buf = None
        if keep_file:
            return
        self.path.unlink(missing_ok=True)
        try:
            self.path.parent.rmdir()  # the run's arena dir, once its last rank closed
        except OSError:
            pass


@functools.cache
def _fallocate() -> Any:
    """libc's ``fallocate(2)``, or None. Not ``os.posix_fallocate``: where the filesystem
    cannot allocate ahead (NFS before 4.2, ZFS before 2.2, FUSE) glibc emulates it by
    writing a byte into every block (millions of writes per GiB, on the save path), and
    fails on a file opened for appending."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.fallocate64  # 64-bit offsets on every ABI
    except (OSError, AttributeError):  # not Linux
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    call.restype = ctypes.c_int
    return call


def _allocate(fd: int, offset: int, length: int) -> None:
    """Allocate the file's blocks (OSError ENOSPC when the filesystem has no room for
    them); left sparse where the filesystem cannot allocate ahead."""
    call = _fallocate()
    if call is None:
        return
    while call(fd, 0, offset, length) != 0:
        err = ctypes.get_errno()
        if err != errno.EINTR:  # a signal (tmpfs on older kernels stops at any pending one): again
            break
    else:
        return
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        logger.debug("cannot allocate a snapshot arena's blocks ahead (%s): it stays sparse", os.strerror(err))
        return
    raise OSError(err, os.strerror(err))


def open_slots(path: str | os.PathLike, slots: list[TensorSlot]) -> dict[str, torch.Tensor]:
    """Reader side: tensors over the arena (no copy). Keep the file until done.

    Each tensor has a storage of its own bytes, not a view into one storage of the whole
    arena: DCP's writer clones a tensor whose storage is larger than the tensor (so that
    ``torch.save`` does not write the rest), and that clone into fresh memory cost more
    than the write itself (page faults on every page of the fresh memory)."""
    size = max((s.offset + s.nbytes for s in slots), default=0)
    if os.stat(path).st_size < size:  # mapped "r+", a short file would be extended with zeros
        raise CheckpointError(f"the snapshot arena {path} is shorter than its snapshot ({size} bytes)")
    mm = np.memmap(Path(path), dtype=np.uint8, mode="r+", shape=(max(size, 1),))
    return {s.fqn: _own_storage(mm, s) for s in slots}


def _own_storage(mm: np.memmap, slot: TensorSlot) -> torch.Tensor:
    if slot.nbytes == 0:
        return torch.empty(slot.shape, dtype=slot.dtype)
    raw = torch.frombuffer(mm, dtype=torch.uint8, count=slot.nbytes, offset=slot.offset)
    return raw.view(slot.dtype).view(slot.shape)
