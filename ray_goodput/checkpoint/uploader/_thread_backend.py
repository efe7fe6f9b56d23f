"""The in-process :class:`~ray_goodput.checkpoint.save._handoff.UploadBackend`: shard jobs run in
threads of the worker, one :class:`RankLane` per rank (used without Ray, and in tests)."""

from __future__ import annotations

from concurrent.futures import Future

from ray_goodput.checkpoint.save._handoff import Handoff
from ray_goodput.checkpoint.uploader._rank_queue import RankLane, Ticket
from ray_goodput.checkpoint.uploader._shard_job import ShardJob, ShardResult
from ray_goodput.storage import RetryPolicy


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

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.shutdown(wait=True)
