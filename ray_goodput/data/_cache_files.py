"""On-disk layout of the node cache, and the one way a file enters it.

Any process of the node (the NodeCache actor, training processes, DataLoader workers)
computes a file's cache path from its identity alone, so a hit is ``open()`` with no actor
call. A miss fetches under its key's ``flock`` (one of 4096 lock stripes: single flight
across processes and threads; a wait for it is bounded while no download under it moves)
into a temp name, then ``os.replace`` (the final name only ever holds a complete file).
Readers report hits, misses and fetches in an append-only journal the actor tails,
because DataLoader workers cannot make Ray calls.

Layout under ``root``::

    data/<k[:2]>/<k>            cached files, k = blake2b(filesystem ident, path, listed size, mtime)
    data/<k[:2]>/.<k>.part-<pid>-<n>   a fetch in progress (removed by the actor if pid died)
    locks/<stripe>.lock         4096 lock stripes (bounded count; flock, never deleted;
                                a wait for one is bounded: LOCK_WAIT_S)
    journal/<pid>-<token>.log   reader events: "h n", "m n", "f key size seconds"
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from ray_goodput import _env
from ray_goodput.data._config import CacheConfig
from ray_goodput.errors import CacheFullError, CacheLockTimeoutError, FileLargerThanCacheError
from ray_goodput.storage import RetryPolicy, copy_stream

LOCK_STRIPES = 4096
#: How long a fetch waits for its key's lock while the download under it makes no
#: progress, before it raises. The downloader touches the lock file as its chunks arrive
#: (at most once a second, ``_Beat``), so a download that moves, of this file or of
#: another of its lock stripe, resets the wait.
LOCK_WAIT_S = 600.0
#: How often a downloader touches its lock file, and a waiter looks at it.
_BEAT_S = 1.0
_tmp_counter = itertools.count()


@dataclass(frozen=True)
class CacheLayout:
    """Paths of a cache directory. Picklable; the same in every process of a node."""

    root: Path

    @staticmethod
    def key(ident: str, path: str, size: int = -1, mtime_ns: int = -1) -> str:
        """The cache's name of a file (``FileSet.cache_key``); -1: not listed."""
        named = f"{ident}\n{path}" if size < 0 else f"{ident}\n{path}\n{size}"
        if mtime_ns >= 0:
            named += f"\n@{mtime_ns}"
        return hashlib.blake2b(named.encode(), digest_size=16).hexdigest()

    def data_path(self, key: str) -> Path:
        return self.root / "data" / key[:2] / key

    def data_file(self, key: str) -> str:
        """``data_path`` as a str, built without pathlib (hot path: once per sample)."""
        return f"{self.root}/data/{key[:2]}/{key}"

    def lock_path(self, key: str) -> Path:
        return self.root / "locks" / f"{int(key[:6], 16) % LOCK_STRIPES:03x}.lock"

    @property
    def journal_dir(self) -> Path:
        return self.root / "journal"

    @staticmethod
    def of(config: CacheConfig) -> CacheLayout:
        """The layout of ``config``'s directory (default: ``RAY_GOODPUT_CACHE_DIR``)."""
        return CacheLayout(Path(config.directory or _env.cache_root()).absolute())

    def create(self) -> None:
        for sub in ("data", "locks", "journal"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)


def parse_temp(name: str) -> int | None:
    """Pid of the writer of temp file ``name``, or None when it is not a temp file."""
    if not name.startswith(".") or ".part-" not in name:
        return None
    try:
        return int(name.rsplit(".part-", 1)[1].split("-")[0])
    except ValueError:
        return None


# Lock fds open in this process. A forked child (a DataLoader worker) inherits them, and
# a flock lives as long as any copy of its fd: the child must close its copies, or a
# lock that a thread of the parent held at fork time is never released. ``_fds_lock``
# makes open+register and unregister+close atomic with respect to fork.
_held_fds: set[int] = set()
_fds_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _fds_lock  # noqa: PLW0603 - a forked child needs a lock no thread of the parent holds
    _fds_lock = threading.Lock()
    for fd in list(_held_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    _held_fds.clear()


os.register_at_fork(
    before=lambda: _fds_lock.acquire(), after_in_parent=lambda: _fds_lock.release(), after_in_child=_after_fork_in_child
)


def _holder(fd: int) -> str:
    """Who holds the flock on ``fd``'s file, from ``/proc/locks`` (Linux): "pid N", or
    "an unknown process"."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == ident:
                    return f"pid {fields[4]}"
    except OSError:
        pass
    return "an unknown process"


def _acquire(fd: int, path: Path, wait_s: float, what: str) -> None:
    """``flock(fd, LOCK_EX)``, polled; raises CacheLockTimeoutError naming ``path``, its
    holder and ``what`` waited once ``wait_s`` seconds passed with the lock file untouched
    (the holder's download made no progress: ``_Beat``)."""
    deadline = seen = None
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the kernel if this process dies
            return
        except BlockingIOError:
            pass
        now, touched = time.monotonic(), os.fstat(fd).st_mtime_ns
        if touched != seen:  # first look, or the holder's download moved
            seen, deadline = touched, now + wait_s
        elif now >= deadline:
            raise CacheLockTimeoutError(
                f"{what or 'the node cache'} waited {wait_s:.0f} s for the cache lock {path}, held by "
                f"{_holder(fd)}, whose download made no progress meanwhile: that process is stuck; end it "
                "and read again"
            )
        time.sleep(min(pause, max(0.0, deadline - now)))
        pause = min(pause * 2, 0.05)


class _Beat:
    """A download's sign of progress to the processes waiting for its lock: it touches the
    lock file at its first chunk and then at most every ``_BEAT_S``."""

    def __init__(self, lock: Path) -> None:
        self._lock, self._last = lock, -_BEAT_S

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self._last >= _BEAT_S:
            self._last = now
            with contextlib.suppress(OSError):  # a sign for waiters only
                os.utime(self._lock)


@contextmanager
def flock(path: Path, *, wait_s: float = LOCK_WAIT_S, what: str = "") -> Iterator[None]:
    """Hold an exclusive lock on the lock file ``path`` for the block (released by the
    kernel if this process dies): one key's fetch, or the removal of its cut copy. Waits
    for it until ``wait_s`` pass with the lock file untouched (no download under it moved),
    then raises CacheLockTimeoutError naming ``what`` waited."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _fds_lock:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        _held_fds.add(fd)
    try:
        _acquire(fd, path, wait_s, what)
        yield
    finally:
        with _fds_lock:
            _held_fds.discard(fd)
            os.close(fd)


def _copy_in(fs: pafs.FileSystem, src: str, dest: Path, max_bytes: int, expected: int, beat: _Beat) -> int:
    tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}-{next(_tmp_counter)}")

    def check(size: int) -> None:
        beat()
        if size > max_bytes:
            raise FileLargerThanCacheError(
                f"{src} is larger than the cache capacity ({max_bytes} bytes); raise "
                "CacheConfig.capacity_bytes or pass cache=None to read it uncached"
            )

    try:
        with fs.open_input_stream(src) as inp, open(tmp, "wb") as out:
            size, _ = copy_stream(inp, out, check=check)
        if expected >= 0 and size != expected:  # a truncated read must not become a hit
            raise OSError(
                f"read {size} bytes of {src} but it was listed with {expected}; "
                "the object changed or the connection broke"
            )
        os.replace(tmp, dest)  # the final name appears only with complete content
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise CacheFullError(
                f"disk of the cache {dest.parent.parent.parent} is full while "
                f"fetching {src}; lower CacheConfig.capacity_bytes or free "
                "space"
            ) from exc
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return size


def fetch(
    layout: CacheLayout,
    key: str,
    fs: pafs.FileSystem,
    src: str,
    *,
    max_bytes: int,
    policy: RetryPolicy,
    expected: int = -1,
    lock_wait_s: float = LOCK_WAIT_S,
) -> tuple[int, float] | None:
    """Bring ``src`` into the cache once (single flight). Blocking.

    Returns (bytes, seconds) when this call downloaded it, None when it was already
    there. ``expected`` (bytes, -1 unknown) is checked. Raises FileLargerThanCacheError
    or CacheFullError (a full disk; neither is retried), CacheLockTimeoutError (another
    process held the key's lock, its download not moving, for ``lock_wait_s``) or
    StorageError naming ``src``.
    """
    dest = layout.data_path(key)
    if dest.exists():
        return None
    if expected > max_bytes:  # known from the listing: fail before downloading
        raise FileLargerThanCacheError(
            f"{src} ({expected} bytes) is larger than the cache capacity "
            f"({max_bytes} bytes); raise CacheConfig.capacity_bytes or pass "
            "cache=None to read it uncached"
        )
    lock = layout.lock_path(key)
    with flock(lock, wait_s=lock_wait_s, what=f"the fetch of {src}"):
        if dest.exists():  # another process fetched it while we waited for the lock
            return None
        dest.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        beat = _Beat(lock)
        size = policy.call(f"download of {src}", lambda: _copy_in(fs, src, dest, max_bytes, expected, beat))
        return size, time.monotonic() - start
