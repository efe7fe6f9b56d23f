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
            self._file = open(os.path.join(directory, f"{self.attempt}.jsonl"), "a", buffering=1)  # noqa: SIM115
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
                write_bytes(self._root, f"{EVENTS_DIR}/{self.attempt}/{chunk:06d}.jsonl",
                            ("\n".join(lines) + "\n").encode())
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


def read_events(root: StorageLocation) -> dict[str, list[dict[str, Any]]]:
    """Every attempt's events, ``{attempt: [event, ...]}`` in time order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for info in list_dir(root, EVENTS_DIR, recursive=True):
        rel = info.path[len(root.join(EVENTS_DIR)) + 1:]
        if not rel.endswith(".jsonl"):
            continue
        attempt = rel.split("/")[0].removesuffix(".jsonl")
        text = read_bytes(root, f"{EVENTS_DIR}/{rel}").decode()
        for line in text.splitlines():
            try:
                out.setdefault(attempt, []).append(json.loads(line))
            except ValueError:
                continue  # a torn last line of a killed writer
    for events in out.values():
        events.sort(key=lambda e: e["t"])
    return out
