"""CacheClient: the training process's link to its node cache.

That is the node's NodeCache actor, or an in-process CacheKeeper when Ray is not
initialized. Only ``prefetch`` announcements go through it; reads never do."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from ray_goodput._lazy import LazyModule
from ray_goodput.data._cache_actor import get_cache
from ray_goodput.data._cache_files import CacheLayout
from ray_goodput.data._cache_keeper import CacheKeeper
from ray_goodput.data._config import CacheConfig
from ray_goodput.data._sources import FileSet
from ray_goodput.runtime import ray_initialized

ray = LazyModule("ray")
logger = logging.getLogger(__name__)
_CONNECT_TIMEOUT_S = 120.0


class CacheClient:
    """Connects on construction (blocking, once); ``prefetch`` does not block."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self._actor = None
        self._local: CacheKeeper | None = None
        self._stop = threading.Event()
        self._pending: list = []
        self._filesets: dict[int, FileSet] = {}
        info = self._connect()
        self.layout = CacheLayout(Path(info["directory"]))
        self.capacity_bytes = int(info["capacity_bytes"])
        wanted = config.directory and Path(config.directory).absolute() != self.layout.root
        if wanted or (config.capacity_bytes and config.capacity_bytes != self.capacity_bytes):
            logger.warning(
                "node cache already runs at %s with %d bytes; ignoring the requested %s",
                self.layout.root,
                self.capacity_bytes,
                config,
            )

    def _connect(self) -> dict:
        if ray_initialized():
            try:
                return self._attach()
            except ray.exceptions.RayActorError:  # it was exiting (its last job just ended)
                return self._attach()
        self._local = CacheKeeper(self.config)
        threading.Thread(target=self._maintain_local, daemon=True, name="rg-cache-local").start()
        return self._local.describe()

    def _attach(self) -> dict:
        """Find or create the node cache and attach this job to it; its description."""
        self._actor = get_cache(self.config)
        job_id = ray.get_runtime_context().get_job_id()
        return ray.get(self._actor.attach.remote(job_id), timeout=_CONNECT_TIMEOUT_S)

    def _maintain_local(self) -> None:
        while not self._stop.wait(1.0):
            self._local.maintain()

    def register(self, files: FileSet) -> int:
        """Make ``files`` known to the cache (blocking); returns its id for ``prefetch``."""
        fid = files.cache_id()
        if fid not in self._filesets:
            self._filesets[fid] = files
            self._call("register", files, block=True)
        return fid

    def prefetch(self, fileset_id: int, indices: list[int]) -> None:
        """Announce the files a rank reads next, in order (fire and forget)."""
        if indices:
            self._call("prefetch", fileset_id, indices, block=False)

    def _call(self, method: str, *args, block: bool):
        if self._local is not None:
            return getattr(self._local, method)(*args)
        self._check_pending()
        ref = getattr(self._actor, method).remote(*args)
        if block:
            try:
                return ray.get(ref, timeout=_CONNECT_TIMEOUT_S)
            except ray.exceptions.RayActorError:  # it exited between lookup and call
                logger.warning("node cache actor died; recreating it")
                self._reconnect()
                return ray.get(getattr(self._actor, method).remote(*args), timeout=_CONNECT_TIMEOUT_S)
        self._pending.append(ref)
        return None

    def _check_pending(self) -> None:
        """Report failed announcements once; reconnect when the actor died (it is
        recreated on this node, and the readers never depended on it)."""
        ready, self._pending = (
            ray.wait(self._pending, num_returns=len(self._pending), timeout=0) if self._pending else ([], [])
        )
        for ref in ready:
            try:
                queued = ray.get(ref)
            except ray.exceptions.RayActorError:
                logger.warning("node cache actor died; recreating it")
                self._reconnect()
                return
            except Exception as exc:  # noqa: BLE001 - prefetch is an optimization
                logger.warning("node cache prefetch failed: %s", exc)
                continue
            if queued == -1:  # another rank recreated the cache: it lacks our file lists
                self._reconnect()
                return

    def _reconnect(self) -> None:
        self._pending = []
        self._connect()
        for files in self._filesets.values():
            ray.get(self._actor.register.remote(files), timeout=_CONNECT_TIMEOUT_S)

    def close(self) -> None:
        self._stop.set()
        if self._local is not None:
            self._local.close(0.0)
