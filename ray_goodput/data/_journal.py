"""Reader-side cache events, passed to the NodeCache actor through append-only files.

DataLoader workers cannot call actors and a hit must stay a plain file read, so readers
count hits/misses in memory and append them to a per-process journal at most once a
second; a fetch (a download: what the actor counts against the capacity) is written at
once, so a process that ends abruptly loses only counts. The actor tails every journal.
Lines are short and written with O_APPEND, so a line is never interleaved with another.
One writer per process and cache directory (``journal_writer``), however many readers.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from multiprocessing import util as mp_util
from pathlib import Path

from ray_goodput.runtime import pid_alive

logger = logging.getLogger(__name__)
FLUSH_INTERVAL_S = 1.0


_writers: dict[Path, JournalWriter] = {}
_writers_lock = threading.Lock()  # the registry, and each writer's first use in a process


def _after_fork_in_child() -> None:
    global _writers_lock  # noqa: PLW0603 - a forked child needs a lock no thread of the parent holds
    _writers_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def journal_writer(directory: Path) -> JournalWriter:
    """This process's writer of the journal in ``directory``, shared by its readers."""
    with _writers_lock:
        writer = _writers.get(directory)
        if writer is None:
            writer = _writers[directory] = JournalWriter(directory)
        return writer


class JournalWriter:
    """Counts reader events of this process; cheap to call on the hot path. Get it with
    ``journal_writer`` (it also unpickles to the receiving process's one)."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._pid = -1
        self._fd = -1
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._hits = self._misses = 0
        self._last_flush = time.monotonic()

    def _ensure_open(self) -> None:
        if self._pid == os.getpid():
            return
        with _writers_lock:  # threads of a process reading for the first time at once: one file
            if self._pid == os.getpid():
                return
            # First use in this process (forked DataLoader workers inherit a copy): own file.
            self._lock = threading.Lock()  # a fork may have copied it held
            self._reset()
            self._dir.mkdir(parents=True, exist_ok=True)
            path = self._dir / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.log"
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            # multiprocessing children skip atexit but run these finalizers on exit.
            mp_util.Finalize(self, JournalWriter.flush, args=(self,), exitpriority=10)
            self._pid = os.getpid()  # last: a thread that sees it sees the file open

    def hit(self) -> None:
        self._ensure_open()
        self._hits += 1
        self._maybe_flush()

    def miss(self, fetched: tuple[str, int, float] | None) -> None:
        self._ensure_open()
        self._misses += 1
        if fetched is not None:  # written now: the actor counts these bytes against the capacity
            key, size, seconds = fetched
            self._write(f"f {key} {size} {seconds:.6f}\n")
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        if self._pid != os.getpid():
            return
        with self._lock:  # two threads flushing at once write each count once
            hits, misses = self._hits, self._misses
            self._reset()
        text = (f"h {hits}\n" if hits else "") + (f"m {misses}\n" if misses else "")
        if text:
            self._write(text)

    def _write(self, text: str) -> None:
        try:
            os.write(self._fd, text.encode())
        except OSError as exc:  # never fail a read for the journal
            logger.debug("cache journal write failed: %s", exc)

    def __reduce__(self) -> tuple:
        return (journal_writer, (self._dir,))


class JournalReader:
    """Actor side: returns new events of all journals; removes journals of dead processes."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._offsets: dict[str, int] = {}
        self._lock = threading.Lock()  # one poll at a time: each line is counted once

    def poll(self) -> tuple[int, int, list[tuple[str, int, float]]]:
        """(hits, misses, [(key, bytes, seconds) fetched by readers]) since the last poll.
        Thread-safe."""
        hits = misses = 0
        fetched: list[tuple[str, int, float]] = []
        with self._lock:
            for path in sorted(self._dir.glob("*.log")):
                h, m = self._read_new(path, fetched)
                hits, misses = hits + h, misses + m
        return hits, misses, fetched

    def _read_new(self, path: Path, fetched: list) -> tuple[int, int]:
        name = path.name
        offset = self._offsets.get(name, 0)
        try:
            # Checked before reading: no lost tail. A process that took the pid after the
            # writer died started after the journal's last line.
            dead = not pid_alive(int(name.split("-")[0]), since=path.stat().st_mtime)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            self._offsets.pop(name, None)
            return 0, 0
        complete = data[: data.rfind(b"\n") + 1]
        self._offsets[name] = offset + len(complete)
        if dead:
            path.unlink(missing_ok=True)
            self._offsets.pop(name, None)
        return _parse(complete.decode(errors="replace"), fetched)


def _parse(text: str, fetched: list) -> tuple[int, int]:
    hits = misses = 0
    for line in text.splitlines():
        parts = line.split()
        try:
            if parts[0] == "h":
                hits += int(parts[1])
            elif parts[0] == "m":
                misses += int(parts[1])
            elif parts[0] == "f":
                fetched.append((parts[1], int(parts[2]), float(parts[3])))
        except (IndexError, ValueError):
            logger.debug("skipping malformed cache journal line %r", line)
    return hits, misses
