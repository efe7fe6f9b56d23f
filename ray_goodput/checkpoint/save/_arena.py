"""A snapshot arena: one memory-mapped file that outlives the worker process.

``save()`` copies tensors into an arena (a memcpy, or a device-to-host copy on GPU) and
returns; the node's uploader maps the same file when it accepts the job and writes DCP
files from it. If the worker is killed right after ``save()`` returned, the snapshot is
still there; once mapped, unlinking the file cannot take it away. Each rank has two
(one being written out, one waiting). The file lives in /dev/shm when it has room, else
in the staging directory. Its names, claims, marks and sweeps across processes are
``_arena_files``'.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ray_goodput._faults import fault_point
from ray_goodput.checkpoint.save._arena_files import SHM
from ray_goodput.errors import CheckpointError

logger = logging.getLogger(__name__)
_ALIGN = 64
_PAGE = 4096


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in an arena. ``offset``/``nbytes`` in bytes."""

    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


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
            if self.path.is_relative_to(SHM):  # a file on disk would write the zeros out too
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
