"""ActorBackend: a worker's side of its node's CheckpointUploader (``_actor``).

It finds or creates the node's uploader, registers with it and connects to its socket
(``_channel``) in the background; ``submit`` hands a job over before it returns, so a save
that returned survives its worker. While that first connection is still being made, or
its socket has no room for the job, a save does not wait for it: the job is written to
the node's held jobs (``_held``), which the uploader takes from if the worker dies first,
and a thread hands it over, in order, once the uploader answers. When the connection
breaks or the uploader exits, it asks the actor about the jobs in flight and hands new
ones to a fresh uploader.
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

from ray_goodput._lazy import LazyModule
from ray_goodput.checkpoint.save._arena_files import claim, mark_held, unmark_held
from ray_goodput.checkpoint.save._handoff import Handoff
from ray_goodput.checkpoint.uploader import _held
from ray_goodput.checkpoint.uploader._actor import KIND, _actor_class
from ray_goodput.checkpoint.uploader._channel import ChannelClient, UploaderExitingError, UploaderGoneError, settle
from ray_goodput.checkpoint.uploader._shard_job import ShardJob
from ray_goodput.errors import CheckpointError
from ray_goodput.runtime import _services
from ray_goodput.storage import StorageLocation

ray = LazyModule("ray")  # a process that saves through the thread backend never imports it
logger = logging.getLogger(__name__)

# Bound on handing one job to the uploader (its start included).
_HANDOFF_TIMEOUT_S = 120.0
# Bound on waiting for an uploader that said it is exiting to be gone.
_EXIT_WAIT_S = 30.0
# Bound on a closing worker's wait for the uploader to read its last jobs, when the
# goodbye got no answer.
_BYE_WAIT_S = 30.0

__all__ = ["ActorBackend"]


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
    (``_channel``: one write, an order of magnitude cheaper than an actor call on a busy
    node), or by actor calls (the actor maps the arena before it answers) when the socket
    cannot be reached. The trainer creates the uploaders as the training function starts
    (``driver._node_services``), so the connection is usually made before the first save.
    A save made while it is still being made (the uploader starting on a loaded node) does
    not wait for it: its job is written to a file of the node (``_held``) and handed over by
    a thread (``_hand_over_held``) once the uploader answers, before any later job; the
    snapshot stays in its arena until then, and an uploader takes the file's job itself
    when the worker died first. So does a save whose frame the socket has no room for
    (the uploader not reading, or a frame larger than the send buffer): writing it would
    wait for the uploader; and every save handed over by actor calls.
    """

    def __init__(self, *, durable_timeout_s: float, root: StorageLocation | None = None) -> None:
        self._actor = None
        self._node_id = ""  # where its uploader runs, from start()
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
        # Jobs saved while the connection was being made, and the thread handing them over.
        self._held: list[tuple[ShardJob, Handoff, Path | None]] = []  # with its file
        self._holding: threading.Thread | None = None
        self._held_lock = threading.Lock()

    def start(self) -> None:
        """Find or create this node's uploader, register with it and connect to it in the
        background (it starts, and resolves the storage location, while the worker builds
        its model and restores)."""
        node_id = self._node_id = _services.current_node_id()
        self._attached()
        self._drop_channel()
        self._by_actor = False
        self._actor = _services.get_or_create(_actor_class(), KIND, node_id, node_id=node_id, max_concurrency=64)
        self._endpoint = self._actor.endpoint.remote(os.getpid(), self._root_blob, self._token)
        self._attaching = threading.Thread(target=self._attach_ahead, name="rg-uploader-attach", daemon=True)
        self._attaching.start()

    def _attach_ahead(self) -> None:
        """Connect while the worker builds its model and restores: the first save then
        finds the connection made (connecting costs milliseconds once the actor is up,
        seconds before)."""
        try:
            self._attach()
        except Exception as exc:  # noqa: BLE001 - the first save attaches again, and raises
            logger.debug("could not connect to the node uploader ahead of the first save: %s", exc)
        if self._closing:  # close() stopped waiting for this: leave for good
            self._drop_channel(final=True)

    def _attached(self, *, strict: bool = True, timeout_s: float = 2 * _HANDOFF_TIMEOUT_S + 10) -> None:
        """Wait for the connection started at start() (its calls are bounded; so is this).
        ``strict``: raise when it is still going (another attach must not race it)."""
        attaching = self._attaching  # read once: the held jobs' thread may wait here too
        if attaching is None:
            return
        attaching.join(timeout_s)
        if attaching.is_alive():
            if strict:
                raise CheckpointError(
                    f"connecting to the node uploader took over {timeout_s:.0f}s; check it with 'ray-goodput status'"
                )
            return
        if self._attaching is attaching:
            self._attaching = None

    def _get(self, fresh: bool = False) -> Any:
        """The uploader, attached to (a channel, or actor calls); a fresh one when asked.
        Raises CheckpointError once close() ran (it gave up waiting for the held jobs)."""
        if self._closing:
            raise CheckpointError("the Checkpointer closed before this save was handed to the node uploader")
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
                self._channel = ChannelClient(
                    path,
                    (os.getpid(), self._root_blob, self._token),
                    _HANDOFF_TIMEOUT_S,
                    functools.partial(self._ask_actor, self._actor),
                )
                return
            except OSError as exc:
                logger.warning(
                    "cannot reach the node uploader's socket %s (%s); handing jobs over by actor "
                    "calls, a few ms slower per save",
                    path,
                    exc,
                )
        self._by_actor = True

    def _ask_actor(self, actor: Any, conn: str, jobs: list[Handoff]) -> None:
        """The channel ``conn`` to ``actor`` broke before these jobs ended: ask the actor
        when each lets go of its arena and how it ends (a dead actor fails both at once)."""
        for handoff in jobs:
            try:
                if not handoff.released.done():
                    _chain(actor.wait_released.remote(handoff.key, conn).future(), handoff.released)
                _chain(actor.wait_durable.remote(handoff.key, self._durable_timeout_s, conn).future(), handoff.durable)
            except Exception as exc:  # noqa: BLE001 - Ray itself is going: nobody can answer
                # The arena stays held (the uploader, another process, may still write from
                # it): the next save that needs it raises after _ARENA_WAIT_S.
                settle(
                    handoff.durable,
                    None,
                    CheckpointError(
                        f"could not ask the node uploader about {handoff.key}: {type(exc).__name__}: {exc}"
                    ),
                )

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
                logger.warning(
                    "the node uploader had not read this worker's last jobs after %.0fs; "
                    "unlinking their snapshots may fail them",
                    _BYE_WAIT_S,
                )
        except Exception as exc:  # noqa: BLE001 - a dead uploader reads nothing more
            logger.debug("uploader wait_connection failed: %s", exc)

    def submit(self, job: ShardJob) -> Handoff:
        if self._root_blob is None:
            self._root_blob = pickle.dumps(job.root)
        handoff = Handoff(released=Future(), durable=Future(), key=job.key)
        light = dataclasses.replace(job, root=None)
        with self._held_lock:
            attaching = self._attaching
            connecting = attaching is not None and attaching.is_alive()
            # Held jobs go first, in order. So is every job without a live connection: the
            # actor call that hands it over, or the reconnect, waits for the uploader.
            channel = self._channel
            disconnected = self._by_actor or channel is None or not channel.alive
            if connecting or self._holding is not None or disconnected:
                self._hold_job(light, handoff)
                return handoff
        if not self._hand_over(light, handoff, now=True):
            # The socket has no room for the frame (the uploader is not reading, or the frame
            # is larger than the whole send buffer), or the uploader has just gone. Sending
            # or reconnecting would wait for it; the job is held instead.
            logger.debug("step %d's job waits in a file: no room in the uploader's socket, or it went", light.step)
            with self._held_lock:
                self._hold_job(light, handoff)
        return handoff

    def _hold_job(self, light: ShardJob, handoff: Handoff) -> None:
        """Keep ``light`` in a file of the node and queue it for the held jobs' thread (the
        caller holds ``_held_lock``)."""
        self._held.append((light, handoff, self._hold(light)))
        if self._holding is None:
            self._holding = threading.Thread(target=self._hand_over_held, name="rg-uploader-held", daemon=True)
            self._holding.start()

    def _hand_over_held(self) -> None:
        """Hand the held jobs over, oldest first, until none is left; ``submit`` holds every
        job while this runs, so none overtakes another."""
        while True:
            with self._held_lock:
                if not self._held:
                    self._holding = None
                    return
                batch, self._held = self._held, []
            for light, handoff, path in batch:
                try:
                    self._hand_over(light, handoff, in_file=path is not None)  # bounded; failures settle the job
                except Exception as exc:  # this job fails; the thread goes on with the next
                    logger.exception("handing step %d's held job to the node uploader failed", light.step)
                    settle(handoff.durable, None, CheckpointError(f"could not hand step {light.step} over: {exc}"))
                if path is not None:  # handed over, or failed for this worker: nobody else takes it
                    path.unlink(missing_ok=True)  # the arena's mark goes with the job's release (_send)

    def _hold(self, light: ShardJob) -> Path | None:
        """The job written where the node's uploader finds it if this worker dies first."""
        try:
            return _held.hold(self._node_id, light, self._root_blob)
        except OSError as exc:
            logger.warning(
                "could not keep step %d's job where the node uploader finds it (%s): it is lost if "
                "this worker dies before the uploader answers",
                light.step,
                exc,
            )
            return None

    def _hand_over(self, light: ShardJob, handoff: Handoff, *, now: bool = False, in_file: bool = False) -> bool:
        """Hand ``light`` over, once more to a fresh uploader when this one is gone; each
        try has its own events, and only the one that took the job reaches ``handoff``.
        ``now``: only over the live connection, and only when its socket has room for the
        job (else returns False, the job to be held); a failure settles ``handoff``.
        ``in_file``: the job is also in a file of the node (see :meth:`_send`)."""
        try:
            if now:  # save()'s own try: the live connection or nothing, never a reconnect
                try:
                    attempt = self._send(self._actor, light, now=True)
                except (ray.exceptions.RayActorError, UploaderGoneError):
                    return False  # the uploader just went: the held jobs' thread makes the fresh try
            else:
                try:
                    attempt = self._send(self._get(), light, in_file=in_file)
                except (ray.exceptions.RayActorError, UploaderGoneError):
                    # The uploader died (killed, or exiting as idle): a new one takes the job.
                    attempt = self._send(self._get(fresh=True), light, in_file=in_file)
        except Exception as exc:  # noqa: BLE001 - the save fails; wait() raises it on every rank
            failure = CheckpointError(
                f"could not hand step {light.step} to the node uploader: "
                f"{type(exc).__name__}: {exc}; check it with 'ray-goodput status'"
            )
            self._take_back(light, handoff)
            _unmark(light)  # no uploader maps it for this try (a late one keeps it mapped)
            settle(handoff.durable, None, failure)
            return True
        if attempt is None:
            return False
        _chain(attempt.released, handoff.released)
        _chain(attempt.durable, handoff.durable)
        return True

    def _take_back(self, light: ShardJob, handoff: Handoff) -> None:
        """A hand-off that failed: the arena goes back to the worker only once its snapshot
        is claimed, as a supersede claims it. A call that timed out can still run later in
        the uploader, which then finds the claim and ends the job unread; without it, it
        would read whatever the worker copied there since and commit it under this step.
        When the uploader claimed it first (it began the job after all), the arena is
        released when that job lets go of it. When the claim cannot be made (an error of the
        arena's file system), the arena is never released: a late call could still read it.
        """
        try:
            claimed = not light.slots or claim(light.arena_path, light.key)
        except OSError as exc:
            logger.warning(
                "could not claim step %d's snapshot back after its hand-off failed (%s): its arena is not reused",
                light.step,
                exc,
            )
            return
        if claimed:
            settle(handoff.released, None, None)
            return
        logger.warning(
            "step %d's job reached the node uploader after its hand-off failed: the uploader writes it, and its "
            "arena is reused once that job lets go of it",
            light.step,
        )
        actor = self._actor
        if actor is None:
            return  # released by nobody: the arena pair's bounded wait raises if it needs it
        try:
            _chain(actor.wait_released.remote(light.key).future(), handoff.released)
        except Exception as exc:  # noqa: BLE001 - the pair's bounded wait raises if it needs it
            logger.warning("cannot learn when step %d's job lets go of its arena: %s", light.step, exc)

    def _send(self, actor: Any, light: ShardJob, *, now: bool = False, in_file: bool = False) -> Handoff | None:
        """One try of the hand-off; None when ``now`` and there is no live connection or
        its socket has no room for the job.

        A job written to the socket waits there until the uploader reads it, seconds or
        more when it is starved; this worker may be killed meanwhile. Its arena is marked
        first (``_arena_files.mark_held``), naming that uploader, so that the sweeps of dead
        workers' arenas keep it while the uploader lives; the uploader removes the mark
        once it mapped the arena (``_accept``), and this worker once the arena was
        released. ``in_file``: the job is also in a file of the node, whose mark (naming
        no uploader: any may take the file) stays as it is."""
        if self._closing:
            raise CheckpointError("the Checkpointer closed before this save was handed to the node uploader")
        attempt = Handoff(released=Future(), durable=Future(), key=light.key)
        channel = self._channel
        if now and (channel is None or not channel.alive):
            return None
        if channel is not None:
            if light.slots:
                if not in_file:
                    try:
                        mark_held(light.arena_path, light.key, reader=channel.peer_pid)
                    except OSError as exc:  # the save goes on, unprotected from a sweep if this worker dies
                        logger.warning("could not mark step %d's arena as awaited: %s", light.step, exc)
                # Released without an error: the uploader mapped the arena and let go of it,
                # or never will (refused). An error (the actor could not be asked) says
                # nothing of an unread frame: the mark stays, for as long as its uploader lives.
                attempt.released.add_done_callback(lambda f: f.exception() is None and _unmark(light))
            return attempt if channel.submit(light, self._root_blob, attempt, now=now) else None
        ray.get(actor.submit.remote(light, self._root_blob), timeout=_HANDOFF_TIMEOUT_S)
        # Asked only after submit returned: the actor knows the key by then.
        _chain(actor.wait_released.remote(light.key).future(), attempt.released)
        _chain(actor.wait_durable.remote(light.key, self._durable_timeout_s).future(), attempt.durable)
        return attempt

    def close(self) -> None:
        """Leave the uploader: a connection says bye (once every job it sent is accepted:
        the caller unlinks the arenas next); a registration is dropped."""
        if self._actor is None:
            return
        holding = self._holding
        if holding is not None:  # jobs held at the first connection: handed over first
            holding.join(2 * _HANDOFF_TIMEOUT_S + 10)
            if holding.is_alive():
                logger.warning("jobs saved before the node uploader answered were not handed over; leaving it")
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


def _unmark(light: ShardJob) -> None:
    """Remove the mark that keeps ``light``'s arena from the sweeps (``_send``)."""
    if not light.slots:
        return
    try:
        unmark_held(light.arena_path, light.key)
    except OSError as exc:  # left: it expires with its uploader, or after an hour
        logger.debug("could not remove the mark of step %d's arena: %s", light.step, exc)


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
    raise CheckpointError(
        f"the node uploader said it was exiting but was still up after {_EXIT_WAIT_S:.0f}s; "
        "check it with 'ray-goodput status'"
    )
