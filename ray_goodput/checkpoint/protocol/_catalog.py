"""Finding, verifying, quarantining and collecting checkpoints in storage.

Order is lineage, not step: "newest" is the highest ``(generation, step)`` among intact
committed checkpoints (``_layout`` explains generations). One recursive listing of
``<root>/checkpoints`` describes every directory; manifests are read only where a
``COMMITTED`` exists.
"""

from __future__ import annotations

import heapq
import logging
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from ray_goodput.checkpoint.protocol import _layout
from ray_goodput.checkpoint.protocol._commit import finish_orphan
from ray_goodput.checkpoint.protocol._manifest import (
    Manifest,
    is_quarantined,
    quarantine,
    read_manifest,
    read_quarantine,
)
from ray_goodput.errors import CheckpointCorruptError
from ray_goodput.storage import StorageLocation, file_sizes, list_dir, object_crc32, resolve

logger = logging.getLogger(__name__)

#: Bound on waiting, after the listing, for the early read of a hinted commit; past it
#: the commit is read again (the early read's own retries can take longer).
_EARLY_READ_WAIT_S = 10.0


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory. ``world_size``/``created``/``generation`` are None when
    not committed; ``damaged`` when its commit was found damaged (quarantined or torn)."""

    step: int
    uri: str
    committed: bool
    world_size: int | None
    num_bytes: int
    created: float | None
    generation: int | None = None
    damaged: bool = False

    @property
    def state(self) -> str:
        return "committed" if self.committed else "damaged" if self.damaged else "uncommitted"


def checkpoints_location(root: str | StorageLocation) -> StorageLocation:
    return resolve(root).child(_layout.CHECKPOINTS_DIR)


def step_location(root: str | StorageLocation, step: int) -> StorageLocation:
    return checkpoints_location(root).child(_layout.step_dir(step))


_NOT_SAVE_FILES = {_layout.COMMITTED, _layout.QUARANTINED, _layout.DCP_METADATA}


@dataclass
class StepDir:
    """What one step directory holds, from one listing (manifest read when committed)."""

    step: int
    loc: StorageLocation
    files: dict[str, int] = field(default_factory=dict)  # name under the dir -> bytes
    manifest: Manifest | None = None
    torn: bool = False  # COMMITTED present but unreadable
    quarantined: bool = False

    @property
    def intact(self) -> bool:
        """Committed and not found damaged (sizes are checked by :func:`verify`)."""
        return self.manifest is not None and not self.quarantined

    @property
    def generations(self) -> set[int]:
        """Generations of the save files in it (0: saved before generations existed)."""
        return {_layout.generation_of(n) or 0 for n in self.files if n not in _NOT_SAVE_FILES and ".tmp-" not in n}

    def info(self) -> CheckpointInfo:
        m = self.manifest if self.intact else None
        return CheckpointInfo(
            step=self.step,
            uri=self.loc.uri,
            committed=m is not None,
            world_size=m.world_size if m else None,
            num_bytes=m.total_bytes if m else sum(self.files.values()),
            created=m.created if m else None,
            generation=m.generation if m else None,
            damaged=self.torn or self.quarantined,
        )


def scan(root: str | StorageLocation) -> list[StepDir]:
    """Every step directory under ``<root>/checkpoints``, by step, with its manifest when
    committed."""
    dirs = _list_steps(checkpoints_location(root))
    for d in dirs:
        if _layout.COMMITTED in d.files:
            _read_commit(d)
    return dirs


def _list_steps(ckpts: StorageLocation) -> list[StepDir]:
    """Every step directory under ``ckpts`` and its files, from one listing, by step."""
    dirs: dict[int, StepDir] = {}
    for info in list_dir(ckpts, recursive=True):
        rel = info.path[len(ckpts.root) + 1 :]
        top, _, rest = rel.partition("/")
        step = _layout.parse_step(top)
        if step is None:
            continue
        d = dirs.setdefault(step, StepDir(step, ckpts.child(top)))
        if rest and info.type == pafs.FileType.File:
            d.files[rest] = info.size or 0
    return [dirs[s] for s in sorted(dirs)]


def _read_early(step_loc: StorageLocation) -> Future[Manifest | None]:
    """``read_manifest(step_loc)`` in a thread of its own (its error in the future)."""
    future: Future[Manifest | None] = Future()

    def run() -> None:
        try:
            future.set_result(read_manifest(step_loc))
        except BaseException as exc:  # noqa: BLE001 - looked at by _listed_manifest
            future.set_exception(exc)

    try:
        threading.Thread(target=run, name="rg-commit-read", daemon=True).start()
    except RuntimeError as exc:  # no thread to spare: read after the listing, as any other
        future.set_exception(exc)
    return future


def read_beside_listing(step_loc: StorageLocation) -> tuple[Manifest | None, dict[str, int]]:
    """``read_manifest(step_loc)`` and the step directory's files (``file_sizes``), the two
    requests side by side instead of one after the other. Raises what ``read_manifest``
    raises (CheckpointCorruptError for a torn commit)."""
    early = _read_early(step_loc)
    present = file_sizes(step_loc)
    try:
        return early.result(timeout=_EARLY_READ_WAIT_S), present
    except FutureTimeout:  # slow in its own retries: read it again, with this thread's bounds
        return read_manifest(step_loc), present


def _listed_manifest(d: StepDir, early: Future[Manifest | None]) -> Manifest | None:
    """The manifest read beside the listing, if it names only files the listing found at
    their sizes and the listing shows no save file of a newer generation; None otherwise.

    A newer generation's files mean the step may have been saved and committed again
    since the early read (the commit of a re-save replaces the old ``COMMITTED`` only
    once all of its own files are there): the old save's files and an equally long
    ``.metadata`` would pass the size check."""
    try:
        manifest = early.result(timeout=_EARLY_READ_WAIT_S)
    except Exception:  # noqa: BLE001 - not committed then, unreadable, slow: read it again
        return None
    if (
        manifest is None
        or any(d.files.get(f.name) != f.size for f in manifest.files)
        or max(d.generations, default=0) > manifest.generation
    ):
        return None
    return manifest


def _read_commit(d: StepDir, early: Future[Manifest | None] | None = None) -> None:
    listed = _listed_manifest(d, early) if early is not None else None
    try:
        d.manifest = listed or read_manifest(d.loc)
    except CheckpointCorruptError as exc:
        logger.warning("checkpoint step %d at %s is damaged: %s", d.step, d.loc.uri, exc)
        d.torn = True
    except FileNotFoundError:
        return  # removed since the listing
    if d.manifest is not None and _layout.QUARANTINED in d.files:
        d.quarantined = is_quarantined(d.manifest, read_quarantine(d.loc))


def list_checkpoints(storage_path: str | StorageLocation) -> list[CheckpointInfo]:
    """Every checkpoint directory under ``<storage_path>/checkpoints`` that holds a file,
    by step (retention may leave a pruned directory empty)."""
    return [d.info() for d in scan(storage_path) if d.files]


def verify(
    step_loc: StorageLocation, manifest: Manifest, *, checksums: bool, present: dict[str, int] | None = None
) -> list[str]:
    """Problems found comparing storage with ``manifest``; empty when it matches.

    Sizes are always checked (one listing, or ``present``: the sizes a listing just
    made found, by name under the step directory); ``checksums`` reads every byte.
    """
    if present is None:
        present = file_sizes(step_loc)
    problems = []
    for entry in manifest.files:
        size = present.get(entry.name)
        if size is None:
            problems.append(f"{entry.name}: missing")
        elif size != entry.size:
            problems.append(f"{entry.name}: {size} bytes, manifest says {entry.size}")
        elif checksums and object_crc32(step_loc, entry.name, algorithm=entry.algorithm)[1] != entry.crc32:
            problems.append(f"{entry.name}: checksum mismatch")
    return problems


def _has_markers(d: StepDir) -> bool:
    return any(n.startswith(_layout.RANKS_DIR + "/") for n in d.files)


def newest_valid(
    root: str | StorageLocation,
    *,
    checksums: bool = False,
    max_step: int | None = None,
    before: tuple[int, int] | None = None,
    hint: int | None = None,
) -> tuple[StorageLocation, Manifest] | None:
    """The newest intact committed checkpoint: highest ``(generation, step)`` below
    ``before`` (and at most ``max_step``) that matches its manifest.

    A damaged one is quarantined with a warning (fall back to the previous one); an
    orphan whose every rank is durable is committed on the way.

    One listing, then commits read newest first, only as far as needed: until its
    ``COMMITTED`` is read, a directory ranks by the newest generation among its save files
    (its commit's generation is never above it: the commit's own files carry it), so the
    pick usually reads one commit, not every one kept. ``hint``: a step likely picked (the
    newest of the node-local copy); its ``COMMITTED`` is read while the listing is made,
    and that read is taken when the listing agrees with it (:func:`_listed_manifest`).
    """
    ckpts = checkpoints_location(root)
    early = _read_early(ckpts.child(_layout.step_dir(hint))) if hint is not None else None
    dirs = _list_steps(ckpts)
    heap = [
        ((-max(d.generations, default=0), -d.step), i)
        for i, d in enumerate(dirs)
        if _layout.COMMITTED in d.files or _has_markers(d)
    ]
    heapq.heapify(heap)
    read: set[int] = set()  # directories whose COMMITTED was read
    while heap:
        neg, i = heapq.heappop(heap)
        d, order = dirs[i], (-neg[0], -neg[1])
        if max_step is not None and d.step > max_step:
            continue
        if _layout.COMMITTED in d.files and i not in read:
            read.add(i)
            now = _rank_by_commit(d, order, early if d.step == hint else None)
            if now != order:  # torn (None), or ranked lower once its commit was read
                if now is not None:
                    heapq.heappush(heap, ((-now[0], -d.step), i))
                continue
        if d.quarantined or d.torn or (before is not None and order >= before):
            continue
        manifest = d.manifest
        if manifest is None:  # an orphan (rank markers, no commit), or a commit gone since the listing
            if not _has_markers(d):
                continue
            manifest = d.manifest = finish_orphan(d.loc, d.step)
            if manifest is None:
                continue
            if manifest.order != order:  # the complete save was an older one: re-rank it
                heapq.heappush(heap, ((-manifest.generation, -manifest.step), i))
                continue
        if _intact(d, manifest, checksums):
            return d.loc, manifest
    return None


def _rank_by_commit(
    d: StepDir, order: tuple[int, int], early: Future[Manifest | None] | None
) -> tuple[int, int] | None:
    """Read ``d``'s ``COMMITTED`` (``early``: its read already made) and return where ``d``
    ranks now: ``order`` (by its files so far) when its commit agrees or is gone, its
    commit's order when lower, None when the commit is torn (quarantined: skip it)."""
    _read_commit(d, early)
    if d.torn:
        if _layout.QUARANTINED not in d.files:
            quarantine_damaged(d.loc, None, "COMMITTED is unreadable")
        return None
    if d.manifest is None or d.manifest.order == order:
        return order
    # A newer generation's save files beside the commit: a save of the step again whose
    # committer died before replacing the old commit is finished here, as an orphan with
    # no commit is; else the folder ranks by its commit.
    newer = finish_orphan(d.loc, d.step, above=d.manifest.generation) if _has_markers(d) else None
    if newer is not None:  # committed now (its commit removed the old one's quarantine)
        d.manifest, d.quarantined = newer, False
    return d.manifest.order


def _intact(d: StepDir, manifest: Manifest, checksums: bool) -> bool:
    """Whether ``d``'s save of ``manifest`` matches it; quarantined when it does not."""
    problems = verify(d.loc, manifest, checksums=checksums, present=d.files)  # sizes as listed
    if problems:  # the listing may predate this commit (an orphan finished here, a step
        problems = verify(d.loc, manifest, checksums=checksums)  # committed again since): look again
    if not problems:
        return True
    quarantine_damaged(d.loc, manifest, "; ".join(problems[:5]))
    return False


def quarantine_damaged(step_loc: StorageLocation, manifest: Manifest | None, reason: str) -> None:
    """Warn and quarantine; a storage error while marking is logged, never raised (the
    damage was found; the next reader finds it again)."""
    logger.warning(
        "checkpoint step %s at %s is damaged (%s); quarantining it and falling back to an older one",
        manifest.step if manifest else "?",
        step_loc.uri,
        reason,
    )
    try:
        quarantine(step_loc, manifest, reason)
    except OSError as exc:
        logger.warning("could not quarantine %s: %s", step_loc.uri, exc)
