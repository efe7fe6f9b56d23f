"""One rank's shard of one step, from snapshot to durable: the work of the node uploader.

The same function runs in the node's CheckpointUploader actor (the default under Ray)
or in a thread of the worker (plain torch.distributed), so both commit identically.
It advances the job's :class:`SaveRecord` (staged, uploaded, committed) as it goes.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from ray_goodput._faults import fault_point
from ray_goodput.checkpoint.protocol import _catalog, _layout, _lineage, _retention
from ray_goodput.checkpoint.protocol._commit import COMMITTED, OUTRANKED, CommitProtocol
from ray_goodput.checkpoint.protocol._dcp_parts import data_file, write_part, write_staged, writing_path
from ray_goodput.checkpoint.protocol._shard_plan import Leaf
from ray_goodput.checkpoint.save._arena import TensorSlot, open_slots
from ray_goodput.checkpoint.save._save_state import SaveRecord, SaveState
from ray_goodput.checkpoint.uploader import _direct_upload
from ray_goodput.checkpoint.uploader._direct_upload import StagingFullError, out_of_space
from ray_goodput.checkpoint.uploader._follow_upload import FollowUpload
from ray_goodput.errors import CheckpointError, FencedError, StorageError
from ray_goodput.storage import (
    DEFAULT_ALGORITHM,
    FileEntry,
    RetryPolicy,
    StorageLocation,
    Written,
    is_outage,
    upload_files,
)

logger = logging.getLogger(__name__)
_ONE_TRY = RetryPolicy(attempts=1)  # a fenced run's lookup of its fencer's name: only a name is at stake

#: Bound on the follower's end once the write is done: the rest of one file's upload.
_FOLLOW_END_S = 3600.0
#: Bound on a follower letting go once the write failed (it deletes what it sent).
_FOLLOW_STOP_S = 60.0
#: Longest pause between two rounds of an upload retried through an outage.
_OUTAGE_PAUSE_MAX_S = 5.0


@dataclass(frozen=True)
class ShardJob:
    """Everything needed to make one rank's shard of one step durable. Picklable."""

    root: StorageLocation
    step: int
    rank: int
    world_size: int
    arena_path: str
    slots: tuple[TensorSlot, ...]
    objects: dict[str, bytes]  # non-tensor leaves this rank writes, pickled
    leaves: dict[str, Leaf]  # this rank's written leaves (shard offsets)
    mappings: dict[str, Any]  # DCP flatten mapping of the whole state dict
    rng: bytes
    local_dir: str  # node-local staging directory of this step
    keep_last: int
    owner_pid: int
    save_id: str  # the save id (``_layout.save_id``), shared by its ranks
    num_bytes: int = field(default=0)
    generation: int = 0
    # Upload settings travel with the job: a node uploader started before any Checkpointer
    # existed (by the trainer) has none of its own.
    concurrency: int = 8
    retry: RetryPolicy | None = None
    unstepped: tuple[str, ...] = ()  # this rank's optimizers saved before their first step
    stepped: tuple[str, ...] = ()  # ... and those saved after it
    #: How long (seconds from the job's start) its uploads keep retrying a storage outage
    #: past the retry policy, while no newer save of its rank waits: the Checkpointer's
    #: bound on the recovery point's age (0: the policy alone).
    retry_for_s: float = 0.0
    #: The worker process's hand-off order (one counter for all its Checkpointers): a job
    #: that reaches the rank's lane after a later one of its worker is stale (0: unknown).
    seq: int = 0
    #: The job's name in its uploader (set from the fields above).
    key: str = field(init=False)
    #: Jobs of one rank of one run share a lane (one running, at most one waiting).
    lane: tuple[str, int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.local_dir}#{self.rank}#{self.save_id}")
        object.__setattr__(self, "lane", (self.local_dir.rsplit("/", 1)[0], self.rank))

    @property
    def staged_bytes(self) -> int:
        """About what the shard takes on the staging disk: its arena tensors and its pickled values."""
        return self.num_bytes + sum(len(raw) for raw in self.objects.values())

    def commit_protocol(self) -> CommitProtocol:
        return CommitProtocol(
            _catalog.step_location(self.root, self.step), self.step, self.world_size, self.save_id, self.generation
        )


@dataclass(frozen=True)
class ShardResult:
    """How one rank's job ended: ``state`` is uploaded (durable, another rank commits),
    committed (this job wrote COMMITTED) or superseded (dropped for a newer save)."""

    step: int
    rank: int
    num_bytes: int
    write_seconds: float
    upload_seconds: float
    state: SaveState = SaveState.UPLOADED
    #: ``time.time()`` when this job's ``COMMITTED`` write returned: the save was durable
    #: from then on (None unless this job wrote the commit).
    committed_at: float | None = None

    @property
    def committed(self) -> bool:
        return self.state is SaveState.COMMITTED

    @staticmethod
    def superseded(job: ShardJob) -> ShardResult:
        return ShardResult(
            step=job.step, rank=job.rank, num_bytes=0, write_seconds=0.0, upload_seconds=0.0, state=SaveState.SUPERSEDED
        )


def _same_file_system(staging: Path, root: StorageLocation) -> bool:
    """Whether storage takes staged files as hard links (local storage on the staging
    dir's file system, judged by its nearest existing directory)."""
    if not root.is_local:
        return False
    target = Path(root.root)
    while not target.exists() and target != target.parent:
        target = target.parent
    try:
        return os.stat(target).st_dev == os.stat(staging).st_dev
    except OSError:
        return False


def _leaves(job: ShardJob, tensors: dict[str, Any]) -> dict[str, Any]:
    """The rank's leaves to write: the snapshot's tensors and its unpickled plain values."""
    flat: dict[str, Any] = dict(tensors)
    flat.update({fqn: pickle.loads(raw) for fqn, raw in job.objects.items()})  # noqa: S301 - this rank's own snapshot
    return flat


def write_local(
    job: ShardJob, tensors: dict[str, Any] | None = None, written: dict[str, Written] | None = None
) -> list[str]:
    """DCP-write the snapshot (``tensors``: over the arena's bytes, mapped when the job was
    accepted; mapped here when None) into the staging dir; after this the arena may be reused.
    ``written``: see ``write_part`` (on local storage the staged data file becomes the
    stored one, so its write to disk starts while it is written)."""
    out = Path(job.local_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = open_slots(job.arena_path, list(job.slots)) if job.slots else {}
    flat = _leaves(job, tensors)
    try:
        linked = _same_file_system(out, job.root)  # else the upload reads the file anyway
        names = write_part(
            flat,
            job.leaves,
            job.mappings,
            job.rank,
            job.save_id,
            out,
            written=written if linked else None,
            writeback=linked,
        )
    except (Exception, CheckpointException) as exc:
        free = shutil.disk_usage(out).free
        # torch's zip writer can turn ENOSPC into "unexpected pos": go by free space too.
        if out_of_space(exc) or free < job.staged_bytes * 1.1:
            raise StagingFullError(
                f"staging dir {out} is out of space ({free} bytes free, the shard needs "
                f"~{job.staged_bytes}): set Checkpointer(staging_dir=...) or "
                f"RAY_GOODPUT_STAGING_DIR to a larger local disk (No space left on device)"
            ) from exc
        raise
    fault_point("upload.staging_write")
    extras = out / _layout.extras_file(job.rank, job.save_id)
    extras.parent.mkdir(parents=True, exist_ok=True)
    write_staged(extras, job.rng)
    return [*names, _layout.extras_file(job.rank, job.save_id)]


def upload_and_commit(
    job: ShardJob,
    names: list[str],
    *,
    concurrency: int,
    policy: RetryPolicy,
    uploaded: Sequence[FileEntry] = (),
    written: Mapping[str, Written] | None = None,
) -> tuple[int, SaveState, float | None]:
    """Upload, declare durable, try to commit (and apply retention when this job committed).

    ``uploaded``: files of ``names`` already in storage (sent while they were written).
    ``written``: checksums of staged files computed as they were written (a hard-linked
    upload then does not read them back).
    Returns the bytes uploaded, ``uploaded`` or ``committed``, and when this job's commit
    landed (``Finalized.committed_at``). An upload that fails
    after retries raises; then no marker is written, the step can never commit, and the
    previous committed checkpoint stays the recovery point.
    """
    protocol = job.commit_protocol()
    entries = _upload_staged(
        job, names, protocol.step_loc, uploaded=uploaded, written=written, concurrency=concurrency, policy=policy
    )
    marker = protocol.declare_durable(
        job.rank, entries, created=time.time(), unstepped=job.unstepped, stepped=job.stepped
    )
    done = protocol.finalize(Path(job.local_dir), own=marker)
    if done.state == OUTRANKED:
        logger.warning(
            "step %d: a save of the same or a newer generation (%s) holds it; this save "
            "(generation %d) stays uncommitted",
            job.step,
            done.manifest.generation if done.manifest else "?",
            job.generation,
        )
    if done.committed_at is not None:  # this job wrote the commit (one job per save)
        try:
            _retention.apply_retention(job.root, job.keep_last, generation=job.generation)
        except Exception as exc:  # noqa: BLE001 - the save is committed; retention retries next time
            logger.warning("retention after step %d failed: %s", job.step, exc)
    if job.rank == 0:
        check_fence(job)
    state = SaveState.COMMITTED if done.state == COMMITTED else SaveState.UPLOADED
    return sum(e.size for e in entries), state, done.committed_at


def _upload_staged(
    job: ShardJob,
    names: list[str],
    step_loc: StorageLocation,
    *,
    uploaded: Sequence[FileEntry],
    written: Mapping[str, Written] | None,
    concurrency: int,
    policy: RetryPolicy,
) -> list[FileEntry]:
    """Upload the staged files ``names`` but those ``uploaded`` already; returns every
    one's entry (``uploaded``'s first)."""
    sent = {e.name for e in uploaded}
    files = [(Path(job.local_dir) / n, n) for n in names if n not in sent]
    # Staged files are never written again (a node-local copy is replaced, not rewritten),
    # so storage on the staging dir's file system takes them as hard links: one write.
    # The data file first (on object storage the follower sent it while it was written),
    # so a fault between it and the small files (metadata part, extras, side by side) is
    # "mid-upload".
    data = data_file(job.rank, job.save_id)
    entries = list(uploaded) + upload_files(
        [f for f in files if f[1] == data],
        step_loc,
        concurrency=concurrency,
        policy=policy,
        algorithm=DEFAULT_ALGORITHM,
        link=True,
        known=written,
    )
    fault_point("upload.mid_upload")
    entries += upload_files(
        [f for f in files if f[1] != data],
        step_loc,
        concurrency=concurrency,
        policy=policy,
        algorithm=DEFAULT_ALGORITHM,
        link=True,
        known=written,
    )
    return entries


def check_fence(job: ShardJob) -> None:
    """Record that ``job``'s generation saves here, then raise FencedError when a newer run
    that saves too claimed ``job``'s storage root (after the save's own files and commit:
    neither run's commits are touched). A newer claim that never saved (a Checkpointer
    that only restores, an attempt not yet at its first save) fences nobody, and hides no
    saving run below it."""
    try:
        _lineage.mark_saving(job.root, job.generation)
        newer = _lineage.newest_saving(job.root)
        if newer is None or newer <= job.generation:
            return
    except OSError as exc:  # the next save checks again
        logger.warning("step %d: could not check the generation claim under %s: %s", job.step, job.root.uri, exc)
        return
    try:  # fenced: only its owner's name is left to read
        claim = _lineage.read_claim(job.root, _ONE_TRY, generation=newer) or _lineage.Claim(generation=newer)
    except OSError as exc:
        logger.warning("could not read who claimed generation %d under %s: %s", newer, job.root.uri, exc)
        claim = _lineage.Claim(generation=newer)
    raise FencedError(
        f"the storage path {job.root.uri} was taken by a newer run: generation {claim.generation} "
        f"claimed by {claim.describe()}, after this run's generation {job.generation}. This run stops "
        "saving there (its committed checkpoints and the other run's are left as they are). If that "
        "run is a leftover (a zombie of a dead attempt, a job started twice), stop it and restart this "
        "one; to run both, give each its own storage_path"
    )


def _nothing_sent() -> Sequence[FileEntry]:
    """What an upload round sent before :func:`upload_and_commit` (from the staging dir:
    nothing; it uploads every file)."""
    return ()


def _upload_through_outages(
    job: ShardJob,
    names: list[str],
    *,
    started: float,
    newer: Callable[[], bool],
    concurrency: int,
    policy: RetryPolicy,
    uploaded: Sequence[FileEntry] | None,
    written: Mapping[str, Written],
    resend: Callable[[], Sequence[FileEntry]] = _nothing_sent,
) -> tuple[int, SaveState, float | None] | None:
    """:func:`upload_and_commit`, retried while storage is out (``storage.is_outage``) until
    ``job.retry_for_s`` from ``started`` or a newer save of the rank waits (then None: this
    save is superseded, the newer one goes next). ``uploaded``: files already sent (None:
    ask ``resend``, as each later round does: what it sent itself, nothing by default)."""
    rounds = 0
    while True:
        try:
            if uploaded is None:
                uploaded = resend()
            return upload_and_commit(
                job, names, concurrency=concurrency, policy=policy, uploaded=uploaded, written=written
            )
        except StorageError as exc:
            left = started + job.retry_for_s - time.monotonic()
            if not is_outage(exc) or left <= 0:
                raise
            if newer():
                logger.warning("step %d rank %d: storage is out (%s); a newer save goes next", job.step, job.rank, exc)
                return None
            rounds += 1
            pause = min(_OUTAGE_PAUSE_MAX_S, policy.initial_delay * 2**rounds, left)
            logger.warning(
                "step %d rank %d: storage is out (%s); retrying in %.1f s (for %.0f s more, or until a newer "
                "save waits)",
                job.step,
                job.rank,
                exc,
                pause,
                left,
            )
            end = time.monotonic() + pause
            while time.monotonic() < end and not newer():
                time.sleep(min(0.2, max(0.0, end - time.monotonic())))
            uploaded = None  # sent again: a file may have gone with the outage


def _follow_data_file(job: ShardJob) -> FollowUpload | None:
    """On object storage, upload the rank's data file while DCP writes it (``_follow_upload``)."""
    if job.root.is_local:
        return None  # hard links: nothing to overlap
    out = Path(job.local_dir)
    name = data_file(job.rank, job.save_id)
    return FollowUpload(
        writing_path(out, job.rank, job.save_id),
        out / name,
        _catalog.step_location(job.root, job.step),
        name,
        DEFAULT_ALGORITHM,
        size_hint=job.num_bytes,
    )


def _followed(job: ShardJob, follow: FollowUpload | None) -> list[FileEntry]:
    """The data file's entry when the follower uploaded it (else it is uploaded as usual)."""
    if follow is None:
        return []
    follow.writer_done(ok=True)
    entry = follow.result(Path(job.local_dir) / follow.name, timeout_s=_FOLLOW_END_S, stop_s=_FOLLOW_STOP_S)
    if entry is None:
        return []
    logger.debug("step %d rank %d: %s uploaded while it was written", job.step, job.rank, entry.name)
    return [entry]


def run_shard_job(
    job: ShardJob,
    record: SaveRecord,
    tensors: dict[str, Any],
    *,
    concurrency: int,
    policy: RetryPolicy,
    on_released: Callable[[], None] = lambda: None,
    newer: Callable[[], bool] = lambda: False,
) -> ShardResult:
    """Write locally, release the arena (``on_released``), upload, commit; ``record``
    advances staged -> uploaded (-> committed). Raises on failure (the caller marks it).
    With the staging dir full, the data file goes to storage straight from the arena
    (``_direct_upload``), which is released only when the job ends.
    ``newer``: whether a newer save of the rank waits (an upload retried through a storage
    outage then gives way: the result is ``superseded``)."""
    start = time.monotonic()
    follow = _follow_data_file(job)
    memory: Path | None = None  # the shard's small files' dir when staging was full
    resend = _nothing_sent
    try:
        sums: dict[str, Written] = {}
        try:
            names = write_local(job, tensors, sums)
        except StagingFullError as full:
            _stop_following(job, follow, full)
            follow = None
            sums.clear()
            job, names = _direct_upload.prepare(job, full)
            memory = Path(job.local_dir).parent
            resend = _direct_upload.sender(job, _leaves(job, tensors), policy, full)
        written = time.monotonic()
        record.advance(SaveState.STAGED)
        uploaded: Sequence[FileEntry] | None = None
        if memory is None:  # else the arena stays held: each upload round writes from it
            on_released()
            uploaded = _followed(job, follow)
    except BaseException:
        if follow is not None:  # before the failure is reported: the next save needs the disk
            follow.abandon(timeout_s=_FOLLOW_STOP_S)
        if memory is not None:
            _direct_upload.remove(memory)
        raise
    try:
        done = _upload_through_outages(
            job,
            names,
            started=start,
            newer=newer,
            concurrency=concurrency,
            policy=policy,
            uploaded=uploaded,
            written=sums,
            resend=resend,
        )
    finally:
        if memory is not None:  # no node-local copy of a shard sent from its snapshot
            _direct_upload.remove(memory)
    return _result(job, record, done, write_seconds=written - start, upload_seconds=time.monotonic() - written)


def _stop_following(job: ShardJob, follow: FollowUpload | None, full: StagingFullError) -> None:
    """The staging dir is full (``full``) and the shard goes to storage from its snapshot
    instead: the upload that followed the cut-short write must stop first (it sends to
    the same object). Raises CheckpointError when it did not stop in time."""
    if follow is not None and not follow.abandon(timeout_s=_FOLLOW_STOP_S):
        raise CheckpointError(
            f"step {job.step} rank {job.rank}: the upload that followed the cut-short staging write "
            f"did not stop in {_FOLLOW_STOP_S:.0f} s; not sending the shard from its snapshot to the "
            "same object (check the storage)"
        ) from full


def _result(
    job: ShardJob,
    record: SaveRecord,
    done: tuple[int, SaveState, float | None] | None,
    *,
    write_seconds: float,
    upload_seconds: float,
) -> ShardResult:
    """The job's result from its upload's (None: superseded), ``record`` advanced to it."""
    if done is None:
        record.advance(SaveState.SUPERSEDED)
        return ShardResult.superseded(job)
    num_bytes, state, committed_at = done
    record.advance(SaveState.UPLOADED)
    if state is SaveState.COMMITTED:
        record.advance(SaveState.COMMITTED)
    return ShardResult(
        step=job.step,
        rank=job.rank,
        num_bytes=num_bytes,
        write_seconds=write_seconds,
        upload_seconds=upload_seconds,
        state=state,
        committed_at=committed_at,
    )
