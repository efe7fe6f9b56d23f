"""What the commit protocol writes: per-rank durability markers, the COMMITTED manifest
(written last) and the QUARANTINED marker of a committed save found damaged.

Object stores have no rename, so "written last" is the commit: a checkpoint is
committed iff ``COMMITTED`` exists and is not quarantined. The protocol itself (who
writes what, when) is :class:`ray_goodput.checkpoint.protocol._commit.CommitProtocol`.
"""

from __future__ import annotations

import json
import logging
import re
import time
import zlib
from dataclasses import dataclass, field

from ray_goodput.checkpoint.protocol import _layout
from ray_goodput.errors import CheckpointCorruptError
from ray_goodput.storage import CRC32, FileEntry, StorageLocation, list_dir, read_bytes, write_bytes

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


def checksum_of(files: tuple[FileEntry, ...]) -> str:
    """The checksum algorithm the record says its files carry (each file also names its
    own when it is not CRC32, so a mixed record still verifies)."""
    algorithms = sorted({f.algorithm for f in files}) or [CRC32]
    return ",".join(algorithms)


def _entries(d: dict) -> tuple[FileEntry, ...]:
    # Records written before CRC32C have no "checksum" field: CRC32.
    default = str(d.get("checksum", CRC32))
    default = default if "," not in default else CRC32
    return tuple(FileEntry.from_json(f, default) for f in d["files"])


@dataclass(frozen=True)
class RankMarker:
    """What one rank made durable for one step."""

    step: int
    rank: int
    world_size: int
    files: tuple[FileEntry, ...]
    created: float
    save_id: str
    generation: int = 0
    #: this rank's optimizers (state keys) saved before / after their first step
    unstepped: tuple[str, ...] = ()
    stepped: tuple[str, ...] = ()

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "step": self.step,
                "rank": self.rank,
                "world_size": self.world_size,
                "created": self.created,
                "nonce": self.save_id,
                "generation": self.generation,
                "unstepped": list(self.unstepped),
                "stepped": list(self.stepped),
                "checksum": checksum_of(self.files),
                "files": [f.to_json() for f in self.files],
            }
        ).encode()

    @staticmethod
    def from_bytes(data: bytes) -> RankMarker:
        d = json.loads(data)
        return RankMarker(
            step=int(d["step"]),
            rank=int(d["rank"]),
            world_size=int(d["world_size"]),
            created=float(d["created"]),
            save_id=str(d["nonce"]),
            generation=int(d.get("generation", 0)),
            unstepped=tuple(str(k) for k in d.get("unstepped", ())),
            stepped=tuple(str(k) for k in d.get("stepped", ())),
            files=_entries(d),
        )


@dataclass(frozen=True)
class Manifest:
    """Content of ``COMMITTED``: every file of the checkpoint with size and checksum
    (``"checksum"``: CRC32C since it was added; CRC32 when absent)."""

    step: int
    world_size: int
    files: tuple[FileEntry, ...]
    created: float
    save_id: str = ""
    generation: int = 0
    format_version: int = FORMAT_VERSION
    #: optimizers (state keys) saved before their first step on every rank: their saved
    #: state is what DCP made up to have something to save, and restore leaves them empty
    unstepped: tuple[str, ...] = ()
    #: digest of the checkpoint's entry names (``_parts.keys_digest``); "" in manifests
    #: written before it was added
    state_keys: str = ""
    extra: dict = field(default_factory=dict, compare=False)
    #: CRC32 of the ``COMMITTED`` bytes it was read from (names this commit in QUARANTINED).
    digest: int = field(default=0, compare=False)

    @property
    def order(self) -> tuple[int, int]:
        """Lineage order: a higher generation is newer whatever its step."""
        return (self.generation, self.step)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, name: str) -> FileEntry | None:
        return next((f for f in self.files if f.name == name), None)

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format_version": self.format_version,
                "step": self.step,
                "world_size": self.world_size,
                "created": self.created,
                "nonce": self.save_id,
                "generation": self.generation,
                "total_bytes": self.total_bytes,
                "unstepped": list(self.unstepped),
                "state_keys": self.state_keys,
                "checksum": checksum_of(self.files),
                "files": [f.to_json() for f in self.files],
            },
            indent=1,
        ).encode()

    @staticmethod
    def from_bytes(data: bytes) -> Manifest:
        try:
            d = json.loads(data)
            return Manifest(
                step=int(d["step"]),
                world_size=int(d["world_size"]),
                created=float(d["created"]),
                save_id=str(d.get("nonce", "")),
                generation=int(d.get("generation", 0)),
                format_version=int(d.get("format_version", 1)),
                unstepped=tuple(str(k) for k in d.get("unstepped", ())),
                state_keys=str(d.get("state_keys", "")),
                files=_entries(d),
                digest=zlib.crc32(data),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointCorruptError(f"COMMITTED manifest is unreadable: {exc}") from exc


def write_rank_marker(step_loc: StorageLocation, marker: RankMarker) -> None:
    """Declare ``marker.files`` durable. Call only after every one of them is uploaded."""
    write_bytes(step_loc, _layout.rank_marker(marker.rank, marker.save_id), marker.to_bytes())


_MARKER_RE = re.compile(r"^rank-(\d{5,})-(.+)\.json$")
_INTENT_RE = re.compile(r"^commit-(\d{5,})-(.+)$")


@dataclass(frozen=True)
class RanksListing:
    """One LIST of a step's ``.ranks`` directory, from the names alone: ``{save id:
    ranks}`` of the rank markers, and of the commit intents (``_layout.commit_intent``)."""

    markers: dict[str, set[int]]
    intents: dict[str, set[int]]


def list_ranks(step_loc: StorageLocation) -> RanksListing:
    """The markers and commit intents present: one LIST, no reads (so checking "is every
    rank durable?" costs O(1) requests, not O(world))."""
    listing = RanksListing({}, {})
    for info in list_dir(step_loc, _layout.RANKS_DIR):
        name = info.path.rsplit("/", 1)[-1]
        for pattern, found in ((_MARKER_RE, listing.markers), (_INTENT_RE, listing.intents)):
            match = pattern.match(name)
            if match:
                found.setdefault(match.group(2), set()).add(int(match.group(1)))
    return listing


def list_rank_markers(step_loc: StorageLocation) -> dict[str, set[int]]:
    """``{save id: ranks}`` of the markers present (:func:`list_ranks`)."""
    return list_ranks(step_loc).markers


def read_rank_marker(step_loc: StorageLocation, rank: int, save_id: str) -> RankMarker | None:
    """One rank's marker of save ``save_id``, or None when absent or unreadable."""
    try:
        return RankMarker.from_bytes(read_bytes(step_loc, _layout.rank_marker(rank, save_id)))
    except (ValueError, KeyError, TypeError, FileNotFoundError):
        logger.warning("ignoring unreadable rank marker %s/%s", step_loc.uri, _layout.rank_marker(rank, save_id))
        return None


def read_manifest(step_loc: StorageLocation) -> Manifest | None:
    """The manifest of a step directory, or None when it is not committed."""
    try:
        return Manifest.from_bytes(read_bytes(step_loc, _layout.COMMITTED))
    except FileNotFoundError:
        return None


def read_quarantine(step_loc: StorageLocation) -> dict | None:
    """The QUARANTINED record of a step directory, or None."""
    try:
        return json.loads(read_bytes(step_loc, _layout.QUARANTINED))
    except FileNotFoundError:
        return None
    except ValueError:  # a torn record still says "do not trust this commit"
        return {"digest": None, "reason": "unreadable QUARANTINED record"}


def is_quarantined(manifest: Manifest | None, record: dict | None) -> bool:
    """Whether ``record`` condemns this very commit (a later re-save of the step is not)."""
    if record is None:
        return False
    return record.get("digest") is None or manifest is None or record.get("digest") == manifest.digest


def quarantine(step_loc: StorageLocation, manifest: Manifest | None, reason: str) -> None:
    """Mark the commit in ``step_loc`` damaged: it is never restored or counted again."""
    record = {
        "digest": manifest.digest if manifest else None,
        "step": manifest.step if manifest else None,
        "nonce": manifest.save_id if manifest else None,
        "reason": reason,
        "time": time.time(),
    }
    write_bytes(step_loc, _layout.QUARANTINED, json.dumps(record).encode())
    logger.warning("quarantined checkpoint %s: %s", step_loc.uri, reason)
