"""Worker side of the goodput ledger: a per-process event log, written without blocking.

Only rank 0 records (steps are synchronous across ranks, so its timeline is the job's).
On a local or NFS run directory each event is one ``write()`` to an append-only file —
it survives a SIGKILL of the worker the instant after. On object stores events are
batched by a background thread into numbered chunk objects, and each event is also one
``write()`` to a node-local spool file: when the process is killed between two batches,
the node's uploader (which outlives it) ships the spool's unsent tail
(:func:`ship_orphaned_events`). Every event carries a sequence number of its log
(``seq``), so a tail shipped twice is read once. Either way the training step never waits
for storage.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import pickle
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from ray_goodput import _env
from ray_goodput._faults import fault_point
from ray_goodput.runtime import pid_alive
from ray_goodput.runtime._private_dirs import is_private, make_private
from ray_goodput.storage import RetryPolicy, StorageLocation, list_dir, read_bytes, write_bytes

logger = logging.getLogger(__name__)

EVENTS_DIR = "goodput/events"
#: How often an object-store event log writes its batch of events.
FLUSH_INTERVAL_S = 1.0
#: Name prefix of the chunk that ships a dead writer's spool (then the spool offset it starts at).
SWEPT_PREFIX = "swept-"
_LOG, _ROOT, _SENT, _SHIPPING = ".jsonl", ".root", ".sent", ".shipping"
#: A spool whose shipped part is this long starts again with its unshipped tail (a rank 0
#: runs for days).
SPOOL_RESET_BYTES = 1 << 20
#: A dead writer's spool still unshipped this long after its last event is dropped.
SPOOL_KEEP_S = 3600.0
#: After its storage refused it, a spool is not tried again by this process for this long.
_RETRY_AFTER_S = 30.0
#: The sweep's own storage retries: a sweep serves every spool of the node, and waits little on one.
_SWEEP_POLICY = RetryPolicy(attempts=2)
_refused: dict[str, float] = {}  # spool stem -> when this process may try it again


def spool_dir() -> Path:
    """The node-local directory of the object-store event logs' spools
    (``RAY_GOODPUT_EVENTS_SPOOL_DIR``, else ``$TMPDIR/ray_goodput-<uid>/goodput-spool``)."""
    return _env.events_spool_dir()


def _make_private(directory: Path) -> Path:
    """``directory``, made this user's alone; PermissionError naming the setting otherwise."""
    return make_private(directory, setting=_env.EVENTS_SPOOL_DIR_VAR)


class EventLog:
    """Append-only event log of one worker process (one training attempt)."""

    def __init__(self, root: StorageLocation, *, rank: int, world_size: int) -> None:
        self.attempt = f"{time.time():.6f}-{uuid.uuid4().hex[:8]}"
        self._root = root
        self._lock = threading.Lock()
        # One flush at a time: the spool's sent mark only moves past chunks that all landed.
        self._flush_lock = threading.Lock()
        self._seq = 0
        self._buffer: list[str] = []
        self._chunk = 0
        self._file = None
        self._spool: _Spool | None = None
        if root.is_local:
            directory = root.join(EVENTS_DIR)
            os.makedirs(directory, exist_ok=True)
            self._file = open(os.path.join(directory, f"{self.attempt}.jsonl"), "a", buffering=1)  # noqa: SIM115 - open for the log's life, closed by close()
        else:
            try:
                self._spool = _Spool(root, self.attempt)
            except Exception as exc:  # noqa: BLE001 - the events go on without it: only a kill's last second is at stake
                logger.warning("no node-local spool for goodput events (%s): a SIGKILL loses up to 1 s of them", exc)
            threading.Thread(target=self._flush_loop, name="rg-goodput-events", daemon=True).start()
        self.emit("start", rank=rank, world=world_size, pid=os.getpid())

    def emit(self, kind: str, **fields: Any) -> None:
        """Record one event (``t`` = now, wall clock). Never blocks on remote storage."""
        t = fields.pop("t", time.time())
        with self._lock:
            line = json.dumps({"e": kind, "t": t, "seq": self._seq, **fields})
            self._seq += 1
            if self._file is not None:
                self._file.write(line + "\n")  # line-buffered: one write() per event
                return
            self._buffer.append(line)
            if self._spool is not None:
                self._spool.append(line)

    def flush(self) -> None:
        """Push buffered events to storage now (object stores; a no-op for local files)."""
        with self._flush_lock:
            self._flush()

    def _flush(self) -> None:
        with self._lock:
            lines, self._buffer = self._buffer, []
            chunk, self._chunk = self._chunk, self._chunk + (1 if lines else 0)
            upto = self._spool.size if self._spool is not None else 0
        if not lines:
            return
        try:
            write_bytes(
                self._root, f"{EVENTS_DIR}/{self.attempt}/{chunk:06d}.jsonl", ("\n".join(lines) + "\n").encode()
            )
            fault_point("events.shipped")
        except Exception as exc:  # noqa: BLE001 - accounting must never break training
            with self._lock:  # the next flush writes them again (a write that did land is read once)
                self._buffer[:0] = lines
            logger.warning("could not write goodput events (written again with the next batch): %s", exc)
            return
        with self._lock:  # long and shipped: it starts again with what came since (the buffer)
            spool = self._spool
            restarted = spool is not None and upto >= SPOOL_RESET_BYTES and spool.restart(self._buffer)
        if spool is not None and not restarted:
            spool.mark_sent(upto)

    def _flush_loop(self) -> None:
        swept = False
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            self.flush()
            if not swept:  # a killed predecessor's spool on this node, after this log's own first chunk
                swept = True
                try:
                    ship_orphaned_events()
                except Exception as exc:  # noqa: BLE001 - never the end of this log's own flushes
                    logger.warning("could not ship dead workers' goodput events: %s", exc)

    def stop_spooling(self) -> None:
        """No node-local copy of the events from now on (the run ended: ``StepRecorder``
        flushes each event after the end at once). The spool goes when storage has all of
        it, else it stays for the sweep once this process ends."""
        with self._flush_lock:
            self._drop_spool()

    def close(self) -> None:
        with self._flush_lock:
            self._flush()
            with self._lock:
                if self._file is not None:
                    self._file.close()
                    self._file = None
            self._drop_spool()

    def _drop_spool(self) -> None:
        """Under the flush lock: all shipped, the spool goes; else it stays for the sweep once
        this process ends."""
        with self._lock:
            spool, self._spool = self._spool, None
        if spool is not None:
            spool.close(remove=spool.sent == spool.size)


class _Spool:
    """The node-local copy of an object-store event log: ``<pid>-<attempt>.jsonl`` (one
    ``write()`` per event, so it survives a SIGKILL), ``.root`` (the storage location,
    pickled: written first, so a log is never found without it) and ``.sent`` (how many of
    the log's bytes storage has, written after each chunk). Once what storage has is
    ``SPOOL_RESET_BYTES`` long, the log starts again with the events after it."""

    def __init__(self, root: StorageLocation, attempt: str) -> None:
        directory = _make_private(spool_dir())
        self.base = str(directory / f"{os.getpid()}-{attempt}")
        _write_aside(self.base + _ROOT, pickle.dumps(root))
        self._fd = os.open(self.base + _LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.size = 0
        self.sent = 0
        self.broken = False  # a write came up short: no more appends (the chunks carry the events)

    def append(self, line: str) -> None:
        if self.broken:
            return
        data = (line + "\n").encode()
        try:
            written = os.write(self._fd, data)
        except OSError as exc:  # a full disk: the chunks still carry the events
            written, error = 0, exc
        else:
            error = None
        self.size += written
        if written != len(data):  # a torn line would swallow the next one: stop here
            self.broken = True
            logger.warning("goodput event spool %s stopped: %s", self.base, error or "a short write")

    def mark_sent(self, upto: int) -> None:
        try:
            _write_aside(self.base + _SENT, str(upto).encode())
        except OSError as exc:  # the sweep then ships more than it must; the reader drops the repeats
            logger.debug("goodput event spool mark failed: %s", exc)
            return
        self.sent = upto

    def restart(self, lines: list[str]) -> bool:
        """Start the log again with only ``lines``, the events after what storage has (under
        the event log's lock: no append meanwhile; a busy rank 0 emits during nearly every
        upload, so waiting for a moment with nothing unsent would let the log grow for
        ever). The new log is written aside, then the mark goes to 0, then the new log
        replaces the old: a kill in between ships shipped events again, which the reader
        drops, and never skips one."""
        if self.broken:
            return False
        data = "".join(line + "\n" for line in lines).encode()
        tmp = f"{self.base}{_LOG}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        except OSError as exc:
            logger.debug("goodput event spool restart failed: %s", exc)
            return False
        try:
            if os.write(fd, data) != len(data):
                raise OSError("a short write")
            _write_aside(self.base + _SENT, b"0")
            os.replace(tmp, self.base + _LOG)
        except OSError as exc:
            os.close(fd)
            Path(tmp).unlink(missing_ok=True)
            logger.debug("goodput event spool restart failed: %s", exc)
            return False
        os.close(self._fd)
        self._fd = fd
        self.size, self.sent = len(data), 0
        return True

    def close(self, *, remove: bool) -> None:
        os.close(self._fd)
        if remove:
            for suffix in (_LOG, _SENT, _ROOT):  # the log first: a sweep never finds it rootless
                Path(self.base + suffix).unlink(missing_ok=True)


def _write_aside(path: str, data: bytes) -> None:
    """Write ``path`` whole or not at all (a temporary name, then a rename)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def ship_orphaned_events(directory: str | Path | None = None) -> int:
    """Ship the unsent tail of every spool whose writer died (SIGKILLed between two
    batches) to its storage, as one more chunk of its log; returns how many logs were
    shipped. Each spool is taken by one caller (a rename); one whose taker died is taken
    again; one whose storage refused is put back for the next call. Run about once a second
    by every node uploader, and by each new object-store event log on its node."""
    directory = Path(directory) if directory is not None else spool_dir()
    # None yet, or not this user's alone (a spool names a storage location that is unpickled):
    # nothing of ours to ship.
    if not is_private(directory):
        return 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    shipped = 0
    now = time.monotonic()
    for name in names:
        stem = _orphan(directory, name)
        if stem is None or _refused.get(stem, 0.0) > now:
            continue
        taken = directory / f"{stem}.{os.getpid()}{_SHIPPING}"
        try:
            last_write = (directory / name).stat().st_mtime  # its writer's last event (kept by a put-back)
            # Stamped before the rename: a sweep that finds it taken judges this taker by when
            # it took it (a holder that started later is another process with its pid).
            os.utime(directory / name)
            os.rename(directory / name, taken)
        except OSError:  # another sweep took it, or its writer closed it
            continue
        shipped += _ship(directory, stem, taken, last_write)
    return shipped


def _orphan(directory: Path, name: str) -> str | None:
    """The stem of spool file ``name`` when nobody alive holds it: its writer's (a log) or
    its taker's (a log being shipped) process is gone."""
    if name.endswith(_LOG):
        stem, holder = name[: -len(_LOG)], name.split("-", 1)[0]
    elif name.endswith(_SHIPPING):
        stem, _, holder = name[: -len(_SHIPPING)].rpartition(".")
    else:
        return None
    try:
        since = (directory / name).stat().st_mtime
        alive = pid_alive(int(holder), since=since)
    except (FileNotFoundError, ValueError):
        return None
    return None if alive else stem


def _ship(directory: Path, stem: str, taken: Path, last_write: float) -> int:
    base = directory / stem
    try:
        root = pickle.loads(Path(f"{base}{_ROOT}").read_bytes())  # noqa: S301 - our own, in a directory only we can write
        sent = int(Path(f"{base}{_SENT}").read_text()) if Path(f"{base}{_SENT}").exists() else 0
        with open(taken, "rb") as f:
            f.seek(sent)
            data = f.read()
    except Exception as exc:  # noqa: BLE001 - unreadable (another version's pickle, say): one lost tail, not a sweep down
        if not taken.exists():  # another sweep took it from us meanwhile: it ships it
            return 0
        logger.warning("dropping the goodput event spool %s, which cannot be read: %s", taken, exc)
        _remove_spool(base, taken)
        return 0
    data = data[: data.rfind(b"\n") + 1]  # a line cut by the kill is not an event
    attempt = stem.split("-", 1)[1]
    if data:
        try:
            write_bytes(root, f"{EVENTS_DIR}/{attempt}/{SWEPT_PREFIX}{sent:012d}.jsonl", data, _SWEEP_POLICY)
        except OSError as exc:
            return _refused_by_storage(base, stem, taken, last_write, exc)
        logger.info("shipped %d bytes of goodput events of attempt %s, whose writer died", len(data), attempt)
    _refused.pop(stem, None)
    _remove_spool(base, taken)
    return 1


def _refused_by_storage(base: Path, stem: str, taken: Path, last_write: float, exc: OSError) -> int:
    """Put the spool back for a later sweep, or drop it once it is ``SPOOL_KEEP_S`` old."""
    age = time.time() - last_write
    if age > SPOOL_KEEP_S:
        logger.warning("dropping the goodput events of dead worker spool %s: unshipped for %.0f s (%s)", stem, age, exc)
        _refused.pop(stem, None)
        _remove_spool(base, taken)
        return 0
    if stem not in _refused:
        logger.warning(
            "could not ship the goodput events of a dead worker (%s); retrying every %.0f s", exc, _RETRY_AFTER_S
        )
    _refused[stem] = time.monotonic() + _RETRY_AFTER_S
    try:
        os.rename(taken, f"{base}{_LOG}")
        os.utime(f"{base}{_LOG}", (last_write, last_write))  # its age goes on from its writer's last event
    except FileNotFoundError:  # another sweep took it meanwhile (it judged this taker by the age)
        pass
    return 0


def _remove_spool(base: Path, taken: Path) -> None:
    taken.unlink(missing_ok=True)
    for suffix in (_SENT, _ROOT):
        Path(f"{base}{suffix}").unlink(missing_ok=True)
    for tmp in base.parent.glob(f"{base.name}.*.tmp"):  # a write aside its writer's kill cut short
        tmp.unlink(missing_ok=True)


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
        self._partial: dict[str, int] = {}  # chunks read before their writer closed them: their size then
        self._events: dict[str, list[dict[str, Any]]] = {}
        self._seen: dict[str, _Seqs] = {}  # per attempt: the sequence numbers read
        self.reads = 0

    def poll(self) -> dict[str, list[dict[str, Any]]]:
        """Every attempt's events so far, ``{attempt: [event, ...]}`` in time order. Raises
        the storage error of a listing or read that failed; the next poll reads on from
        what was read before it."""
        changed: set[str] = set()
        try:
            for info in list_dir(self._root, EVENTS_DIR, recursive=True):
                rel = info.path[len(self._base) + 1 :]
                if rel.endswith(".jsonl") and self._is_new(rel, info.size):
                    attempt = rel.split("/")[0].removesuffix(".jsonl")
                    fresh = self._seen.setdefault(attempt, _Seqs()).keep_new(self._read_new(rel))
                    self._events.setdefault(attempt, []).extend(fresh)
                    changed.add(attempt)
        finally:  # a read that failed leaves what was read before it in order
            for attempt in changed:
                self._events[attempt].sort(key=lambda e: e["t"])
        return self._events

    def _is_new(self, rel: str, size: int | None) -> bool:
        if "/" in rel:  # a chunk object: immutable once written (whole: it ends a line)
            return rel not in self._chunks and (size is None or self._partial.get(rel) != size)
        return size is None or size > self._offsets.get(rel, 0)

    def _read_new(self, rel: str) -> list[dict[str, Any]]:
        self.reads += 1
        if "/" in rel:
            data = read_bytes(self._root, f"{EVENTS_DIR}/{rel}")
            if not data.endswith(b"\n"):  # listed while written (HDFS lists it empty until closed)
                self._partial[rel] = len(data)  # read again once its size changes
                return []
            self._partial.pop(rel, None)
            events = _parse(data.decode())
            self._chunks.add(rel)  # once read: a failed read is tried again at the next poll
            return events
        start = self._offsets.get(rel, 0)
        with self._root.fs.open_input_file(f"{self._base}/{rel}") as f:
            f.seek(start)
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self._offsets[rel] = start + len(whole)
        return _parse(whole.decode())


class _Seqs:
    """The sequence numbers of one log read so far, as sorted disjoint ranges (a chunk is a
    run of consecutive numbers, so a log is a handful of ranges, however long)."""

    def __init__(self) -> None:
        self._lo: list[int] = []
        self._hi: list[int] = []

    def keep_new(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``events`` less those read before (an event without ``seq`` is always new)."""
        fresh = [e for e in events if not isinstance(e.get("seq"), int) or not self._has(e["seq"])]
        for e in fresh:
            if isinstance(e.get("seq"), int):
                self._add(e["seq"])
        return fresh

    def _has(self, n: int) -> bool:
        i = bisect.bisect_right(self._lo, n) - 1
        return i >= 0 and n <= self._hi[i]

    def _add(self, n: int) -> None:
        i = bisect.bisect_right(self._lo, n) - 1
        if i >= 0 and self._hi[i] + 1 == n:  # extends the range before it
            self._hi[i] = n
        else:
            i += 1
            self._lo.insert(i, n)
            self._hi.insert(i, n)
        if i + 1 < len(self._lo) and self._lo[i + 1] == self._hi[i] + 1:  # meets the next one
            self._hi[i] = self._hi.pop(i + 1)
            self._lo.pop(i + 1)


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
