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
import logging
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray_goodput.checkpoint.protocol import _catalog, _layout
from ray_goodput.checkpoint.protocol._dcp_parts import data_file, part_file, write_part, writing_path
from ray_goodput.errors import CheckpointError
from ray_goodput.storage import FileEntry, RetryPolicy, Written, write_local_file

if TYPE_CHECKING:
    from ray_goodput.checkpoint.uploader._shard_job import ShardJob, StagingFullError

logger = logging.getLogger(__name__)

#: Where a shard's small files go when the staging dir is full.
MEMORY_DIR = Path("/dev/shm")
#: Room the small files need in MEMORY_DIR: DCP's metadata of the rank's leaves, the part
#: file made from it and the RNG extras (a few hundred bytes a leaf). A state with more
#: leaves than this holds fails its write there, as a full disk does.
SMALL_FILES_BYTES = 512 << 10
_warned_full: set[str] = set()  # staging dirs found full, warned about once per process


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
    """The staging dir is full: move ``job``'s small files to MEMORY_DIR (the caller
    deletes ``Path(local_dir).parent`` once uploaded) and warn once per staging dir.
    Raises ``full``, with the memory's free bytes, when memory cannot take even the small
    files. Returns the job with its new ``local_dir`` and the names to upload."""
    staged = Path(job.local_dir)
    drop_own_files(job)  # the cut-short write: give its room back (the dir is its node peers' too)
    free = shutil.disk_usage(MEMORY_DIR).free if MEMORY_DIR.is_dir() else 0
    if free < SMALL_FILES_BYTES:
        raise type(full)(
            f"{full}; {MEMORY_DIR} has {free} bytes free, too few for the shard's small files "
            f"(~{SMALL_FILES_BYTES} bytes) to send its data straight from the snapshot"
        ) from full
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
    write_local_file(memory / extras, job.rng)
    return moved, [data_file(job.rank, job.save_id), part_file(job.rank, job.save_id), extras]


def sender(job: ShardJob, flat: dict[str, Any], policy: RetryPolicy) -> Callable[[], Sequence[FileEntry]]:
    """A function that DCP-writes ``job``'s data file (``flat``: its leaves, over the
    arena) straight to storage, and its part file to ``job.local_dir``; retried by
    ``policy``; returns the data file's entry. Called once per upload round."""
    loc = _catalog.step_location(job.root, job.step)
    name = data_file(job.rank, job.save_id)

    def _write() -> FileEntry:
        sums: dict[str, Written] = {}
        write_part(flat, job.leaves, job.mappings, job.rank, job.save_id, Path(job.local_dir), written=sums, direct=loc)
        w = sums.get(name)
        if w is None:  # DCP wrote it out of order (never seen): its checksums are unknown
            raise CheckpointError(f"DCP did not write the data file {name} front to back; its checksums are unknown")
        return FileEntry(name, w.size, w.crc32, w.algorithm, w.block_bytes, w.blocks)

    def send() -> Sequence[FileEntry]:
        return [policy.call(f"upload of {name} from the snapshot to {loc.uri}", _write)]

    return send
