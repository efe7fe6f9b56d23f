"""The in-process :class:`~ray_goodput.checkpoint.save._handoff.UploadBackend`: shard jobs run in
threads of the worker, one :class:`RankLane` per rank (used without Ray, and in tests)."""

from __future__ import annotations

from concurrent.futures import Future

from ray_goodput.checkpoint.save._handoff import Handoff
from ray_goodput.checkpoint.uploader._rank_queue import RankLane, Ticket
from ray_goodput.checkpoint.uploader._shard_job import ShardJob
from ray_goodput.storage import RetryPolicy


class ThreadBackend:
    """Runs jobs in background threads of this process, one lane per rank.

    The job dies with the worker process; under Ray the node's CheckpointUploader is
    used instead, so that a save survives the worker that made it.
    """

    def __init__(self, *, concurrency: int, policy: RetryPolicy) -> None:
        self._concurrency = concurrency
        self._policy = policy
        self._lanes: dict[tuple[str, int], RankLane] = {}

    def submit(self, job: ShardJob) -> Handoff:
        lane = self._lanes.get(job.lane)
        if lane is None:
            lane = self._lanes[job.lane] = RankLane(concurrency=self._concurrency, policy=self._policy)
        handoff = Handoff(released=Future(), durable=Future(), key=job.key)
        lane.submit(Ticket(job, handoff))
        return handoff

    def close(self) -> None:
        """Called once the Checkpointer waited for its saves (bounded): a job still retrying
        a storage outage gives up at its next round instead of holding the caller for its
        whole retry budget (it would die with this process anyway); the others finish."""
        for lane in self._lanes.values():
            lane.shutdown(wait=True, stop=True)
