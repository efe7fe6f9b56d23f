"""The commit protocol: per-rank durability markers, then the COMMITTED manifest, last.

Object stores have no rename, so "written last" is the commit: a checkpoint is
committed iff ``COMMITTED`` exists. Anyone holding storage access can finish a
checkpoint whose every rank marker is present (:func:`try_commit` is idempotent and
deterministic), so losing the component that was about to commit loses nothing.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from pathlib import Path
from dataclasses import dataclass, field

from ray_goodput.checkpoint import _layout
from ray_goodput.checkpoint._parts import merge_parts, part_file
from ray_goodput.errors import CheckpointCorruptError
from ray_goodput.storage import FileEntry, StorageLocation, list_dir, read_bytes, write_bytes

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass(frozen=True)
class RankMarker:
    """What one rank made durable for one step."""

    step: int
    rank: int
    world_size: int
    files: tuple[FileEntry, ...]
    created: float
    nonce: str

    def to_bytes(self) -> bytes:
        return json.dumps({
            "step": self.step, "rank": self.rank, "world_size": self.world_size,
            "created": self.created, "nonce": self.nonce, "files": [f.to_json() for f in self.files],
        }).encode()

    @staticmethod
    def from_bytes(data: bytes) -> RankMarker:
        d = json.loads(data)
        return RankMarker(step=int(d["step"]), rank=int(d["rank"]),
                          world_size=int(d["world_size"]), created=float(d["created"]),
                          nonce=str(d["nonce"]),
                          files=tuple(FileEntry.from_json(f) for f in d["files"]))


@dataclass(frozen=True)
class Manifest:
    """Content of ``COMMITTED``: every file of the checkpoint with size and CRC32."""

    step: int
    world_size: int
    files: tuple[FileEntry, ...]
    created: float
    nonce: str = ""
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, name: str) -> FileEntry | None:
        return next((f for f in self.files if f.name == name), None)

    def to_bytes(self) -> bytes:
        return json.dumps({
            "format_version": self.format_version, "step": self.step,
            "world_size": self.world_size, "created": self.created, "nonce": self.nonce,
            "total_bytes": self.total_bytes, "files": [f.to_json() for f in self.files],
        }, indent=1).encode()

    @staticmethod
    def from_bytes(data: bytes) -> Manifest:
        try:
            d = json.loads(data)
            return Manifest(step=int(d["step"]), world_size=int(d["world_size"]),
                            created=float(d["created"]), nonce=str(d.get("nonce", "")),
                            format_version=int(d.get("format_version", 1)),
                            files=tuple(FileEntry.from_json(f) for f in d["files"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointCorruptError(f"COMMITTED manifest is unreadable: {exc}") from exc


def write_rank_marker(step_loc: StorageLocation, marker: RankMarker) -> None:
    """Declare ``marker.files`` durable. Call only after every one of them is uploaded."""
    write_bytes(step_loc, _layout.rank_marker(marker.rank, marker.nonce), marker.to_bytes())


def read_rank_markers(step_loc: StorageLocation) -> list[RankMarker]:
    """The rank markers present in a step directory."""
    markers = []
    for info in list_dir(step_loc, _layout.RANKS_DIR):
        name = info.path.rsplit("/", 1)[-1]
        if name.endswith(".json"):
            try:
                markers.append(RankMarker.from_bytes(read_bytes(step_loc, f"{_layout.RANKS_DIR}/{name}")))
            except (ValueError, KeyError, TypeError, FileNotFoundError):
                logger.warning("ignoring unreadable rank marker %s/%s", step_loc.uri, name)
    return markers


def read_manifest(step_loc: StorageLocation) -> Manifest | None:
    """The manifest of a step directory, or None when it is not committed."""
    try:
        return Manifest.from_bytes(read_bytes(step_loc, _layout.COMMITTED))
    except FileNotFoundError:
        return None


def _write_dcp_metadata(step_loc: StorageLocation, step: int, world_size: int, nonce: str,
                        local_dir: Path | None) -> FileEntry:
    """Merge the ranks' metadata parts into DCP's ``.metadata``; written before COMMITTED
    (and into the node-local staged copy, when there is one, for local-first restore)."""
    parts = [read_bytes(step_loc, part_file(rank, nonce)) for rank in range(world_size)]
    data = merge_parts(parts, step)
    write_bytes(step_loc, _layout.DCP_METADATA, data)
    if local_dir is not None and local_dir.is_dir():
        tmp = local_dir / f".metadata.tmp-{os.getpid()}-{threading.get_ident()}"
        tmp.write_bytes(data)
        os.replace(tmp, local_dir / _layout.DCP_METADATA)
    return FileEntry(name=_layout.DCP_METADATA, size=len(data), crc32=zlib.crc32(data))


def try_commit(step_loc: StorageLocation, step: int, world_size: int, nonce: str,
               local_dir: Path | None = None) -> Manifest | None:
    """Write ``.metadata`` then ``COMMITTED`` if every rank of ``world_size`` is durable.

    Returns the manifest when the checkpoint is (now or already) committed, None when
    ranks are still missing. Idempotent: writers racing here write byte-identical files.
    """
    existing = read_manifest(step_loc)
    if existing is not None:
        return existing
    markers = {m.rank: m for m in read_rank_markers(step_loc)
               if m.step == step and m.nonce == nonce and m.world_size == world_size}
    if set(markers) != set(range(world_size)):
        return None
    files = [f for m in markers.values() for f in m.files]
    files.append(_write_dcp_metadata(step_loc, step, world_size, nonce, local_dir))
    files.sort(key=lambda f: f.name)
    manifest = Manifest(step=step, world_size=world_size, files=tuple(files), nonce=nonce,
                        created=max(m.created for m in markers.values()))
    write_bytes(step_loc, _layout.COMMITTED, manifest.to_bytes())
    logger.info("committed checkpoint step %d (%d files, %d bytes) at %s",
                step, len(files), manifest.total_bytes, step_loc.uri)
    return manifest
