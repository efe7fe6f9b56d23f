"""Finding, verifying and collecting checkpoints in storage."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pyarrow.fs as pafs

from ray_goodput.checkpoint import _layout
from ray_goodput.checkpoint._manifest import Manifest, read_manifest, read_rank_markers, try_commit
from ray_goodput.errors import CheckpointCorruptError
from ray_goodput.storage import StorageLocation, delete_dir, list_dir, object_crc32, resolve

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory. ``world_size``/``created`` are None when not committed."""

    step: int
    uri: str
    committed: bool
    world_size: int | None
    num_bytes: int
    created: float | None


def checkpoints_location(root: str | StorageLocation) -> StorageLocation:
    return resolve(root).child(_layout.CHECKPOINTS_DIR)


def step_location(root: str | StorageLocation, step: int) -> StorageLocation:
    return checkpoints_location(root).child(_layout.step_dir(step))


def _step_dirs(ckpts: StorageLocation) -> list[tuple[int, pafs.FileInfo]]:
    found = []
    for info in list_dir(ckpts):
        step = _layout.parse_step(info.path)
        if step is not None and info.type == pafs.FileType.Directory:
            found.append((step, info))
    return sorted(found, key=lambda pair: pair[0])


def _dir_bytes(loc: StorageLocation) -> int:
    return sum(i.size or 0 for i in list_dir(loc, recursive=True) if i.type == pafs.FileType.File)


def finish_orphan(step_loc: StorageLocation, step: int) -> Manifest | None:
    """Commit a checkpoint whose ranks are all durable but whose committer was lost."""
    saves = {(m.nonce, m.world_size) for m in read_rank_markers(step_loc)}
    for nonce, world_size in sorted(saves):
        manifest = try_commit(step_loc, step, world_size, nonce)
        if manifest is not None:
            return manifest
    return None


def _manifest_or_none(loc: StorageLocation) -> Manifest | None:
    """The manifest, or None when absent or unreadable (a torn write is not a commit)."""
    try:
        return read_manifest(loc)
    except CheckpointCorruptError as exc:
        logger.warning("%s: %s", loc.uri, exc)
        return None


def list_checkpoints(storage_path: str | StorageLocation) -> list[CheckpointInfo]:
    """Every checkpoint directory under ``<storage_path>/checkpoints``, oldest first."""
    ckpts = checkpoints_location(storage_path)
    out = []
    for step, _ in _step_dirs(ckpts):
        loc = ckpts.child(_layout.step_dir(step))
        manifest = _manifest_or_none(loc)
        out.append(CheckpointInfo(
            step=step, uri=loc.uri, committed=manifest is not None,
            world_size=manifest.world_size if manifest else None,
            num_bytes=manifest.total_bytes if manifest else _dir_bytes(loc),
            created=manifest.created if manifest else None,
        ))
    return out


def verify(step_loc: StorageLocation, manifest: Manifest, *, checksums: bool) -> list[str]:
    """Problems found comparing storage with ``manifest``; empty when it matches.

    Sizes are always checked (one listing); ``checksums`` reads every byte.
    """
    present = {i.path[len(step_loc.root) + 1:]: i.size
               for i in list_dir(step_loc, recursive=True) if i.type == pafs.FileType.File}
    problems = []
    for entry in manifest.files:
        size = present.get(entry.name)
        if size is None:
            problems.append(f"{entry.name}: missing")
        elif size != entry.size:
            problems.append(f"{entry.name}: {size} bytes, manifest says {entry.size}")
        elif checksums and object_crc32(step_loc, entry.name)[1] != entry.crc32:
            problems.append(f"{entry.name}: checksum mismatch")
    return problems


def newest_valid(root: str | StorageLocation, *, checksums: bool = False,
                 max_step: int | None = None) -> tuple[StorageLocation, Manifest] | None:
    """The newest committed checkpoint that matches its manifest.

    Damaged ones are skipped with a warning (fall back to the previous committed one);
    orphans whose every rank is durable are committed on the way.
    """
    ckpts = checkpoints_location(root)
    for step, _ in reversed(_step_dirs(ckpts)):
        if max_step is not None and step > max_step:
            continue
        loc = ckpts.child(_layout.step_dir(step))
        try:
            manifest = read_manifest(loc) or finish_orphan(loc, step)
        except CheckpointCorruptError as exc:
            logger.warning("checkpoint step %d at %s is damaged (%s); falling back", step, loc.uri, exc)
            continue
        if manifest is None:
            continue
        problems = verify(loc, manifest, checksums=checksums)
        if not problems:
            return loc, manifest
        logger.warning("checkpoint step %d at %s is damaged (%s); falling back to an older one",
                       step, loc.uri, "; ".join(problems[:5]))
    return None


def apply_retention(root: str | StorageLocation, keep_last: int) -> list[int]:
    """Delete all but the newest ``keep_last`` committed checkpoints, and uncommitted
    directories older than the newest committed one. Returns the deleted steps.

    Never deletes the newest committed checkpoint, nor anything newer than it (those
    may still be uploading).
    """
    ckpts = checkpoints_location(root)
    dirs = _step_dirs(ckpts)
    committed = [s for s, _ in dirs if _manifest_or_none(ckpts.child(_layout.step_dir(s))) is not None]
    if not committed:
        return []
    keep = set(committed[-max(1, keep_last):])
    newest = committed[-1]
    doomed = [s for s, _ in dirs if s < newest and s not in keep]
    for step in doomed:
        loc = ckpts.child(_layout.step_dir(step))
        # The marker goes first: a half-deleted directory must never look committed.
        try:
            loc.fs.delete_file(loc.join(_layout.COMMITTED))
        except FileNotFoundError:
            pass
        delete_dir(ckpts, _layout.step_dir(step))
        logger.info("retention removed checkpoint step %d", step)
    return doomed
