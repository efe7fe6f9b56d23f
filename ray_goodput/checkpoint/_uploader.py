"""CheckpointUploader: the node actor that turns snapshots into committed checkpoints.

One per node. Workers hand it a :class:`ShardJob` (through :class:`ActorBackend`, over the
uploader's socket, ``_channel``) and go back to training. It writes the rank's DCP
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
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from ray_goodput._lazy import LazyModule
from ray_goodput.checkpoint._backends import Handoff
from ray_goodput.checkpoint._channel import (ChannelClient, ChannelServer, Peer, UploaderExitingError,
                                             UploaderGoneError, portable_error, settle)
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
# Bound on a closing worker's wait for the uploader to read its last jobs, when the
# goodbye got no answer.
_BYE_WAIT_S = 30.0

__all__ = ["ActorBackend", "CheckpointUploader", "UploaderExitingError", "UploaderGoneError",
           "start_node_uploader", "uploader_status"]


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
        # Workers using it: open channel connections, and (pid, token) registrations made
        # by endpoint() (until that worker's hello; for good when it cannot reach the socket).
        self._peers: set[Peer] = set()
        self._connections: dict[str, Peer] = {}  # by connection id (the worker's, from its hello)
        self._clients: set[tuple[int, str]] = set()
        self._clean_close = False
        self._had_client = False
        self._exiting = False  # set under _lock once the watchdog decided to exit
        self._idle_since = time.monotonic()
        self._metrics = UploaderMetrics(node_id)
        self._stats: dict[str, Any] = {"jobs_done": 0, "jobs_failed": 0, "jobs_superseded": 0,
                                       "bytes_uploaded": 0, "upload_seconds": 0.0, "last_error": None}
        self._channel = _listen(self)
        threading.Thread(target=self._watch, name="rg-uploader-watch", daemon=True).start()

    # -- client side API --
    def endpoint(self, pid: int, root: bytes | None = None, token: str = "") -> str | None:
        """Register a worker (its process ``pid``; ``token`` tells apart two of one process)
        and return the path of this uploader's socket (None: it has none; hand jobs over by
        actor calls). ``root``: the worker's storage location, pickled, resolved here ahead
        of its first job (an S3 client takes ~0.1 s to build). Raises UploaderExitingError
        when this uploader is exiting."""
        self._add_client(lambda: self._clients.add((pid, token)))
        self._warm(root)
        return self._channel.path if self._channel is not None else None

    def _add_client(self, add: Any) -> None:
        with self._lock:
            if self._exiting:
                raise UploaderExitingError(f"the uploader on node {self.node_id} is exiting (idle with no "
                                           "live client); register with a new one")
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
        if body[0] == "cancel":
            return self.cancel(body[1])
        raise CheckpointError(f"unknown uploader request {body[0]!r}")

    def _on_close(self, peer: Peer) -> None:
        with self._lock:
            self._peers.discard(peer)
            if self._connections.get(peer.conn) is peer:
                del self._connections[peer.conn]
            self._clean_close = peer.said_bye and not (self._peers or self._clients)
        self._idle_since = time.monotonic()

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

    def _accept(self, job: ShardJob, root: bytes, peer: Peer | None) -> None:
        """Accept a job (returns at once, its arena mapped); from here on it no longer
        needs its worker. A waiting job of the same rank is superseded by it. ``peer``: the
        channel connection its events go to (None: the worker asks with actor calls).

        ``root`` is the job's StorageLocation, pickled: building an S3 client from its
        pickle costs ~0.1 s, so it is done once per storage root, not once per save.
        """
        ticket = Ticket(dataclasses.replace(job, root=self._resolve_root(root)))
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
                lane = self._lanes[job.lane] = RankLane(concurrency=self._concurrency, policy=self._policy)
        self._metrics.queued(job.num_bytes, +1)
        try:
            lane.submit(ticket)
        except BaseException as exc:  # the lane did not take it: end it here, or it stays "busy" for ever
            ticket.finish(None, exc)
            raise

    def cancel(self, key: str) -> bool:
        """Supersede job ``key`` when it is still waiting."""
        ticket = self._jobs.get(key)
        lane = self._lanes.get(ticket.job.lane) if ticket is not None else None
        return lane is not None and lane.cancel(key)

    def _after_connection(self, conn: str, timeout_s: float | None) -> bool:
        """Wait until connection ``conn`` (one that broke; "" for none) has had its last
        frame handled; False when that took longer than ``timeout_s``."""
        peer = self._connections.get(conn) if conn else None
        return peer is None or peer.ended.wait(timeout_s)

    def wait_connection(self, conn: str, timeout_s: float) -> bool:
        """Whether connection ``conn``'s frames were all handled within ``timeout_s``."""
        return self._after_connection(conn, timeout_s)

    def wait_released(self, key: str, conn: str = "") -> None:
        """Return once job ``key`` let go of its arena. Unbounded here on purpose: a result
        means "the arena is free", which only the job can say; the worker bounds its own
        wait for it (``_ARENA_WAIT_S``) and raises when it runs out. ``conn``: the broken
        connection the job was sent on; its frames are all handled before this looks."""
        self._after_connection(conn, None)
        ticket = self._jobs.get(key)
        if ticket is None or (conn and ticket.origin != conn):  # over (collected), or not read from that connection
            return
        ticket.released.wait()

    def wait_durable(self, key: str, timeout_s: float, conn: str = "") -> ShardResult:
        """Job ``key``'s result once it is durable (or its error); TimeoutError after
        ``timeout_s``, so that no actor thread waits on a stuck upload for ever (the job
        itself goes on, and may still commit). ``conn``: as for :meth:`wait_released`."""
        deadline = time.monotonic() + timeout_s
        if not self._after_connection(conn, timeout_s):
            raise TimeoutError(f"the uploader on node {self.node_id} had not read a broken connection's "
                               f"last frames after {timeout_s:.0f}s")
        ticket = self._jobs.get(key)
        if ticket is None or (conn and ticket.origin != conn):  # a retry of the key may have come on another
            raise CheckpointError(f"the uploader on node {self.node_id} has no job {key} from that connection: "
                                  "it never read it, or it ended and its outcome went out before the break")
        if not ticket.done.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"step {ticket.job.step} (rank {ticket.job.rank}) was not durable after "
                               f"{timeout_s:.0f}s in the uploader on node {self.node_id}")
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
                "last_error": self._stats["last_error"], "clients": len(self._clients) + len(self._peers),
                "storage_roots": sorted(loc.uri for loc in list(self._roots.values()))}

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
        """Exit once idle with no live client for a while (its run ended or died)."""
        while True:
            time.sleep(1.0)
            if self.busy() or self._live_clients():
                self._idle_since = time.monotonic()
                continue
            if time.monotonic() - self._idle_since > self._idle_grace_s():
                with self._lock:  # decided where register() looks: a worker registering from now on is told
                    if self._clients or self._peers or self._jobs:  # running, or ended and not collected
                        continue
                    self._exiting = True
                logger.info("uploader on node %s: idle with no live client; exiting", self.node_id)
                try:
                    if self._channel is not None:
                        self._channel.close()
                    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                except Exception:  # noqa: BLE001 - keep serving rather than refuse every worker
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
        if self._channel is not None:
            self._channel.close()
        ray.actor.exit_actor()


def _listen(uploader: CheckpointUploader) -> ChannelServer | None:
    """The uploader's socket; None (workers fall back to actor calls) when it cannot listen."""
    try:
        return ChannelServer(uploader.node_id, uploader._on_hello, uploader._on_request,  # noqa: SLF001
                             uploader._on_close)  # noqa: SLF001
    except OSError as exc:
        logger.warning("uploader on node %s has no socket (%s): workers hand it jobs by actor calls, "
                       "a few ms slower per save", uploader.node_id, exc)
        return None


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
        if done.cancelled():
            settle(target, None, CheckpointError("the uploader cancelled this job"))
        elif done.exception() is not None:
            settle(target, None, done.exception())
        else:
            settle(target, done.result(), None)
    source.add_done_callback(_copy)


class ActorBackend:
    """Runs a rank's shard jobs in its node's CheckpointUploader (found or created).

    ``submit`` hands the job over before it returns: a save that returned survives its
    worker being killed right after. The hand-off goes over the uploader's socket
    (``_channel``: one write, 0.4-2.4 ms here, where an actor call took 7-23 ms on a busy
    node), or by actor calls (the actor maps the arena before it answers) when the socket
    cannot be reached. The trainer creates the uploaders before the workers initialize
    their train context (``driver._node_services``), so the first save does not wait for
    the actor to start; without it, a save made before the actor is up waits for it
    (bounded), rather than holding a job that would die with the worker.
    """

    def __init__(self, *, durable_timeout_s: float, root: StorageLocation | None = None) -> None:
        self._actor = None
        self._endpoint = None  # ObjectRef of the socket's path; asking registers this worker
        self._channel: ChannelClient | None = None
        self._by_actor = False  # the socket could not be reached: jobs go by actor calls
        self._attaching: threading.Thread | None = None  # the connection made at start(), off the save path
        self._closing = False  # close() ran: a connection made late is closed by its thread
        self._swap = threading.Lock()  # the channel's hand-over between that thread and close()
        self._token = uuid.uuid4().hex  # tells this backend from others of its process
        # Sent at start: the actor builds the storage client before the first save.
        self._root_blob: bytes | None = pickle.dumps(root) if root is not None else None
        self._durable_timeout_s = durable_timeout_s  # bound of the actor-side wait (by actor calls)

    def start(self) -> None:
        """Find or create this node's uploader, register with it and connect to it in the
        background (it starts, and resolves the storage location, while the worker builds
        its model and restores)."""
        node_id = _services.current_node_id()
        self._attached()
        self._drop_channel()
        self._by_actor = False
        self._actor = _services.get_or_create(_actor_class(), KIND, node_id, node_id=node_id, max_concurrency=64)
        self._endpoint = self._actor.endpoint.remote(os.getpid(), self._root_blob, self._token)
        self._attaching = threading.Thread(target=self._attach_ahead, name="rg-uploader-attach", daemon=True)
        self._attaching.start()

    def _attach_ahead(self) -> None:
        """Connect while the worker builds its model and restores: the first save then
        finds the connection made (~10-20 ms here once the actor is up, seconds before)."""
        try:
            self._attach()
        except Exception as exc:  # noqa: BLE001 - the first save attaches again, and raises
            logger.debug("could not connect to the node uploader ahead of the first save: %s", exc)
        if self._closing:  # close() stopped waiting for this: leave for good
            self._drop_channel(final=True)

    def _attached(self, *, strict: bool = True, timeout_s: float = 2 * _HANDOFF_TIMEOUT_S + 10) -> None:
        """Wait for the connection started at start() (its calls are bounded; so is this).
        ``strict``: raise when it is still going (another attach must not race it)."""
        if self._attaching is None:
            return
        self._attaching.join(timeout_s)
        if self._attaching.is_alive():
            if strict:
                raise CheckpointError(f"connecting to the node uploader took over {2 * _HANDOFF_TIMEOUT_S + 10:.0f}s; "
                                      "check it with 'ray-goodput status'")
            return
        self._attaching = None

    def _get(self, fresh: bool = False) -> Any:
        """The uploader, attached to (a channel, or actor calls); a fresh one when asked."""
        self._attached()
        if self._actor is None or fresh or (self._channel is not None and not self._channel.alive):
            self.start()  # a channel that closed is an uploader that died or exited
            self._attached()
        if self._channel is not None or self._by_actor:
            return self._actor
        try:
            self._attach()  # again: the attempt made ahead failed (it logged why)
        except UploaderExitingError:  # it was idle and is going: its name is free once it is gone
            _wait_gone(self._actor)
            self.start()
            self._attached()
            if self._channel is None and not self._by_actor:
                self._attach()
        return self._actor

    def _attach(self) -> None:
        path = ray.get(self._endpoint, timeout=_HANDOFF_TIMEOUT_S)
        if path is not None:
            try:
                self._channel = ChannelClient(path, (os.getpid(), self._root_blob, self._token),
                                              _HANDOFF_TIMEOUT_S, functools.partial(self._ask_actor, self._actor))
                return
            except OSError as exc:
                logger.warning("cannot reach the node uploader's socket %s (%s); handing jobs over by actor "
                               "calls, a few ms slower per save", path, exc)
        self._by_actor = True

    def _ask_actor(self, actor: Any, conn: str, jobs: list[Handoff]) -> None:
        """The channel ``conn`` to ``actor`` broke before these jobs ended: ask the actor
        when each lets go of its arena and how it ends (a dead actor fails both at once)."""
        for handoff in jobs:
            try:
                if not handoff.released.done():
                    _chain(actor.wait_released.remote(handoff.key, conn).future(), handoff.released)
                _chain(actor.wait_durable.remote(handoff.key, self._durable_timeout_s, conn).future(),
                       handoff.durable)
            except Exception as exc:  # noqa: BLE001 - Ray itself is going: nobody can answer
                # The arena stays held (the uploader, another process, may still write from
                # it): the next save that needs it raises after _ARENA_WAIT_S.
                settle(handoff.durable, None, CheckpointError(f"could not ask the node uploader about "
                                                              f"{handoff.key}: {type(exc).__name__}: {exc}"))

    def _drop_channel(self, final: bool = False) -> None:
        """Close the connection. When its goodbye went unanswered on a final close, wait
        (bounded) until the uploader handled its last frames: the caller unlinks the arenas
        next, and a job not yet read would find its arena gone."""
        with self._swap:
            channel, self._channel = self._channel, None
        if channel is None:
            return
        if channel.close(final=final) or not final:
            return
        try:
            if not ray.get(self._actor.wait_connection.remote(channel.conn, _BYE_WAIT_S), timeout=_BYE_WAIT_S + 5):
                logger.warning("the node uploader had not read this worker's last jobs after %.0fs; "
                               "unlinking their snapshots may fail them", _BYE_WAIT_S)
        except Exception as exc:  # noqa: BLE001 - a dead uploader reads nothing more
            logger.debug("uploader wait_connection failed: %s", exc)

    def submit(self, job: ShardJob) -> Handoff:
        if self._root_blob is None:
            self._root_blob = pickle.dumps(job.root)
        handoff = Handoff(released=Future(), durable=Future(), key=job.key)
        self._hand_over(dataclasses.replace(job, root=None), handoff)
        return handoff

    def _hand_over(self, light: ShardJob, handoff: Handoff) -> None:
        """Hand ``light`` over, once more to a fresh uploader when this one is gone; each
        try has its own events, and only the one that took the job reaches ``handoff``."""
        try:
            try:
                attempt = self._send(self._get(), light)
            except (ray.exceptions.RayActorError, UploaderGoneError):
                # The uploader died (killed, or exiting as idle): a new one takes the job.
                attempt = self._send(self._get(fresh=True), light)
        except Exception as exc:  # noqa: BLE001 - the save fails; wait() raises it on every rank
            failure = CheckpointError(f"could not hand step {light.step} to the node uploader: "
                                      f"{type(exc).__name__}: {exc}; check it with 'ray-goodput status'")
            settle(handoff.released, None, None)
            settle(handoff.durable, None, failure)
            return
        _chain(attempt.released, handoff.released)
        _chain(attempt.durable, handoff.durable)

    def _send(self, actor: Any, light: ShardJob) -> Handoff:
        attempt = Handoff(released=Future(), durable=Future(), key=light.key)
        if self._channel is not None:
            self._channel.submit(light, self._root_blob, attempt)
            return attempt
        ray.get(actor.submit.remote(light, self._root_blob), timeout=_HANDOFF_TIMEOUT_S)
        # Asked only after submit returned: the actor knows the key by then.
        _chain(actor.wait_released.remote(light.key).future(), attempt.released)
        _chain(actor.wait_durable.remote(light.key, self._durable_timeout_s).future(), attempt.durable)
        return attempt

    def cancel(self, key: str) -> bool:
        if self._actor is None:
            return False
        try:
            if self._channel is not None:
                return bool(self._channel.request(("cancel", key), 60))
            return bool(ray.get(self._actor.cancel.remote(key), timeout=60))
        except Exception as exc:  # noqa: BLE001 - a dead uploader runs nothing: its jobs fail
            logger.warning("could not cancel waiting save %s: %s", key, exc)
            return False

    def close(self) -> None:
        """Leave the uploader: a connection says bye (once every job it sent is accepted:
        the caller unlinks the arenas next); a registration is dropped."""
        if self._actor is None:
            return
        self._closing = True
        self._attached(strict=False, timeout_s=_BYE_WAIT_S)
        connected = self._channel is not None
        self._drop_channel(final=True)
        if not connected:
            try:
                ray.get(self._actor.unregister.remote(os.getpid(), self._token), timeout=30)
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
