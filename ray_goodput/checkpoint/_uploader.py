"""CheckpointUploader: the node actor that turns snapshots into committed checkpoints.

One per node. Workers hand it a :class:`ShardJob` (through :class:`ActorBackend`) and go
back to training. It writes the rank's DCP
files into the node-local staging dir, uploads them with parallel streams and retries,
declares the rank durable and commits when it sees the last rank. It is a detached,
named actor (``uploader:<node_id>`` in namespace ``ray_goodput``) so it survives the
worker that handed it a job, and it exits once no live worker on its node uses it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pickle
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from ray_goodput._lazy import LazyModule
from ray_goodput.checkpoint._backends import Handoff
from ray_goodput.checkpoint._job import ShardJob, ShardResult
from ray_goodput.checkpoint._lane import RankLane, Ticket
from ray_goodput.checkpoint._metrics import UploaderMetrics
from ray_goodput.checkpoint._save_state import SaveState
from ray_goodput.errors import CheckpointError
from ray_goodput.runtime import _services, pid_alive
from ray_goodput.storage import RetryPolicy, StorageLocation

ray = LazyModule("ray")  # a process that saves through the thread backend never imports it
logger = logging.getLogger(__name__)

KIND = "uploader"
# Exit this long after the last client closed cleanly, or after the last one died
# (long enough for Ray Train to restart the worker group and reconnect).
_GRACE_AFTER_CLOSE_S = 2.0
_GRACE_AFTER_DEATH_S = 30.0
# Exit this long after starting when no worker ever registered: the trainer creates the
# uploader before its workers initialize, and a worker registers only once it has built
# its model and made its Checkpointer (which can take minutes for a large model).
_GRACE_BEFORE_FIRST_CLIENT_S = 600.0
# Bound on handing one job to the uploader (its start included).
_HANDOFF_TIMEOUT_S = 120.0
# Bound on waiting for an uploader that said it is exiting to be gone.
_EXIT_WAIT_S = 30.0


class UploaderExitingError(CheckpointError):
    """The uploader a worker tried to register with is exiting (it was idle with no live
    client); the worker waits until it is gone and makes a new one."""


class CheckpointUploader:
    """The node actor's body: a plain class, made an actor by ``_actor_class()``."""

    def __init__(self, node_id: str, concurrency: int = 8, policy: RetryPolicy | None = None) -> None:
        # Background work: yield the CPU to the training processes on the same node.
        os.nice(10)
        torch.set_num_threads(1)
        self.node_id = node_id
        self._roots: dict[bytes, StorageLocation] = {}
        self._concurrency = concurrency
        self._policy = policy or RetryPolicy()  # jobs carry their own; this is a fallback
        self._lock = threading.Lock()
        self._jobs: dict[str, Ticket] = {}
        self._lanes: dict[tuple[str, int], RankLane] = {}  # one per (run, rank)
        self._clients: set[int] = set()
        self._clean_close = False
        self._had_client = False
        self._exiting = False  # set under _lock once the watchdog decided to exit
        self._idle_since = time.monotonic()
        self._metrics = UploaderMetrics(node_id)
        self._stats: dict[str, Any] = {"jobs_done": 0, "jobs_failed": 0, "jobs_superseded": 0,
                                       "bytes_uploaded": 0, "upload_seconds": 0.0, "last_error": None}
        threading.Thread(target=self._watch, name="rg-uploader-watch", daemon=True).start()

    # -- client side API --
    def register(self, pid: int, root: bytes | None = None) -> str:
        """A worker uses this uploader from now on; ``root``: its storage location, pickled,
        resolved here ahead of its first job (an S3 client takes ~0.1 s to build).
        Raises UploaderExitingError when this uploader is exiting."""
        with self._lock:
            if self._exiting:
                raise UploaderExitingError(f"the uploader on node {self.node_id} is exiting (idle with no "
                                           "live client); register with a new one")
            self._clients.add(pid)
            self._clean_close = False
            self._had_client = True
        try:
            self._resolve_root(root)
        except Exception as exc:  # noqa: BLE001 - a warm-up: the first job resolves it again and fails there
            logger.warning("could not resolve a worker's storage location ahead of its first save: %s", exc)
        return self.node_id

    def _resolve_root(self, root: bytes | None) -> StorageLocation | None:
        if root is None:
            return None
        loc = self._roots.get(root)
        if loc is None:
            loc = self._roots[root] = pickle.loads(root)  # noqa: S301 - from our own workers
        return loc

    def unregister(self, pid: int) -> None:
        with self._lock:
            self._clients.discard(pid)
            self._clean_close = not self._clients
        self._idle_since = time.monotonic()

    def submit(self, job: ShardJob, root: bytes) -> None:
        """Accept a job (returns at once, its arena mapped); from here on it no longer
        needs its worker. A waiting job of the same rank is superseded by it.

        ``root`` is the job's StorageLocation, pickled: building an S3 client from its
        pickle costs ~0.1 s, so it is done once per storage root, not once per save.
        """
        ticket = Ticket(dataclasses.replace(job, root=self._resolve_root(root)))
        ticket.release_callbacks.append(self._released)
        ticket.callbacks.append(self._finished)
        with self._lock:
            self._jobs[job.key] = ticket
            lane = self._lanes.get(job.lane)
            if lane is None:
                lane = self._lanes[job.lane] = RankLane(concurrency=self._concurrency, policy=self._policy)
        self._metrics.queued(job.num_bytes, +1)
        lane.submit(ticket)

    def cancel(self, key: str) -> bool:
        """Supersede job ``key`` when it is still waiting."""
        ticket = self._jobs.get(key)
        lane = self._lanes.get(ticket.job.lane) if ticket is not None else None
        return lane is not None and lane.cancel(key)

    def wait_released(self, key: str) -> None:
        """Return once job ``key`` let go of its arena. Unbounded here on purpose: a result
        means "the arena is free", which only the job can say; the worker bounds its own
        wait for it (``_ARENA_WAIT_S``) and raises when it runs out."""
        ticket = self._jobs.get(key)
        if ticket is None:  # wait_durable already collected it: the job is over
            return
        ticket.released.wait()

    def wait_durable(self, key: str, timeout_s: float) -> ShardResult:
        """Job ``key``'s result once it is durable (or its error); TimeoutError after
        ``timeout_s``, so that no actor thread waits on a stuck upload for ever (the job
        itself goes on, and may still commit)."""
        ticket = self._jobs[key]
        if not ticket.done.wait(timeout_s):
            raise TimeoutError(f"step {ticket.job.step} (rank {ticket.job.rank}) was not durable after "
                               f"{timeout_s:.0f}s in the uploader on node {self.node_id}")
        with self._lock:
            self._jobs.pop(key, None)
        if ticket.error is not None:
            raise ticket.error
        return ticket.result

    # -- bookkeeping --
    def _released(self, ticket: Ticket) -> None:
        if not pid_alive(ticket.job.owner_pid):  # its worker died: nobody else frees the arena
            Path(ticket.job.arena_path).unlink(missing_ok=True)

    def _finished(self, ticket: Ticket) -> None:
        job, result = ticket.job, ticket.result
        with self._lock:
            if ticket.error is not None:
                self._stats["jobs_failed"] += 1
                self._stats["last_error"] = f"step {job.step} rank {job.rank}: {type(ticket.error).__name__}: {ticket.error}"
            elif result is not None and result.state is SaveState.SUPERSEDED:
                self._stats["jobs_superseded"] += 1
            elif result is not None:
                self._stats["jobs_done"] += 1
                self._stats["bytes_uploaded"] += result.num_bytes
                self._stats["upload_seconds"] += result.upload_seconds
        if ticket.error is not None:
            self._metrics.failed()
        elif result is not None and result.state is not SaveState.SUPERSEDED:
            self._metrics.uploaded(result.num_bytes, result.upload_seconds)
        self._metrics.queued(-job.num_bytes, -1)
        self._idle_since = time.monotonic()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            pending = [t.job for t in self._jobs.values() if not t.done.is_set()]
        secs = self._stats["upload_seconds"]
        return {"node_id": self.node_id, "queue": len(pending),
                "bytes_pending": sum(j.num_bytes for j in pending),
                "bytes_uploaded": self._stats["bytes_uploaded"],
                "throughput_mb_s": self._stats["bytes_uploaded"] / secs / 1e6 if secs else 0.0,
                "jobs_done": self._stats["jobs_done"], "jobs_failed": self._stats["jobs_failed"],
                "jobs_superseded": self._stats["jobs_superseded"],
                "last_error": self._stats["last_error"], "clients": len(self._clients),
                "storage_roots": sorted(loc.uri for loc in list(self._roots.values()))}

    # -- lifetime --
    def busy(self) -> bool:
        with self._lock:
            return any(not t.done.is_set() for t in self._jobs.values())

    def _live_clients(self) -> int:
        with self._lock:
            self._clients = {pid for pid in self._clients if pid_alive(pid)}
            return len(self._clients)

    def _idle_grace_s(self) -> float:
        """How long this uploader stays up idle with no live client."""
        if not self._had_client:
            return _GRACE_BEFORE_FIRST_CLIENT_S
        return _GRACE_AFTER_CLOSE_S if self._clean_close else _GRACE_AFTER_DEATH_S

    def _watch(self) -> None:
        """Exit once idle with no live client for a while (its run ended or died)."""
        while True:
            time.sleep(1.0)
            if self.busy() or self._live_clients():
                self._idle_since = time.monotonic()
                continue
            if time.monotonic() - self._idle_since > self._idle_grace_s():
                with self._lock:  # decided where register() looks: a worker registering from now on is told
                    if self._clients or any(not t.done.is_set() for t in self._jobs.values()):
                        continue
                    self._exiting = True
                logger.info("uploader on node %s: idle with no live client; exiting", self.node_id)
                try:
                    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                except Exception:  # noqa: BLE001 - keep serving rather than refuse every worker
                    logger.warning("uploader on node %s could not exit; serving on", self.node_id, exc_info=True)
                    with self._lock:
                        self._exiting = False
                    self._idle_since = time.monotonic()
                    continue
                return

    def drain_and_exit(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.busy() and time.monotonic() < deadline:
            time.sleep(0.1)
        ray.actor.exit_actor()


@functools.cache
def _actor_class() -> Any:
    """The ``@ray.remote`` CheckpointUploader (made at first use: that imports Ray)."""
    return ray.remote(CheckpointUploader)


def start_node_uploader(node_id: str, runtime_env: dict[str, Any] | None = None) -> None:
    """Find or create the uploader of node ``node_id`` without waiting for it to start.

    Run by Ray Train's controller for every worker node once a worker group is placed
    (``driver._node_services``), so the actor is up before the first save needs it.
    ``runtime_env``: the workers' (``RunConfig.worker_runtime_env``), which an uploader
    a worker creates inherits. Settings travel with each job.
    """
    _services.get_or_create(_actor_class(), KIND, node_id, node_id=node_id, max_concurrency=64,
                            runtime_env=runtime_env)


def _chain(source: Future, target: Future) -> None:
    def _copy(done: Future) -> None:
        if target.done():
            return
        if done.cancelled():
            target.set_exception(CheckpointError("the uploader cancelled this job"))
        elif done.exception() is not None:
            target.set_exception(done.exception())
        else:
            target.set_result(done.result())
    source.add_done_callback(_copy)


class ActorBackend:
    """Runs a rank's shard jobs in its node's CheckpointUploader (found or created).

    ``submit`` hands the job over before it returns (one actor round trip, the actor maps
    the arena): a save that returned survives its worker being killed right after. The
    trainer creates the uploaders before the workers initialize their train context
    (``driver._node_services``), so the first save does not wait for the actor to start;
    without it, a save made before the actor is up waits for it (bounded), rather than
    holding a job that would die with the worker.
    """

    def __init__(self, *, durable_timeout_s: float, root: StorageLocation | None = None) -> None:
        self._actor = None
        self._registered = None
        # Sent at registration: the actor builds the storage client before the first save.
        self._root_blob: bytes | None = pickle.dumps(root) if root is not None else None
        self._durable_timeout_s = durable_timeout_s  # bound of the actor-side wait for a result

    def start(self) -> None:
        """Find or create this node's uploader without waiting for it (it starts, and
        resolves the storage location, while the worker builds its model and restores)."""
        node_id = _services.current_node_id()
        self._actor = _services.get_or_create(_actor_class(), KIND, node_id, node_id=node_id, max_concurrency=64)
        self._registered = self._actor.register.remote(os.getpid(), self._root_blob)

    def _get(self, fresh: bool = False) -> Any:
        if self._actor is None or fresh:
            self.start()
        try:
            ray.get(self._registered, timeout=_HANDOFF_TIMEOUT_S)
        except UploaderExitingError:  # it was idle and is going: its name is free once it is gone
            _wait_gone(self._actor)
            self.start()
            ray.get(self._registered, timeout=_HANDOFF_TIMEOUT_S)
        return self._actor

    def submit(self, job: ShardJob) -> Handoff:
        if self._root_blob is None:
            self._root_blob = pickle.dumps(job.root)
        handoff = Handoff(released=Future(), durable=Future(), key=job.key)
        self._hand_over(dataclasses.replace(job, root=None), handoff)
        return handoff

    def _hand_over(self, light: ShardJob, handoff: Handoff) -> None:
        try:
            try:
                actor = self._get()
                ray.get(actor.submit.remote(light, self._root_blob), timeout=_HANDOFF_TIMEOUT_S)
            except ray.exceptions.RayActorError:
                # The uploader died (killed, or exiting as idle): a new one takes the job.
                actor = self._get(fresh=True)
                ray.get(actor.submit.remote(light, self._root_blob), timeout=_HANDOFF_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the save fails; wait() raises it on every rank
            failure = CheckpointError(f"could not hand step {light.step} to the node uploader within "
                                      f"{_HANDOFF_TIMEOUT_S:.0f}s: {type(exc).__name__}: {exc}; "
                                      "check it with 'ray-goodput status'")
            handoff.released.set_result(None)
            handoff.durable.set_exception(failure)
            return
        # Asked only after submit returned: the actor knows the key by then.
        _chain(actor.wait_released.remote(light.key).future(), handoff.released)
        _chain(actor.wait_durable.remote(light.key, self._durable_timeout_s).future(), handoff.durable)

    def cancel(self, key: str) -> bool:
        if self._actor is None:
            return False
        try:
            return bool(ray.get(self._actor.cancel.remote(key), timeout=60))
        except Exception as exc:  # noqa: BLE001 - a dead uploader runs nothing: its jobs fail
            logger.warning("could not cancel waiting save %s: %s", key, exc)
            return False

    def close(self) -> None:
        if self._actor is not None:
            try:
                ray.get(self._actor.unregister.remote(os.getpid()), timeout=30)
            except Exception as exc:  # noqa: BLE001 - it may be gone already
                logger.debug("uploader unregister failed: %s", exc)
            self._actor = None


def _wait_gone(actor: Any) -> None:
    """Return once ``actor`` (an uploader that said it is exiting) is dead; raise
    CheckpointError after ``_EXIT_WAIT_S``."""
    deadline = time.monotonic() + _EXIT_WAIT_S
    while time.monotonic() < deadline:
        try:
            ray.get(actor.busy.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            break
        time.sleep(0.05)
    raise CheckpointError(f"the node uploader said it was exiting but was still up after {_EXIT_WAIT_S:.0f}s; "
                          "check it with 'ray-goodput status'")


def uploader_status(timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """``stats()`` of every live CheckpointUploader, sorted by node id (with ``error`` set
    when one did not answer within ``timeout_s``). Needs ``ray.init``."""
    refs = {node: h.stats.remote() for node, h in _services.find(KIND).items()}
    out = []
    for node, ref in sorted(refs.items()):
        try:
            out.append(ray.get(ref, timeout=timeout_s))
        except Exception as exc:  # noqa: BLE001 - report it, keep listing
            out.append({"node_id": node, "error": f"{type(exc).__name__}: {exc}"})
    return out
