"""A shard sent to storage straight from its snapshot, for when the staging dir is full.

The node uploader DCP-writes a shard into the staging dir (the node-local copy a restore
reads first) and uploads that. When the staging dir has no room, DCP writes the shard's
data file straight into storage from the snapshot arena, checksummed as it goes: no
node-local copy and no second copy in memory. Only the shard's small files (DCP's part
metadata, the RNG extras: kilobytes) are written to memory first. The arena stays held
until the upload ends, since a retry writes the data file again from it; the next restore
of that step reads from storage.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import shutil
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray_goodput.checkpoint.protocol import _catalog, _layout
from ray_goodput.checkpoint.protocol._dcp_parts import data_file, part_file, write_part, writing_path
from ray_goodput.errors import CheckpointError
from ray_goodput.storage import FileEntry, RetryPolicy, Written, write_local_file

if TYPE_CHECKING:
    from ray_goodput.checkpoint.uploader._shard_job import ShardJob

logger = logging.getLogger(__name__)

#: Where a shard's small files go when the staging dir is full.
MEMORY_DIR = Path("/dev/shm")
#: Room the small files need in MEMORY_DIR: DCP's metadata of the rank's leaves, the part
#: file made from it and the RNG extras (a few hundred bytes a leaf). A state with more
#: leaves than this holds fails its write there, as a full disk does.
SMALL_FILES_BYTES = 512 << 10
_warned_full: set[str] = set()  # staging dirs found full, warned about once per process


class StagingFullError(CheckpointError):
    """The staging dir has no room for a shard (its message names the dir, the free bytes and
    the bytes needed)."""


def out_of_space(exc: BaseException) -> bool:
    """ENOSPC anywhere in the cause chain (DCP and torch's zip writer wrap it; when they
    hide it entirely, the caller goes by free space). Chains can loop (an error re-raised
    while handling itself): each error is looked at once."""
    todo: list[BaseException] = [exc]
    seen: set[int] = set()
    while todo:
        err = todo.pop()
        if id(err) in seen:
            continue
        seen.add(id(err))
        if getattr(err, "errno", None) == errno.ENOSPC:
            return True
        todo += [e for e in (err.__cause__, err.__context__) if e is not None]
        # DCP's CheckpointException carries each rank's error in ``failures``.
        todo += [
            f[0] if isinstance(f, tuple) else f
            for f in getattr(err, "failures", {}).values()
            if isinstance(f, (tuple, BaseException))
        ]
    return False


def _memory_full(full: StagingFullError, free: int) -> StagingFullError:
    return StagingFullError(
        f"{full}; {MEMORY_DIR} has {free} bytes free, too few for the shard's small files "
        f"(~{SMALL_FILES_BYTES} bytes) to send its data straight from the snapshot"
    )


def drop_own_files(job: ShardJob) -> None:
    """Delete what this rank wrote of ``job`` into its staging dir, and nothing else: the
    ranks of a node stage the same step into the same directory."""
    out = Path(job.local_dir)
    shutil.rmtree(writing_path(out, job.rank, job.save_id).parent, ignore_errors=True)
    for name in (
        data_file(job.rank, job.save_id),
        part_file(job.rank, job.save_id),
        _layout.extras_file(job.rank, job.save_id),
    ):
        (out / name).unlink(missing_ok=True)


def prepare(job: ShardJob, full: StagingFullError) -> tuple[ShardJob, list[str]]:
    """The staging dir is full (``full``): move ``job``'s small files to MEMORY_DIR (the
    caller removes ``Path(local_dir).parent`` with :func:`remove` once uploaded) and warn
    once per staging dir. Raises StagingFullError, with ``full``'s message and the memory's
    free bytes, when memory cannot take even the small files. Returns the job with its new
    ``local_dir`` and the names to upload."""
    staged = Path(job.local_dir)
    drop_own_files(job)  # the cut-short write: give its room back (the dir is its node peers' too)
    free = _free()
    if free < SMALL_FILES_BYTES:
        raise _memory_full(full, free) from full
    if str(staged.parent) not in _warned_full:
        _warned_full.add(str(staged.parent))
        logger.warning(
            "%s; sending the shard to storage straight from its snapshot instead, without a "
            "node-local copy, so a restore of this step reads from storage (warned once per staging dir)",
            full,
        )
    memory = MEMORY_DIR / "ray_goodput-direct" / staged.parent.name / f"{job.rank}-{job.save_id}" / staged.name
    moved = dataclasses.replace(job, local_dir=str(memory))
    extras = _layout.extras_file(job.rank, job.save_id)
    try:
        write_local_file(memory / extras, job.rng)
    except BaseException:
        remove(memory.parent)
        raise
    return moved, [data_file(job.rank, job.save_id), part_file(job.rank, job.save_id), extras]


def _free() -> int:
    return shutil.disk_usage(MEMORY_DIR).free if MEMORY_DIR.is_dir() else 0


def remove(memory: Path) -> None:
    """Delete a shard's small files (``memory``: its dir) and its run's dir once empty."""
    shutil.rmtree(memory, ignore_errors=True)
    with suppress(OSError):  # not empty: another rank's or save's files are there
        memory.parent.rmdir()


def sender(
    job: ShardJob, flat: dict[str, Any], policy: RetryPolicy, full: StagingFullError
) -> Callable[[], Sequence[FileEntry]]:
    """A function that DCP-writes ``job``'s data file (``flat``: its leaves, over the
    arena) straight to storage, and its part file to ``job.local_dir``; retried by
    ``policy``; returns the data file's entry. Called once per upload round. Memory found
    full meanwhile (the arenas live there too) raises StagingFullError, as :func:`prepare`."""
    loc = _catalog.step_location(job.root, job.step)
    name = data_file(job.rank, job.save_id)

    def _write() -> FileEntry:
        sums: dict[str, Written] = {}
        try:
            write_part(
                flat, job.leaves, job.mappings, job.rank, job.save_id, Path(job.local_dir), written=sums, direct=loc
            )
        except Exception as exc:
            free = _free()
            if out_of_space(exc) and free < SMALL_FILES_BYTES:
                raise _memory_full(full, free) from exc
            raise
        w = sums.get(name)
        if w is None:  # DCP wrote it out of order (never seen): its checksums are unknown
            raise CheckpointError(f"DCP did not write the data file {name} front to back; its checksums are unknown")
        return FileEntry(name, w.size, w.crc32, w.algorithm, w.block_bytes, w.blocks)

    def send() -> Sequence[FileEntry]:
        return [policy.call(f"upload of {name} from the snapshot to {loc.uri}", _write)]

    return send
