"""Retention: which checkpoints to delete, and deleting them without racing live saves.

Keep the newest ``keep_last`` intact commits by lineage order; delete what provably
belongs to a dead or settled save. Deletion works from one listing that may be stale by
the time it runs: it deletes only files that listing found (never a directory whole), so a
file a live rank uploaded meanwhile survives; a directory goes only once empty.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

from ray_goodput._faults import fault_point
from ray_goodput.checkpoint.protocol import _layout, _lineage
from ray_goodput.checkpoint.protocol._catalog import StepDir, scan
from ray_goodput.checkpoint.protocol._manifest import read_manifest
from ray_goodput.errors import CheckpointCorruptError
from ray_goodput.storage import StorageLocation, delete_file

logger = logging.getLogger(__name__)

_DELETE_CONCURRENCY = 8  # object stores delete one object per request


def _doomed(
    dirs: list[StepDir],
    keep_last: int,
    generation: int | None,
) -> list[tuple[StepDir, int | None]]:
    """What retention may delete (see :func:`apply_retention`): ``(dir, None)`` for a whole
    directory, ``(dir, g)`` for its files of generations below ``g`` only."""
    intact = sorted((d for d in dirs if d.intact), key=lambda d: d.manifest.order)
    if not intact:
        return []
    current = generation if generation is not None else intact[-1].manifest.generation
    keep = {d.step for d in intact[-max(1, keep_last) :]}
    newest = max((d.step for d in intact if d.manifest.generation == current), default=None)

    def settled(gen: int, step: int) -> bool:
        # Older generations are dead attempts; within the current one uploads are FIFO
        # per rank, so a save older than its newest commit will never change again.
        return gen < current or (gen == current and newest is not None and step < newest)

    out: list[tuple[StepDir, int | None]] = []
    for d in dirs:
        if d.step in keep:
            continue
        if newest is not None and d.step > newest:
            # The current attempt's other ranks may be uploading into it since the listing;
            # none of its saves can commit there meanwhile (this committer's own later
            # saves wait behind this job): only the files of dead generations go.
            if any((_layout.generation_of(n) or 0) < current for n in d.files):
                out.append((d, current))
            continue
        own = {d.manifest.generation} if d.intact else set()
        gens = (d.generations - own) if d.intact else (d.generations or {current})
        if all(settled(g, d.step) for g in gens):
            out.append((d, None))
    return out


def apply_retention(root: str | StorageLocation, keep_last: int, generation: int | None = None) -> list[int]:
    """Keep the newest ``keep_last`` intact committed checkpoints (by lineage order) and
    delete what provably belongs to a dead or settled save; returns the pruned steps.

    ``generation`` is the caller's (a committer passes its own; default: the newest
    commit's). Never deleted: the newest intact committed checkpoint, the step the live
    attempt resumes from (``_lineage.pin_resume``), a file that landed after the listing, and a
    file of ``generation`` or newer that may still be written (above that generation's
    newest commit its other ranks may be uploading). A committer of an older generation
    than the newest claimed (a dead attempt's uploader committing late) stops: the live
    attempt prunes.
    """
    return _prune(root, scan(root), keep_last, generation)


def _prune(root: str | StorageLocation, found: list[StepDir], keep_last: int, generation: int | None) -> list[int]:
    """:func:`apply_retention` from a listing ``found`` that may be stale by now."""
    pruned = []
    for n, (d, below) in enumerate(_doomed(found, keep_last, generation)):
        if n:
            fault_point("retention")
        # Both re-read before each directory: a new attempt may claim (and upload into any
        # of them), or the driver pin the step it resumes from, while this pass runs.
        if generation is not None and _lineage.claimed_generation(root) > generation:
            logger.info("retention of generation %d stops: a newer attempt has started", generation)
            break
        if d.step == _lineage.live_pin(root, found):
            continue
        if not _delete_listed(d, below):
            logger.info("retention skips step %d: it was committed again since the listing", d.step)
            continue
        if below is None and d.loc.is_local:
            _remove_empty_dirs(d.loc)
        logger.info(
            "retention removed %s step %d",
            "checkpoint" if below is None else f"the saves below generation {below} in",
            d.step,
        )
        pruned.append(d.step)
    return pruned


def _delete_listed(d: StepDir, below: int | None) -> bool:
    """Delete the files the listing ``d`` found (only those of generations below ``below``,
    when given), never one that landed since; False, deleting nothing, when the directory's
    commit changed since the listing (its ``.metadata`` and ``QUARANTINED`` carry no save
    id, so a new commit's would go too). ``COMMITTED`` first (a half-deleted directory
    never looks committed), then the rank markers (a save without them is never taken for a
    complete orphan), then the rest."""
    if _commit_now(d) != _commit_listed(d):
        return False
    if _layout.COMMITTED in d.files and (below is None or _dead(d, _layout.COMMITTED, below)):
        delete_file(d.loc, _layout.COMMITTED)
    names = [n for n in d.files if n != _layout.COMMITTED and (below is None or _dead(d, n, below))]
    markers = [n for n in names if n.startswith(_layout.RANKS_DIR)]
    rest = [n for n in names if not n.startswith(_layout.RANKS_DIR)]
    with ThreadPoolExecutor(max_workers=_DELETE_CONCURRENCY, thread_name_prefix="rg-retention") as pool:
        list(pool.map(lambda name: delete_file(d.loc, name), markers))  # before any data file
        if _commit_now(d) is not None:  # the listed one is gone: someone finished an orphan
            return False  # meanwhile (it read the markers in time); keep its files
        list(pool.map(lambda name: delete_file(d.loc, name), rest))
    return True


def _dead(d: StepDir, name: str, below: int) -> bool:
    """Whether ``name`` belongs to a save of a generation below ``below``. ``.metadata``,
    ``QUARANTINED`` and temp files carry no save id: they are a dead save's only when the
    listed commit is (a live rank may be finalizing the step, and a racing finalizer may
    have just deleted its COMMITTED)."""
    generation = _layout.generation_of(name)
    if generation is not None:
        return generation < below
    return d.manifest is not None and d.manifest.generation < below


_TORN = "<torn>"


def _commit_listed(d: StepDir) -> str | None:
    return d.manifest.save_id if d.manifest is not None else (_TORN if d.torn else None)


def _commit_now(d: StepDir) -> str | None:
    try:
        now = read_manifest(d.loc)
    except CheckpointCorruptError:
        return _TORN
    return now.save_id if now is not None else None


def _remove_empty_dirs(loc: StorageLocation) -> None:
    """Remove the directories under (and at) a local ``loc`` that are empty, bottom-up;
    never one that holds a file (a writer that loses its directory re-creates it)."""
    for path, _, _ in os.walk(loc.root, topdown=False):
        try:
            os.rmdir(path)
        except OSError:
            pass
