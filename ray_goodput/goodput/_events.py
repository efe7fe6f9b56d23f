"""Worker side of the goodput ledger: a per-process event log, written without blocking.

Only rank 0 records (steps are synchronous across ranks, so its timeline is the job's).
On a local or NFS run directory each event is one ``write()`` to an append-only file —
it survives a SIGKILL of the worker the instant after. On object stores events are
batched by a background thread into numbered chunk objects. Either way the training
step never waits for storage.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from typing import Any

from ray_goodput.storage import StorageLocation, list_dir, read_bytes, write_bytes

logger = logging.getLogger(__name__)

EVENTS_DIR = "goodput/events"


class EventLog:
    """Append-only event log of one worker process (one training attempt)."""

    def __init__(self, root: StorageLocation, *, rank: int, world_size: int) -> None:
        self.attempt = f"{time.time():.6f}-{uuid.uuid4().hex[:8]}"
        self._root = root
        self._lock = threading.Lock()
        self._buffer: list[str] = []
        self._chunk = 0
        self._file = None
        if root.is_local:
            directory = root.join(EVENTS_DIR)
            os.makedirs(directory, exist_ok=True)
            self._file = open(os.path.join(directory, f"{self.attempt}.jsonl"), "a", buffering=1)  # noqa: SIM115 - open for the log's life, closed by close()
        else:
            threading.Thread(target=self._flush_loop, name="rg-goodput-events", daemon=True).start()
        self.emit("start", rank=rank, world=world_size, pid=os.getpid())

    def emit(self, kind: str, **fields: Any) -> None:
        """Record one event (``t`` = now, wall clock). Never blocks on remote storage."""
        line = json.dumps({"e": kind, "t": fields.pop("t", time.time()), **fields})
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")  # line-buffered: one write() per event
            else:
                self._buffer.append(line)

    def flush(self) -> None:
        """Push buffered events to storage now (object stores; a no-op for local files)."""
        with self._lock:
            lines, self._buffer = self._buffer, []
            chunk, self._chunk = self._chunk, self._chunk + (1 if lines else 0)
        if lines:
            try:
                write_bytes(
                    self._root, f"{EVENTS_DIR}/{self.attempt}/{chunk:06d}.jsonl", ("\n".join(lines) + "\n").encode()
                )
            except Exception as exc:  # noqa: BLE001 - accounting must never break training
                logger.warning("could not write goodput events: %s", exc)

    def _flush_loop(self) -> None:
        while True:
            time.sleep(1.0)
            self.flush()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


class EventReader:
    """Reads the event logs of every attempt, incrementally: each call lists the events
    directory once and reads only what is new (the unread tail of a local log, chunks not
    read before on object stores), so the cost of a refresh follows the new events, not
    the length of the run. ``reads`` counts object/file reads, for tests and benchmarks."""

    def __init__(self, root: StorageLocation) -> None:
        self._root = root
        self._base = root.join(EVENTS_DIR)
        self._offsets: dict[str, int] = {}  # local log -> bytes consumed (whole lines)
        self._chunks: set[str] = set()  # object-store chunks already read
        self._events: dict[str, list[dict[str, Any]]] = {}
        self.reads = 0

    def poll(self) -> dict[str, list[dict[str, Any]]]:
        """Every attempt's events so far, ``{attempt: [event, ...]}`` in time order."""
        changed: set[str] = set()
        for info in list_dir(self._root, EVENTS_DIR, recursive=True):
            rel = info.path[len(self._base) + 1 :]
            if rel.endswith(".jsonl") and self._is_new(rel, info.size):
                attempt = rel.split("/")[0].removesuffix(".jsonl")
                self._events.setdefault(attempt, []).extend(self._read_new(rel))
                changed.add(attempt)
        for attempt in changed:
            self._events[attempt].sort(key=lambda e: e["t"])
        return self._events

    def _is_new(self, rel: str, size: int | None) -> bool:
        if "/" in rel:  # a chunk object: immutable once written
            return rel not in self._chunks
        return size is None or size > self._offsets.get(rel, 0)

    def _read_new(self, rel: str) -> list[dict[str, Any]]:
        self.reads += 1
        if "/" in rel:
            self._chunks.add(rel)
            return _parse(read_bytes(self._root, f"{EVENTS_DIR}/{rel}").decode())
        start = self._offsets.get(rel, 0)
        with self._root.fs.open_input_file(f"{self._base}/{rel}") as f:
            f.seek(start)
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self._offsets[rel] = start + len(whole)
        return _parse(whole.decode())


def _parse(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a torn last line of a killed writer
    return out


def read_events(root: StorageLocation) -> dict[str, list[dict[str, Any]]]:
    """Every attempt's events, ``{attempt: [event, ...]}`` in time order (one full read)."""
    return EventReader(root).poll()
