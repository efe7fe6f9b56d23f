"""CheckpointUploader: the node actor that turns snapshots into committed checkpoints.

One per node. Workers hand it a :class:`ShardJob` (through ``_client.ActorBackend``,
over the uploader's socket, ``_channel``) and go back to training. It writes the rank's DCP
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray_goodput._lazy import LazyModule
from ray_goodput.checkpoint.save._save_state import SaveState
from ray_goodput.checkpoint.uploader import _held
from ray_goodput.checkpoint.uploader._arena_sweep import WorkersArenas
from ray_goodput.checkpoint.uploader._channel import (
    ChannelServer,
    Peer,
    UploaderExitingError,
    UploaderGoneError,
    portable_error,
)
from ray_goodput.checkpoint.uploader._metrics import UploaderMetrics
from ray_goodput.errors import CheckpointError
from ray_goodput.goodput._events import ship_orphaned_events
from ray_goodput.runtime import pid_alive
from ray_goodput.runtime._resume import root_key
from ray_goodput.storage import RetryPolicy, StorageLocation

if TYPE_CHECKING:
    from ray_goodput.checkpoint.uploader._rank_queue import RankLane, Ticket
    from ray_goodput.checkpoint.uploader._shard_job import ShardJob, ShardResult

ray = LazyModule("ray")  # a process that saves through the thread backend never imports it
# Loaded by job_modules(), once the actor runs at its lowered priority.
torch = LazyModule("torch")
_rank_queue = LazyModule("ray_goodput.checkpoint.uploader._rank_queue")
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
#: How often the uploader ships what dead workers' goodput event spools hold.
_EVENT_SWEEP_S = 1.0

__all__ = [
    "CheckpointUploader",
    "UploaderExitingError",
    "UploaderGoneError",
    "job_modules",
]


def job_modules() -> Any:
    """The module that runs the jobs (``_rank_queue``), loaded with torch and DCP on first
    use, and torch held to one thread. Not when this module loads: Ray imports it to start
    the actor, beside training workers that are importing torch themselves, and the actor
    lowers its priority only in ``__init__``."""
    torch.set_num_threads(1)
    _rank_queue.RankLane  # noqa: B018 - loads the module
    return _rank_queue


class CheckpointUploader:
    """The node actor's body: a plain class, made an actor by ``_actor_class()``."""

    def __init__(self, node_id: str, concurrency: int = 8, policy: RetryPolicy | None = None) -> None:
        # Background work: yield the CPU to the training processes on the same node.
        os.nice(10)
        # Torch and DCP load now, at that priority (not with this module, at the workers'):
        # the training workers starting beside it are not slowed by them. Before any thread
        # of this actor exists: two threads importing torch at once can crash the process.
        job_modules()
        self.node_id = node_id
        self._roots: dict[bytes, StorageLocation] = {}
        self._concurrency = concurrency
        self._policy = policy or RetryPolicy()  # jobs carry their own; this is a fallback
        self._lock = threading.Lock()
        self._jobs: dict[str, Ticket] = {}
        self._lanes: dict[tuple[str, int], RankLane] = {}  # one per (run, rank)
        # Workers using it: open channel connections, and (pid, token) registrations made
        # by endpoint() (until that worker's hello; for good when it cannot reach the socket).
        self._peers: set[Peer] = set()
        self._connections: dict[str, Peer] = {}  # by connection id (the worker's, from its hello)
        self._clients: set[tuple[int, str]] = set()
        self._arenas = WorkersArenas()  # swept once their worker is gone
        self._clean_close = False
        self._had_client = False
        self._exiting = False  # set under _lock once the watchdog decided to exit
        self._idle_since = time.monotonic()
        self._metrics = UploaderMetrics(node_id)
        self._stats: dict[str, Any] = {
            "jobs_done": 0,
            "jobs_failed": 0,
            "jobs_superseded": 0,
            "bytes_uploaded": 0,
            "upload_seconds": 0.0,
            "last_error": None,
        }
        self._channel = _listen(self)
        # Saves of workers that died before this uploader was up, taken at once (and at each
        # registration): with the once-a-second look alone, a restarted run resumed without
        # them (tests/test_restart_fidelity.py).
        self._take_orphans()
        _held.sweep_other_nodes(node_id)
        threading.Thread(target=self._watch, name="rg-uploader-watch", daemon=True).start()
        threading.Thread(target=_ship_events, name="rg-uploader-events", daemon=True).start()

    # -- client side API --
    def endpoint(self, pid: int, root: bytes | None = None, token: str = "") -> str | None:
        """Register a worker (its process ``pid``; ``token`` tells apart two of one process)
        and return the path of this uploader's socket (None: it has none; hand jobs over by
        actor calls). ``root``: the worker's storage location, pickled, resolved here ahead
        of its first job (an S3 client is slow to build). Raises UploaderExitingError
        when this uploader is exiting."""
        self._add_client(lambda: self._clients.add((pid, token)))
        self._warm(root)
        self._take_orphans()
        return self._channel.path if self._channel is not None else None

    def _add_client(self, add: Any) -> None:
        with self._lock:
            if self._exiting:
                raise UploaderExitingError(
                    f"the uploader on node {self.node_id} is exiting (idle with no "
                    "live client); register with a new one"
                )
            add()
            self._clean_close = False
            self._had_client = True

    def _warm(self, root: bytes | None) -> None:
        try:
            self._resolve_root(root)
        except Exception as exc:  # noqa: BLE001 - a warm-up: the first job resolves it again and fails there
            logger.warning("could not resolve a worker's storage location ahead of its first save: %s", exc)

    # -- the channel's callbacks (ChannelServer threads) --
    def _on_hello(self, peer: Peer, pid: int, root: bytes | None, token: str, conn: str) -> bool:
        def connect() -> None:  # the connection replaces the registration from endpoint()
            self._peers.add(peer)
            self._clients.discard((pid, token))
            self._connections[conn] = peer
            peer.pid = pid

        peer.conn = conn
        try:
            self._add_client(connect)
        except UploaderExitingError:
            return False
        self._warm(root)
        return True

    def _on_request(self, peer: Peer, body: tuple[Any, ...]) -> Any:
        if body[0] == "submit":
            self._accept(body[1], body[2], peer)
            return None
        raise CheckpointError(f"unknown uploader request {body[0]!r}")

    def _on_close(self, peer: Peer) -> None:
        with self._lock:
            self._peers.discard(peer)
            if self._connections.get(peer.conn) is peer:
                del self._connections[peer.conn]
            self._clean_close = peer.said_bye and not (self._peers or self._clients)
        self._idle_since = time.monotonic()

    def _sweep_gone(self) -> None:
        """Remove the arenas of the workers whose jobs this uploader ran and whose process
        is gone (``_arena_sweep``)."""
        with self._lock:
            connected = {peer.pid for peer in self._peers}
        self._arenas.sweep_gone(connected)

    def _resolve_root(self, root: bytes | None) -> StorageLocation | None:
        if root is None:
            return None
        loc = self._roots.get(root)
        if loc is None:
            loc = self._roots[root] = pickle.loads(root)  # noqa: S301 - from our own workers
        return loc

    def unregister(self, pid: int, token: str = "") -> None:
        with self._lock:
            self._clients.discard((pid, token))
            self._clean_close = not (self._clients or self._peers)
        self._idle_since = time.monotonic()

    def submit(self, job: ShardJob, root: bytes) -> None:
        """Accept a job handed over by an actor call (see :meth:`_accept`)."""
        self._accept(job, root, None)

    def _accept(self, job: ShardJob, root: bytes, peer: Peer | None, held: Path | None = None) -> None:
        """Accept a job (returns at once, its arena mapped); from here on it no longer
        needs its worker. A waiting job of the same rank is superseded by it. ``peer``: the
        channel connection its events go to (None: the worker asks with actor calls).
        ``held``: the file of a dead worker's held job this uploader took (``_held``),
        removed when the job ends; a job its worker then sent anyway is not run twice.

        ``root`` is the job's StorageLocation, pickled: building an S3 client from its
        pickle is slow, so it is done once per storage root, not once per save.
        """
        if held is None and not _held.take(self.node_id, job):
            logger.info("uploader on node %s: %s was taken from its held file already", self.node_id, job.key)
            return
        ticket = _rank_queue.Ticket(dataclasses.replace(job, root=self._resolve_root(root)))
        if held is None:  # a sweep may unlink it now
            _held.arena_mapped(job)
        # else a dead worker's held job: its arena stays marked until the job ends, as the
        # next uploader takes the job again, from its snapshot, if this one dies first
        if job.slots:
            self._arenas.ran(job)
        if held is not None:  # its file and its arena's mark go when it ends, then the arena if unneeded
            ticket.callbacks.append(lambda t: (_held.remove(held, job), self._arenas.released(t.job)))
        if peer is not None:  # first: the worker must hear whatever the bookkeeping does
            ticket.origin = peer.conn
            ticket.release_callbacks.append(lambda t: peer.send(("released", t.job.key)))
            ticket.callbacks.append(functools.partial(self._tell_done, peer))
        ticket.release_callbacks.append(self._released)
        ticket.callbacks.append(self._finished)
        with self._lock:
            self._jobs[job.key] = ticket
            lane = self._lanes.get(job.lane)
            if lane is None:
                lane = self._lanes[job.lane] = _rank_queue.RankLane(concurrency=self._concurrency, policy=self._policy)
        self._metrics.queued(job.num_bytes, +1)
        try:
            lane.submit(ticket)
        except BaseException as exc:  # the lane did not take it: end it here, or it stays "busy" for ever
            ticket.finish(None, exc)
            raise

    def _take_orphans(self) -> None:
        """Run the held jobs of workers that died before they handed them over (``_held``)."""
        for path, job, root in _held.orphans(self.node_id):
            logger.warning(
                "uploader on node %s: taking step %d (rank %d) from worker %d, which died before "
                "it could hand the job over",
                self.node_id,
                job.step,
                job.rank,
                job.owner_pid,
            )
            try:
                self._accept(job, root, None, held=path)
            except Exception:  # one lost save, not an uploader down
                logger.warning("could not run the held job %s", job.key, exc_info=True)
                _held.remove(path, job)

    def wait_connection(self, conn: str, timeout_s: float | None) -> bool:
        """Wait until connection ``conn`` (one that broke or closed; "" for none) has had
        its last frame handled; False when that took longer than ``timeout_s``."""
        peer = self._connections.get(conn) if conn else None
        return peer is None or peer.ended.wait(timeout_s)

    def wait_released(self, key: str, conn: str = "") -> None:
        """Return once job ``key`` let go of its arena. Unbounded here on purpose: a result
        means "the arena is free", which only the job can say; the worker bounds its own
        wait for it (``_ARENA_WAIT_S``) and raises when it runs out. ``conn``: the broken
        connection the job was sent on; its frames are all handled before this looks."""
        self.wait_connection(conn, None)
        ticket = self._jobs.get(key)
        if ticket is None or (conn and ticket.origin != conn):  # over (collected), or not read from that connection
            return
        ticket.released.wait()

    def wait_durable(self, key: str, timeout_s: float, conn: str = "") -> ShardResult:
        """Job ``key``'s result once it is durable (or its error); TimeoutError after
        ``timeout_s``, so that no actor thread waits on a stuck upload for ever (the job
        itself goes on, and may still commit). ``conn``: as for :meth:`wait_released`."""
        deadline = time.monotonic() + timeout_s
        if not self.wait_connection(conn, timeout_s):
            raise TimeoutError(
                f"the uploader on node {self.node_id} had not read a broken connection's "
                f"last frames after {timeout_s:.0f}s"
            )
        ticket = self._jobs.get(key)
        if ticket is None or (conn and ticket.origin != conn):  # a retry of the key may have come on another
            raise CheckpointError(
                f"the uploader on node {self.node_id} has no job {key} from that connection: "
                "it never read it, or it ended and its outcome went out before the break"
            )
        if not ticket.done.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(
                f"step {ticket.job.step} (rank {ticket.job.rank}) was not durable after "
                f"{timeout_s:.0f}s in the uploader on node {self.node_id}"
            )
        with self._lock:
            self._jobs.pop(key, None)
        if ticket.error is not None:
            raise ticket.error
        return ticket.result

    def _tell_done(self, peer: Peer, ticket: Ticket) -> None:
        error = portable_error(ticket.error) if ticket.error is not None else None
        if peer.send(("done", ticket.job.key, ticket.result, error)) or peer.final:
            with self._lock:  # the worker heard, or left for good: nobody asks wait_durable for it
                self._jobs.pop(ticket.job.key, None)
        # else kept for the worker's wait_durable, and the uploader stays up for it (_live_clients)

    # -- bookkeeping --
    def _released(self, ticket: Ticket) -> None:
        self._arenas.released(ticket.job)

    def _finished(self, ticket: Ticket) -> None:
        job, result = ticket.job, ticket.result
        with self._lock:
            if ticket.error is not None:
                self._stats["jobs_failed"] += 1
                error = ticket.error
                self._stats["last_error"] = f"step {job.step} rank {job.rank}: {type(error).__name__}: {error}"
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
        return {
            "node_id": self.node_id,
            "queue": len(pending),
            "bytes_pending": sum(j.num_bytes for j in pending),
            "bytes_uploaded": self._stats["bytes_uploaded"],
            "throughput_mb_s": self._stats["bytes_uploaded"] / secs / 1e6 if secs else 0.0,
            "jobs_done": self._stats["jobs_done"],
            "jobs_failed": self._stats["jobs_failed"],
            "jobs_superseded": self._stats["jobs_superseded"],
            "last_error": self._stats["last_error"],
            "clients": len(self._clients) + len(self._peers),
            "storage_roots": sorted(loc.uri for loc in list(self._roots.values())),
        }

    def wait_uploads(self, root: str, above: int | None, timeout_s: float) -> list[int]:
        """Wait up to ``timeout_s`` for this node's jobs of storage root ``root`` (its
        ``root_key``) of steps above ``above`` (None: any step) to end, the held jobs of
        dead workers taken first; the steps still in flight then (empty: none left). A job
        a live worker still holds (saved while its connection to this uploader was being
        made; the worker may be in its teardown) is waited for too: it reaches this
        uploader by its worker or, once the worker is dead, by the look for orphans."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._take_orphans()
            with self._lock:
                open_ = [
                    t
                    for t in self._jobs.values()
                    if not t.done.is_set()
                    and (above is None or t.job.step > above)
                    and t.job.root is not None
                    and root_key(t.job.root) == root
                ]
            held = self._held_steps(root, above)
            left = deadline - time.monotonic()
            if (not open_ and not held) or left <= 0:
                return sorted({t.job.step for t in open_} | held)
            if open_:
                open_[0].done.wait(min(left, 0.5))
            else:
                time.sleep(min(left, 0.1))

    def _held_steps(self, root: str, above: int | None) -> set[int]:
        """Steps of root ``root`` (a ``root_key``) above ``above`` that live workers of this
        node still hold (``_held.pending``)."""
        steps = set()
        for job, loc in _held.pending(self.node_id):
            if (above is None or job.step > above) and loc is not None and root_key(pickle.loads(loc)) == root:  # noqa: S301 - our own workers' file, in a directory only we can write
                steps.add(job.step)
        return steps

    # -- lifetime --
    def busy(self) -> bool:
        with self._lock:
            return any(not t.done.is_set() for t in self._jobs.values())

    def _live_clients(self) -> int:
        """Live registrations and connections, and live workers with an ended job they have
        not collected yet (their connection broke; they ask the actor)."""
        with self._lock:
            self._clients = {(pid, token) for pid, token in self._clients if pid_alive(pid)}
            # Ended jobs nobody collected (their worker died before it asked): forget them.
            for key in [k for k, t in self._jobs.items() if t.done.is_set() and not pid_alive(t.job.owner_pid)]:
                del self._jobs[key]
            return len(self._clients) + len(self._peers) + len(self._uncollected())

    def _uncollected(self) -> set[int]:
        """Workers (pids) with an ended job whose outcome they have not heard; under _lock."""
        return {t.job.owner_pid for t in self._jobs.values() if t.done.is_set()}

    def _idle_grace_s(self) -> float:
        """How long this uploader stays up idle with no live client."""
        if not self._had_client:
            return _GRACE_BEFORE_FIRST_CLIENT_S
        return _GRACE_AFTER_CLOSE_S if self._clean_close else _GRACE_AFTER_DEATH_S

    def _watch(self) -> None:
        """Once a second: run dead workers' held jobs, remove gone workers' arenas, and exit
        once idle with no live client for a while (its run ended or died)."""
        while True:
            time.sleep(1.0)
            self._take_orphans()
            try:
                self._sweep_gone()
            except Exception:  # a sweep leaves files at worst; this thread must go on
                logger.warning("the sweep of gone workers' snapshot arenas failed", exc_info=True)
            if self.busy() or self._live_clients():
                self._idle_since = time.monotonic()
                continue
            if time.monotonic() - self._idle_since > self._idle_grace_s():
                with self._lock:  # decided where register() looks: a worker registering from now on is told
                    if self._clients or self._peers or self._jobs:  # running, or ended and not collected
                        continue
                    self._exiting = True
                logger.info("uploader on node %s: idle with no live client; exiting", self.node_id)
                self._arenas.sweep_all(os.getpid())
                try:
                    if self._channel is not None:
                        self._channel.close()
                    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                except Exception:  # keep serving rather than refuse every worker
                    logger.warning("uploader on node %s could not exit; serving on", self.node_id, exc_info=True)
                    with self._lock:
                        self._exiting = False
                    self._channel = _listen(self)
                    self._idle_since = time.monotonic()
                    continue
                return

    def drain_and_exit(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.busy() and time.monotonic() < deadline:
            time.sleep(0.1)
        self._arenas.sweep_all(os.getpid())
        if self._channel is not None:
            self._channel.close()
        ray.actor.exit_actor()


def _ship_events() -> None:
    """Ship, about once a second, the goodput events that dead workers on this machine had
    not (``goodput._events``): a rank 0 SIGKILLed between two batches of an object-store
    log. A thread of its own, so that a storage refusing them delays nothing else here."""
    last = ""
    while True:
        try:
            ship_orphaned_events()
            last = ""
        except Exception as exc:  # one sweep's error must not end the sweeps
            if repr(exc) != last:  # once per distinct error, not once a second
                logger.warning("the sweep of dead workers' goodput events failed", exc_info=True)
            last = repr(exc)
        time.sleep(_EVENT_SWEEP_S)


def _listen(uploader: CheckpointUploader) -> ChannelServer | None:
    """The uploader's socket; None (workers fall back to actor calls) when it cannot listen."""
    try:
        return ChannelServer(
            uploader.node_id,
            uploader._on_hello,  # noqa: SLF001 - the uploader's own channel callbacks
            uploader._on_request,  # noqa: SLF001 - as above
            uploader._on_close,  # noqa: SLF001 - as above
        )
    except OSError as exc:
        logger.warning(
            "uploader on node %s has no socket (%s): workers hand it jobs by actor calls, a few ms slower per save",
            uploader.node_id,
            exc,
        )
        return None


@functools.cache
def _actor_class() -> Any:
    """The ``@ray.remote`` CheckpointUploader (made at first use: that imports Ray)."""
    return ray.remote(CheckpointUploader)
