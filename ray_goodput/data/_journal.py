"""Reader-side cache events, passed to the NodeCache actor through append-only files.

DataLoader workers cannot call actors and a hit must stay a plain file read, so readers
count hits/misses in memory and append them (with each fetch they made) to a per-process
journal at most once a second; the actor tails every journal. Lines are short and written
with O_APPEND, so a line is never interleaved with another.
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


class JournalWriter:
    """Counts reader events of this process; cheap to call on the hot path."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._pid = -1
        self._fd = -1
        self._reset()

    def _reset(self) -> None:
        self._hits = self._misses = 0
        self._lines: list[str] = []
        self._last_flush = time.monotonic()

    def _ensure_open(self) -> None:
        if self._pid == os.getpid():
            return
        # First use in this process (forked DataLoader workers inherit a copy): own file.
        self._reset()
        self._pid = os.getpid()
        self._dir.mkdir(parents=True, exist_ok=True)
        path = self._dir / f"{self._pid}-{uuid.uuid4().hex[:8]}.log"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        # multiprocessing children skip atexit but run these finalizers on exit.
        mp_util.Finalize(self, JournalWriter.flush, args=(self,), exitpriority=10)

    def hit(self) -> None:
        self._ensure_open()
        self._hits += 1
        self._maybe_flush()

    def miss(self, fetched: tuple[str, int, float] | None) -> None:
        self._ensure_open()
        self._misses += 1
        if fetched is not None:
            key, size, seconds = fetched
            self._lines.append(f"f {key} {size} {seconds:.6f}\n")
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        if self._pid != os.getpid():
            return
        text = "".join(self._lines)
        if self._hits:
            text += f"h {self._hits}\n"
        if self._misses:
            text += f"m {self._misses}\n"
        self._reset()
        if text:
            try:
                os.write(self._fd, text.encode())
            except OSError as exc:  # stats only: never fail a read for them
                logger.debug("cache journal write failed: %s", exc)

    def __getstate__(self) -> dict:
        return {"_dir": self._dir}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["_dir"])


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
