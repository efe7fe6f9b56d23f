"""The hand-off: what a rank's save gives up to an :class:`UploadBackend`, and what it gets back.

Two backends implement it in ``checkpoint.uploader``: ``ThreadBackend`` runs the shard job in
a thread of the worker; ``ActorBackend`` hands it to the node's ``CheckpointUploader`` actor.
Both queue a rank's jobs in a ``RankLane`` (one running, one waiting). Superseding a
waiting job is not asked of the backend: the worker claims the job's snapshot
(``_arena_files.claim``), and the lane finds the job superseded when it comes to start it."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the uploader's types, named here for the annotations only
    from ray_goodput.checkpoint.uploader._shard_job import ShardJob, ShardResult


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

    def close(self) -> None: ...
