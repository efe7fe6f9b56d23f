"""The node cache's logic (LRU accounting, prefetch, eviction), free of Ray.

The NodeCache actor (``_cache_actor``) wraps it; without Ray the loader runs it
in-process. Readers fetch on their own on a miss (see ``_cache_files``); this class learns of
their fetches from the journal and keeps the directory under its capacity.

Recency is the order in which loaders *announced* files (prefetch hints arrive in access
order, just before the access) or fetched them; a hit itself costs no bookkeeping.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ray_goodput.data._cache_files import CacheLayout, fetch, parse_temp
from ray_goodput.data._config import CacheConfig
from ray_goodput.data._journal import JournalReader
from ray_goodput.data._sources import FileSet
from ray_goodput.errors import CacheFullError, FileLargerThanCacheError
from ray_goodput.runtime import pid_alive
from ray_goodput.storage import RetryPolicy

logger = logging.getLogger(__name__)
_MAX_ERRORS = 5
_SWEEP_INTERVAL_S = 60.0


class CacheKeeper:
    """Thread-safe. ``prefetch`` never blocks; ``maintain`` is called about once a second."""

    def __init__(self, config: CacheConfig, node_id: str = "local") -> None:
        self.node_id = node_id
        self.config = config
        self.layout = CacheLayout.of(config)
        self.layout.create()
        self.capacity = config.capacity_bytes or 0  # the default is set by the first scan
        self._policy = RetryPolicy()
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._wanted: OrderedDict[str, None] = OrderedDict()
        self._inflight: dict[str, Future] = {}
        self._filesets: dict[int, FileSet] = {}
        self._journal = JournalReader(self.layout.journal_dir)
        self._pool = ThreadPoolExecutor(config.fetch_concurrency, thread_name_prefix="rg-cache")
        self._latencies: deque[float] = deque(maxlen=10_000)
        self.counts = dict(hits=0, misses=0, evictions=0, bytes_fetched=0, fetches=0, prefetched=0, fetch_seconds=0.0)
        self.errors: list[str] = []
        self._scan()
        logger.info(
            "node cache at %s: %d files, %d/%d bytes", self.layout.root, len(self._lru), self._bytes, self.capacity
        )

    def _scan(self, index: bool = True) -> None:
        """Delete temps of dead writers (a killed fetch); with ``index``, also index the
        files a previous actor left."""
        found = []
        for sub in (self.layout.root / "data").iterdir():
            for entry in os.scandir(sub):
                pid = parse_temp(entry.name)
                if pid is not None:
                    try:
                        writer_alive = pid_alive(pid, since=entry.stat().st_mtime)  # not a later holder of its pid
                    except FileNotFoundError:  # its fetch finished meanwhile
                        continue
                    if not writer_alive:
                        Path(entry.path).unlink(missing_ok=True)
                elif index and not entry.name.startswith("."):
                    st = entry.stat()
                    found.append((st.st_mtime, entry.name, st.st_size))
        self._last_sweep = time.monotonic()
        if not self.capacity:  # 80 % of the disk the cache may use: what is free and what it holds
            held = sum(size for _, _, size in found)
            self.capacity = int(0.8 * (shutil.disk_usage(self.layout.root).free + held))
        with self._lock:
            for _, key, size in sorted(found):
                self._add(key, size)
            self._make_room(0, keep=None)

    def _add(self, key: str, size: int) -> None:
        self._bytes += size - self._lru.get(key, 0)
        self._lru[key] = size
        self._lru.move_to_end(key)

    def describe(self) -> dict:
        return {"directory": str(self.layout.root), "capacity_bytes": self.capacity, "node_id": self.node_id}

    def register(self, files: FileSet) -> int:
        fid = files.cache_id()
        with self._lock:
            self._filesets.setdefault(fid, files)
        return fid

    def prefetch(self, fileset_id: int, indices: list[int]) -> int:
        """Queue downloads of files ``indices`` of a registered FileSet; returns how many,
        or -1 when the FileSet is unknown (this cache was recreated: register again)."""
        files = self._filesets.get(fileset_id)
        if files is None:
            return -1
        queued = 0
        with self._lock:
            for i in indices:
                key = files.cache_key(i)
                self._want(key)
                if key in self._lru:
                    self._lru.move_to_end(key)
                elif key not in self._inflight:
                    self._inflight[key] = self._pool.submit(self._fetch, key, files, i)
                    queued += 1
        return queued

    def _want(self, key: str) -> None:
        self._wanted[key] = None
        self._wanted.move_to_end(key)
        while len(self._wanted) > max(64, 8 * self.config.lookahead):
            self._wanted.popitem(last=False)

    def _fetch(self, key: str, files: FileSet, i: int) -> None:
        try:
            if files.sizes[i] > self.capacity:  # it can never fit: evict nothing for it
                self._error(
                    f"prefetch of {files.uri(i)}: {files.sizes[i]} bytes, larger than the cache capacity "
                    f"({self.capacity} bytes); its reader raises FileLargerThanCacheError"
                )
                return
            self._fetch_once(key, files, i)
        except FileLargerThanCacheError as exc:  # its size unknown until downloaded: evict nothing
            self._error(f"prefetch of {files.uri(i)}: {exc}")
        except CacheFullError:
            with self._lock:  # a full disk: free what we can, then one more try
                self._make_room(max(files.sizes[i], 1) * 2, keep=key, pressure=True)
            try:
                self._fetch_once(key, files, i)
            except Exception as exc2:  # noqa: BLE001 - reported via stats and the reader
                self._error(f"prefetch of {files.uri(i)}: {exc2}")
        except Exception as exc:  # noqa: BLE001 - the reader will fetch and raise itself
            self._error(f"prefetch of {files.uri(i)}: {exc}")
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def _fetch_once(self, key: str, files: FileSet, i: int) -> None:
        if files.sizes[i] > 0:
            with self._lock:
                self._make_room(files.sizes[i], keep=key)
        got = fetch(
            self.layout,
            key,
            files.fs,
            files.paths[i],
            max_bytes=self.capacity,
            policy=self._policy,
            expected=files.sizes[i],
        )
        with self._lock:
            if got is not None:
                self._record_fetch(got[0], got[1])
                self.counts["prefetched"] += 1
            size = got[0] if got else self.layout.data_path(key).stat().st_size
            self._add(key, size)
            self._make_room(0, keep=key)

    def _record_fetch(self, size: int, seconds: float) -> None:
        self.counts["fetches"] += 1
        self.counts["bytes_fetched"] += size
        self.counts["fetch_seconds"] += seconds
        self._latencies.append(seconds)

    def _error(self, text: str) -> None:
        logger.warning("node cache: %s", text)
        with self._lock:
            self.errors = (self.errors + [text])[-_MAX_ERRORS:]

    def _make_room(self, extra: int, keep: str | None, pressure: bool = False) -> None:
        """Evict LRU files until ``extra`` more bytes fit (under ``pressure``, a full disk:
        until ``extra`` bytes are freed). Caller holds the lock.

        Files announced recently (wanted) go last, so prefetch does not evict what a rank
        is about to read unless nothing else is left."""
        target = (self._bytes if pressure else self.capacity) - extra
        for pass_wanted in (False, True):
            for key in list(self._lru):
                if self._bytes <= target:
                    return
                if key == keep or key in self._inflight or (key in self._wanted) != pass_wanted:
                    continue
                self._bytes -= self._lru.pop(key)
                self.layout.data_path(key).unlink(missing_ok=True)
                self.counts["evictions"] += 1

    def maintain(self) -> None:
        """Apply readers' journals (hits, misses, their fetches) and enforce capacity."""
        if time.monotonic() - self._last_sweep > _SWEEP_INTERVAL_S:
            self._scan(index=False)  # temps of loader workers killed mid-fetch
        hits, misses, fetched = self._journal.poll()
        with self._lock:
            self.counts["hits"] += hits
            self.counts["misses"] += misses
            for key, size, seconds in fetched:
                self._record_fetch(size, seconds)
                if self.layout.data_path(key).exists():  # not evicted since (no ghosts)
                    self._add(key, size)
            self._make_room(0, keep=None)

    def drain_latencies(self) -> list[float]:
        with self._lock:
            out = list(self._latencies)
            self._latencies.clear()
        return out

    def stats(self) -> dict:
        self.maintain()
        with self._lock:
            c = dict(self.counts)
            looked = c["hits"] + c["misses"]
            return {
                **self.describe(),
                **c,
                "bytes_used": self._bytes,
                "files": len(self._lru),
                "hit_rate": c["hits"] / looked if looked else 0.0,
                "inflight": len(self._inflight),
                "errors": list(self.errors),
                "time": time.time(),
            }

    def close(self, timeout_s: float) -> None:
        """Stop prefetching; wait up to ``timeout_s`` for downloads in flight."""
        with self._lock:
            pending = list(self._inflight.values())
        for fut in pending:
            fut.cancel()
        deadline = time.monotonic() + timeout_s
        for fut in pending:
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - cancelled or failed: nothing to keep
                pass
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.maintain()
