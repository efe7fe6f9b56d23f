"""Where a rank's shard job runs: an :class:`UploadBackend`.

:class:`ThreadBackend` (here) runs it in a thread of the worker; ``ActorBackend``
(``_actor_backend``) hands it to the node's CheckpointUploader actor (``_uploader``).
Both queue a rank's jobs in a :class:`~ray_goodput.checkpoint._lane.RankLane` (one
running, one waiting)."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from ray_goodput.checkpoint._job import ShardJob, ShardResult
from ray_goodput.checkpoint._lane import RankLane, Ticket
from ray_goodput.storage import RetryPolicy

logger = logging.getLogger(__name__)


@dataclass
class Handoff:
    """A submitted job: ``released`` once its arena may be reused, ``durable`` once it
    ended (its ShardResult says uploaded, committed or superseded; a failure raises)."""

    released: Future[None]
    durable: Future[ShardResult]
    key: str = ""


class UploadBackend(Protocol):
    def submit(self, job: ShardJob) -> Handoff:
        """Hand ``job`` over so that it survives this process (in the uploader, or in a
        queue the uploader reads even after this process died); never waits for uploads.
        The caller keeps the arena until ``released``, and unlinks it only after ``close``."""

    def cancel(self, key: str) -> bool:
        """Supersede job ``key`` if it is still waiting; False when it started or ended."""

    def close(self) -> None: ...


def futures_of(ticket: Ticket) -> Handoff:
    """A Handoff completed by ``ticket``'s events (in this process)."""
    released: Future[None] = Future()
    durable: Future[ShardResult] = Future()

    def _released(_: Ticket) -> None:
        if not released.done():
            released.set_result(None)

    def _done(t: Ticket) -> None:
        if t.error is not None:
            durable.set_exception(t.error)
        else:
            durable.set_result(t.result)

    ticket.release_callbacks.append(_released)
    ticket.callbacks.append(_done)
    return Handoff(released=released, durable=durable, key=ticket.job.key)


class ThreadBackend:
    """Runs jobs in background threads of this process, one lane per rank.

    The job dies with the worker process; under Ray the node's CheckpointUploader is
    used instead, so that a save survives the worker that made it.
    """

    def __init__(self, *, concurrency: int, policy: RetryPolicy) -> None:
        self._concurrency = concurrency
        self._policy = policy
        self._lanes: dict[tuple[str, int], RankLane] = {}

    def _lane(self, job: ShardJob) -> RankLane:
        lane = self._lanes.get(job.lane)
        if lane is None:
            lane = self._lanes[job.lane] = RankLane(concurrency=self._concurrency, policy=self._policy)
        return lane

    def submit(self, job: ShardJob) -> Handoff:
        ticket = Ticket(job)
        handoff = futures_of(ticket)
        self._lane(job).submit(ticket)
        return handoff

    def cancel(self, key: str) -> bool:
        return any(lane.cancel(key) for lane in self._lanes.values())

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.shutdown(wait=True)
