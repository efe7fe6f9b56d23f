"""The commit protocol of one save, as a type: declare ranks durable, finalize, check.

Like a temporary path and its finalization (Orbax's atomicity module), a save is written
under its own id (every file name carries it) and becomes visible only when
``COMMITTED``, written last, names it. On object stores "written last" is the commit.

* :meth:`CommitProtocol.declare_durable`: a rank's files are uploaded (and fsynced on file
  systems); its marker says so.
* :meth:`CommitProtocol.finalize`: once every rank is durable, one of the jobs that see it
  (elected through commit intents) checks that their files are present, merges DCP's
  ``.metadata``, then writes ``COMMITTED``. Idempotent: racing finalizers write identical
  bytes. A commit of an *older* generation of the same step is replaced (a step saved
  again after a restart wins); a newer one is never touched (a dead attempt's late
  uploader must not overwrite it). One of the same generation is replaced only when it
  is quarantined: the run found it damaged, rolled back, and saved the step again.
* :meth:`CommitProtocol.check`: is this save the committed one?
* :func:`finish_orphan`: anyone with storage access finishes a save whose every rank is
  durable but whose finalizer was lost, the newest generation first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ray_goodput._faults import fault_point
from ray_goodput._lazy import LazyModule
from ray_goodput.checkpoint.protocol import _layout
from ray_goodput.checkpoint.protocol._manifest import (
    Manifest,
    RankMarker,
    is_quarantined,
    list_rank_markers,
    list_ranks,
    read_manifest,
    read_quarantine,
    read_rank_marker,
    write_rank_marker,
)
from ray_goodput.errors import CheckpointCorruptError, IncompleteSaveError, StorageError
from ray_goodput.storage import (
    DEFAULT_ALGORITHM,
    FileEntry,
    StorageLocation,
    checksum,
    delete_file,
    file_sizes,
    read_bytes,
    touch,
    write_bytes,
    write_local_file,
)

logger = logging.getLogger(__name__)

# Imported by the first commit: the driver and Ray Train's controller read commits (the
# resume choice) without torch.distributed.checkpoint, whose import (DTensor, sympy) would
# be on every run's start.
_dcp_parts = LazyModule("ray_goodput.checkpoint.protocol._dcp_parts")

#: Most storage reads a commit makes at once (markers, metadata parts, the listing).
_READERS = 16
#: Bound on waiting for another job of this process to finish committing the same save
#: (its own storage requests are bounded by their retry policy).
_TURN_WAIT_S = 600.0

PENDING = "pending"  # ranks are still missing
COMMITTED = "committed"  # this save is the step's commit
OUTRANKED = "outranked"  # a save of the same or a newer generation holds the step
DEFERRED = "deferred"  # every rank is durable; another job, elected, commits it


@dataclass(frozen=True)
class Finalized:
    state: str
    manifest: Manifest | None = None
    #: ``time.time()`` when this finalize's ``COMMITTED`` write returned (None when it
    #: wrote none: found committed already, pending, outranked).
    committed_at: float | None = None


_TORN = Manifest(step=-1, world_size=0, files=(), created=0.0, save_id="<torn>", generation=-1)


class _Turn:
    """One save's commit in this process: its jobs that see every marker take turns, and
    ``found`` is what the one that finished it found (the later ones return it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.found: Finalized | None = None
        self.users = 0  # jobs holding or waiting for the turn (guarded by _turns_lock)


#: A turn lives while a job holds or waits for it, and no longer: what one found is handed
#: only to jobs that listed every marker while it was committing (storage can change
#: after that: retention, a quarantine, a commit deleted by hand).
_turns: dict[tuple[str, str], _Turn] = {}
_turns_lock = threading.Lock()


@contextmanager
def _taking_turn(step_loc: StorageLocation, save_id: str) -> Iterator[_Turn]:
    key = (step_loc.uri, save_id)
    with _turns_lock:
        turn = _turns.setdefault(key, _Turn())
        turn.users += 1
    try:
        if not turn.lock.acquire(timeout=_TURN_WAIT_S):
            raise StorageError(
                f"another job of this process has been committing save {save_id} at "
                f"{step_loc.uri} for {_TURN_WAIT_S:.0f} s; check that the storage answers"
            )
        try:
            yield turn
        finally:
            turn.lock.release()
    finally:
        with _turns_lock:
            turn.users -= 1
            if not turn.users:
                del _turns[key]


def _existing(step_loc: StorageLocation) -> Manifest | None:
    """The step's commit; ``_TORN`` when ``COMMITTED`` is there but unreadable."""
    try:
        return read_manifest(step_loc)
    except CheckpointCorruptError:
        return _TORN


@dataclass(frozen=True)
class CommitProtocol:
    """The commit of one save (``save_id``) of one step, seen from any process."""

    step_loc: StorageLocation
    step: int
    world_size: int
    save_id: str
    generation: int

    def declare_durable(
        self,
        rank: int,
        files: list[FileEntry],
        created: float,
        unstepped: tuple[str, ...] = (),
        stepped: tuple[str, ...] = (),
    ) -> RankMarker:
        """Rank ``rank``'s ``files`` are durable. Call only after every one is uploaded.
        ``unstepped``/``stepped``: the rank's optimizers saved before / after their first step.
        Returns the marker written (``finalize`` takes it instead of reading it back)."""
        marker = RankMarker(
            step=self.step,
            rank=rank,
            world_size=self.world_size,
            files=tuple(files),
            created=created,
            save_id=self.save_id,
            generation=self.generation,
            unstepped=tuple(unstepped),
            stepped=tuple(stepped),
        )
        write_rank_marker(self.step_loc, marker)
        return marker

    def _ours(self, marker: RankMarker | None) -> bool:
        return (
            marker is not None
            and marker.step == self.step
            and marker.save_id == self.save_id
            and marker.world_size == self.world_size
        )

    def _gather(
        self,
        pool: ThreadPoolExecutor,
        local_dir: Path | None,
        own: RankMarker | None,
    ) -> tuple[dict[int, RankMarker], dict[int, Future[bytes]], Future[dict[str, int]]]:
        """Start every read the commit needs at once, once every marker is listed (O(world)
        requests by the committer, side by side, not one after another): the markers (but
        ``own``, the caller's, written just now), the ranks' metadata parts (the caller's
        own from ``local_dir`` when it is there) and the listing that checks the files are
        present. Returns the markers of this save by rank, the parts' reads by rank, and
        the listing (name under the step directory -> bytes)."""
        mine = own.rank if self._ours(own) else None
        markers = {
            rank: pool.submit(read_rank_marker, self.step_loc, rank, self.save_id)
            for rank in range(self.world_size)
            if rank != mine
        }
        parts = {
            rank: pool.submit(self._read_part, rank, local_dir if rank == mine else None)
            for rank in range(self.world_size)
        }
        present = pool.submit(file_sizes, self.step_loc)
        found = {rank: f.result() for rank, f in markers.items()}
        if own is not None and mine is not None:
            found[mine] = own
        return {r: m for r, m in found.items() if self._ours(m)}, parts, present

    def _read_part(self, rank: int, local_dir: Path | None) -> bytes:
        """A rank's metadata part: from ``local_dir`` (the caller's staged copy, the bytes
        it uploaded) when given and there, else from storage."""
        name = _dcp_parts.part_file(rank, self.save_id)
        if local_dir is not None:
            try:
                return (local_dir / name).read_bytes()
            except OSError:
                pass  # not staged there (or gone): storage has it
        return read_bytes(self.step_loc, name)

    def check(self) -> Manifest | None:
        """The committed manifest when it is this save's, else None."""
        existing = _existing(self.step_loc)
        return existing if existing is not None and existing.save_id == self.save_id else None

    def finalize(self, local_dir: Path | None = None, own: RankMarker | None = None) -> Finalized:
        """Commit this save if every rank is durable (see the module docstring).
        ``local_dir``: the caller's staged copy of its files (its metadata part is read
        there; the merged ``.metadata`` is written there too). ``own``: the marker the
        caller wrote (not read back).

        A job that wrote a marker (``own``) and lists every marker stands to commit; of
        those, one commits (:meth:`_elect`) and the others return ``DEFERRED`` without
        reading markers or parts, so a checkpoint costs O(world) requests even when every
        rank finishes at once. Without ``own`` (finishing an orphan, whose committer is
        gone) it commits outright. Jobs of the same save in one process (the ranks of a
        node share its uploader) take turns: a later one returns what the first found.
        A job that finds ranks missing never waits for that turn. Finalizing is
        idempotent: finalizers that still race write identical bytes."""
        with ThreadPoolExecutor(
            max_workers=min(_READERS, 2 * self.world_size + 1), thread_name_prefix="rg-commit"
        ) as pool:
            reading = pool.submit(_existing, self.step_loc)  # beside the listing
            listed = list_ranks(self.step_loc)
            existing = reading.result()
            if existing is not None and existing.save_id == self.save_id:
                return Finalized(COMMITTED, existing)
            # A commit of this generation (a rollback's re-save of the step): its quarantine
            # record, read once, says whether it stands and whether the record stays.
            same = existing is not None and existing is not _TORN and existing.generation == self.generation
            record = read_quarantine(self.step_loc) if same else None
            if existing is not None and existing is not _TORN and self._outranked_by(existing, record):
                return Finalized(OUTRANKED, existing)
            others = max((_layout.generation_of(n) or 0 for n in listed.markers if n != self.save_id), default=-1)
            if existing is _TORN and others >= self.generation:
                # A torn commit is damaged, not absent: only a newer generation's save replaces it.
                return Finalized(OUTRANKED)
            if listed.markers.get(self.save_id, set()) != set(range(self.world_size)):
                return Finalized(PENDING)
            # Finishing an orphan: never a damaged save (the record is read once per finalize).
            if own is None and self._condemned(record if same else read_quarantine(self.step_loc)):
                return Finalized(PENDING)
            with _taking_turn(self.step_loc, self.save_id) as turn:
                found = turn.found  # what another job of this process found meanwhile
                if found is not None and (found.state != DEFERRED or own is not None):
                    # A deferral binds only jobs that would elect: finishing an orphan
                    # (no marker of its own) commits whatever the others deferred to.
                    return Finalized(found.state, found.manifest)
                if own is not None and not self._elect(own.rank, listed.intents.get(self.save_id, set())):
                    turn.found = Finalized(DEFERRED)
                    return turn.found
                keep_record = record is not None and record.get("digest") is not None  # it names `existing`
                done = self._commit(pool, existing, local_dir, own, keep_record=keep_record)
                if done.state in (COMMITTED, OUTRANKED):
                    turn.found = done
                return done

    def _condemned(self, record: dict | None) -> bool:
        """Whether the step's quarantine ``record`` names this save: its commit was found
        damaged. Its COMMITTED is gone when a re-save of the step in its generation is
        replacing it (or died doing so); finishing it again as an orphan would commit the
        damaged files with nothing to condemn them."""
        if record is not None and record.get("nonce") == self.save_id:
            logger.warning("step %d: save %s was quarantined as damaged: not committed again", self.step, self.save_id)
            return True
        return False

    def _outranked_by(self, existing: Manifest, record: dict | None) -> bool:
        """Whether the step's commit of another save stands against this one: a newer
        generation's always; this generation's unless its quarantine ``record`` condemns
        it (a rollback in this run found it damaged and saved the step again)."""
        if existing.generation != self.generation:
            return existing.generation > self.generation
        return not is_quarantined(existing, record)

    def _elect(self, rank: int, intents: set[int]) -> bool:
        """Whether ``rank``'s job, which listed every marker, is the one to commit.
        ``intents``: the ranks whose intents its first listing showed; with another's
        there, someone is committing already and it returns False with no request.
        Otherwise it writes its own intent and lists again: it commits when no lower
        rank's intent is there. The job of the lowest intent ever written always commits
        (its second listing cannot show a lower one), so some job does unless that one
        dies; then the next restore finishes the save (``finish_orphan``). A job run again
        (its commit failed past its retries: the uploader runs it again through an
        outage) finds its own intent: it stands where it stood, the committer when its
        rank is the lowest intent."""
        if self.world_size == 1:
            return True
        if rank in intents:
            return min(intents) == rank
        if intents:
            return False
        touch(self.step_loc, _layout.commit_intent(rank, self.save_id))
        standing = list_ranks(self.step_loc).intents.get(self.save_id, set())
        return min(standing | {rank}) == rank

    def _commit(
        self,
        pool: ThreadPoolExecutor,
        existing: Manifest | None,
        local_dir: Path | None,
        own: RankMarker | None,
        *,
        keep_record: bool = False,
    ) -> Finalized:
        """Every marker is listed: read them and the parts, check, write ``.metadata`` and
        ``COMMITTED`` (see ``finalize``; ``existing``: the step's commit as it read it;
        ``keep_record``: its quarantine record names it and stays)."""
        markers, parts, present = self._gather(pool, local_dir, own)
        if set(markers) != set(range(self.world_size)):
            return Finalized(PENDING)  # the pool's exit waits for the reads still running
        files = [f for m in markers.values() for f in m.files]
        self._check_present(files, present.result())
        # Everything that can refuse this save is checked before the step's commit is
        # touched: a save that cannot commit leaves an older generation's commit standing.
        merged, state_keys = self._merged_metadata(parts, markers)
        # Replacing an older generation's commit (or a torn one): it stops being one
        # first, so that no reader pairs its manifest with the new .metadata. Its
        # quarantine record goes with it, before the new COMMITTED (beside the .metadata
        # write). With none seen, a COMMITTED there now is a racing finalizer's of this
        # very save: deleting it would un-commit the step. Replacing a quarantined commit
        # of this generation, the record that names it stays: a restore that finished that
        # damaged save as an orphan before the new COMMITTED lands (or after a crash in
        # between) would commit it again, and the record keeps it condemned.
        if existing is not None:
            self._delete(_layout.COMMITTED)
        unquarantined = None if keep_record else pool.submit(self._delete, _layout.QUARANTINED)
        with self._pruned_meanwhile():
            metadata = self._write_dcp_metadata(merged, local_dir)
        if unquarantined is not None:
            unquarantined.result()
        manifest = self._manifest(markers, [*files, metadata], state_keys)
        fault_point("commit.before_committed")
        data = manifest.to_bytes()
        with self._pruned_meanwhile():
            write_bytes(self.step_loc, _layout.COMMITTED, data)
        committed_at = time.time()
        logger.info(
            "committed checkpoint step %d generation %d (%d files, %d bytes) at %s",
            self.step,
            self.generation,
            len(manifest.files),
            manifest.total_bytes,
            self.step_loc.uri,
        )
        # A newer generation that finished meanwhile must end up holding the step.
        newer = finish_orphan(self.step_loc, self.step, above=self.generation)
        if newer is not None:
            return Finalized(OUTRANKED, newer)
        return Finalized(COMMITTED, Manifest.from_bytes(data), committed_at=committed_at)

    def _manifest(self, markers: dict[int, RankMarker], files: list[FileEntry], state_keys: str) -> Manifest:
        """The commit's manifest: ``files`` (every rank's, and ``.metadata``) and what the
        ranks' markers declared."""
        # Unstepped: fresh on some rank and stepped on none (a frozen stage's optimizer never
        # steps while the others' do; pipeline stages may each have an optimizer of their own).
        unstepped = set().union(*(m.unstepped for m in markers.values())) - set().union(
            *(m.stepped for m in markers.values())
        )
        return Manifest(
            step=self.step,
            world_size=self.world_size,
            files=tuple(sorted(files, key=lambda f: f.name)),
            save_id=self.save_id,
            generation=self.generation,
            created=max(m.created for m in markers.values()),
            unstepped=tuple(sorted(unstepped)),
            state_keys=state_keys,
        )

    def _delete(self, name: str) -> None:
        delete_file(self.step_loc, name)  # retried, as the commit's writes are

    @contextmanager
    def _pruned_meanwhile(self) -> Iterator[None]:
        """A write whose file vanished under it (retention deletes the files it listed,
        a ``.tmp-`` of ``.metadata`` or ``COMMITTED`` among them, which carry no save id):
        the save is being pruned and can never commit."""
        try:
            yield
        except StorageError as exc:
            if not isinstance(exc.__cause__, FileNotFoundError):
                raise
            raise IncompleteSaveError(
                f"step {self.step} save {self.save_id}: a commit file went while "
                f"it was written ({exc.__cause__}); retention is pruning it"
            ) from exc

    def _check_present(self, files: list[FileEntry], present: dict[str, int]) -> None:
        """Every declared file is in ``present`` (a listing made once every marker was
        listed) at its declared size."""
        gone = [f.name for f in files if present.get(f.name) != f.size]
        if gone:
            raise IncompleteSaveError(
                f"step {self.step} save {self.save_id}: {len(gone)} file(s) declared durable are "
                f"missing or changed ({', '.join(gone[:3])}); this save cannot commit, the previous "
                "committed checkpoint stays the recovery point"
            )

    def _merged_metadata(self, parts: dict[int, Future[bytes]], markers: dict[int, RankMarker]) -> tuple[bytes, str]:
        """The ranks' metadata parts (their reads, by rank) merged into DCP's ``.metadata``
        bytes, and the digest of its keys. Each part is checked against what its rank
        declared durable first: the merged file's checksum is computed from them, so a
        damaged part would pass every later check. IncompleteSaveError when one is gone,
        damaged or does not merge: this save can never commit."""
        try:
            raw = [parts[rank].result() for rank in range(self.world_size)]
        except FileNotFoundError as exc:  # deleted since its marker was written
            raise IncompleteSaveError(
                f"step {self.step} save {self.save_id}: a metadata part is gone ({exc}); this save cannot commit"
            ) from exc
        for rank, data in enumerate(raw):
            name = _dcp_parts.part_file(rank, self.save_id)
            entry = next((f for f in markers[rank].files if f.name == name), None)
            if entry is not None and (len(data) != entry.size or checksum(data, entry.algorithm) != entry.crc32):
                raise IncompleteSaveError(
                    f"step {self.step} save {self.save_id}: rank {rank}'s metadata part {name} does not match "
                    f"what the rank declared durable ({len(data)} bytes, {entry.size} declared, or its "
                    "checksum); this save cannot commit"
                )
        try:
            return _dcp_parts.merge_parts(raw, self.step)
        except Exception as exc:  # bytes that match their checksum but do not unpickle
            raise IncompleteSaveError(
                f"step {self.step} save {self.save_id}: its metadata parts cannot be merged "
                f"({type(exc).__name__}: {exc}); this save cannot commit"
            ) from exc

    def _write_dcp_metadata(self, data: bytes, local_dir: Path | None) -> FileEntry:
        """Write the merged ``.metadata`` (and into the node-local staged copy, when there is
        one, for local-first restore); returns its entry."""
        write_bytes(self.step_loc, _layout.DCP_METADATA, data)
        if local_dir is not None and local_dir.is_dir():
            write_local_file(local_dir / _layout.DCP_METADATA, data)
        return FileEntry(name=_layout.DCP_METADATA, size=len(data), crc32=checksum(data), algorithm=DEFAULT_ALGORITHM)


def finish_orphan(step_loc: StorageLocation, step: int, *, above: int = -1) -> Manifest | None:
    """Commit the newest-generation save of ``step`` whose every rank is durable (only
    generations above ``above``); returns the step's manifest when it ends up committed by
    one of them, else None."""
    # From the names (one LIST); a candidate's world size from one of its markers.
    saves = sorted(
        (
            (_layout.generation_of(save_id) or 0, save_id, ranks)
            for save_id, ranks in list_rank_markers(step_loc).items()
        ),
        reverse=True,
    )
    for generation, save_id, ranks in saves:
        if generation <= above:
            break
        marker = read_rank_marker(step_loc, min(ranks), save_id)
        if marker is None or marker.step != step:
            continue
        try:
            done = CommitProtocol(step_loc, step, marker.world_size, save_id, marker.generation).finalize()
        except IncompleteSaveError as exc:
            # Its files went after its markers were written: a deletion cut short (retention
            # killed mid-way), or a retention pruning it meanwhile. It can never commit.
            logger.warning("step %d: the orphaned save %s cannot be committed: %s", step, save_id, exc)
            continue
        if done.state == COMMITTED:
            return done.manifest
        if done.state == OUTRANKED:
            return None
    return None
