"""Per-rank DCP parts written without collectives, merged into one DCP ``.metadata``.

Each rank's leaves are written by DCP in single-process mode (so it can run in the node
uploader, after the worker has moved on or died). Its metadata is then rewritten as if
the collective planner had produced it: the data file gets the rank's name
(``__<rank>_0.distcp``) and DTensor chunks get their global size and offsets. The
committer merges the ranks' parts into the ``.metadata`` that any DCP reader, at any
world size, loads (resharding included).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pickle
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from ray_goodput.checkpoint.protocol._shard_plan import SHARD, Leaf
from ray_goodput.storage import (
    DEFAULT_ALGORITHM,
    ChecksummedWrite,
    StorageLocation,
    Written,
    open_output,
    upload_block_bytes,
)

try:  # torch >= 2.6
    from torch.utils.serialization import config as _serialization_config
except ImportError:  # pragma: no cover - older torch: records keep their CRC32
    _serialization_config = None


#: Tensors smaller than this are written first in a rank's data file (after DCP's byte
#: records, which it writes first). The small leaves one rank writes for all (optimizer
#: step counters, say) then share the file's first checksum block, and a peer that needs
#: them checks that one block instead of one block per counter.
SMALL_FIRST_BYTES = 1 << 20


def _small_first(flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` with its small tensors first, each group in its own order."""

    def small(value: Any) -> bool:
        return not isinstance(value, torch.Tensor) or value.numel() * value.element_size() < SMALL_FIRST_BYTES

    return {**{k: v for k, v in flat.items() if small(v)}, **{k: v for k, v in flat.items() if not small(v)}}


def data_file(rank: int, save_id: str) -> str:
    return f"__{rank}_{save_id}.distcp"


def part_file(rank: int, save_id: str) -> str:
    return f"parts/metadata-rank-{rank:05d}-{save_id}.pkl"


def _globalize(meta: Metadata, rank: int, save_id: str, leaves: dict[str, Leaf], mappings: dict) -> Metadata:
    sdm = dict(meta.state_dict_metadata)
    storage: dict[MetadataIndex, Any] = {}
    for index, info in meta.storage_data.items():
        leaf = leaves.get(index.fqn)
        if leaf is not None and leaf.kind == SHARD:
            index = MetadataIndex(index.fqn, torch.Size(leaf.global_offset))
        storage[index] = dataclasses.replace(info, relative_path=data_file(rank, save_id))
    for fqn, md in sdm.items():
        leaf = leaves.get(fqn)
        if isinstance(md, TensorStorageMetadata) and leaf is not None and leaf.kind == SHARD:
            chunk = ChunkStorageMetadata(offsets=torch.Size(leaf.global_offset), sizes=md.size)
            sdm[fqn] = TensorStorageMetadata(md.properties, torch.Size(leaf.global_size), [chunk])
    return Metadata(
        state_dict_metadata=sdm, planner_data=mappings, storage_data=storage, storage_meta=None, version=meta.version
    )


_crc_lock = threading.Lock()
_crc_writers = 0
_crc_before = True


@contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """While inside, ``torch.save`` writes its zip records without a CRC32.

    DCP writes each tensor with ``torch.save``, whose CRC32 is slow: most of a
    shard's write time. Every file of a checkpoint is covered by the manifest's CRC32C,
    so it adds nothing here. The setting is process-wide (an uploader thread in a worker
    shares it with the user's code): counted across concurrent writers, and the last one
    out puts back what was there before the first came in.
    """
    global _crc_writers, _crc_before  # noqa: PLW0603 - one setting per process
    save_config = getattr(_serialization_config, "save", None)
    if save_config is None or not hasattr(save_config, "compute_crc32"):
        yield  # a torch without the setting: records keep their CRC32
        return
    with _crc_lock:
        if _crc_writers == 0:
            _crc_before = save_config.compute_crc32
            save_config.compute_crc32 = False
        _crc_writers += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_writers -= 1
            if _crc_writers == 0:
                save_config.compute_crc32 = _crc_before


def write_staged(path: Path, data: bytes) -> None:
    """Write a small staged file aside, then rename it over ``path``: a new inode, never the
    one that local storage may hold as a hard link of an earlier run of the same job (a
    rewrite in place, cut short by a kill, would cut the committed file short too)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def writing_path(out_dir: Path, rank: int, save_id: str) -> Path:
    """Where :func:`write_part` has DCP write this rank's data file (front to back, once)
    before renaming it into ``out_dir``: named after the save, so that nothing a killed
    writer of another save left behind is ever taken for it."""
    return out_dir / f".part-{rank}-{save_id}-{os.getpid()}" / "__0_0.distcp"  # DCP's own name


class _DataFileFs(FileSystem):
    """DCP's local file system, with the data file checksummed while DCP writes it into
    ``open_data()``: the local file (with ``writeback``, its write to disk started as it
    goes: see ``storage._written``) or a stream straight to storage. The error that ended
    the data file's write is kept in ``error`` (DCP wraps it), for the caller to classify."""

    def __init__(
        self, data_path: Path, open_data: Callable[[], AbstractContextManager[Any]], writeback: bool, size_hint: int
    ) -> None:
        super().__init__()
        self._data_path, self._open_data, self._writeback = data_path, open_data, writeback
        self._block_bytes = upload_block_bytes(size_hint + (size_hint >> 6))  # + DCP's records
        self.written: Written | None = None
        self.error: BaseException | None = None

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if mode != "wb" or Path(path) != self._data_path:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        summed: ChecksummedWrite | None = None
        try:
            with self._open_data() as raw:
                with ChecksummedWrite(raw, DEFAULT_ALGORITHM, self._block_bytes, writeback=self._writeback) as summed:
                    yield summed
        except BaseException as exc:
            # The stream's own error first: torch's zip writer replaces a failed write's
            # error with its own ("unexpected pos") on the way out.
            self.error = (summed.error if summed is not None else None) or exc
            raise
        self.written = summed.result()


def write_part(
    flat: dict[str, Any],
    leaves: dict[str, Leaf],
    mappings: dict[str, Any],
    rank: int,
    save_id: str,
    out_dir: Path,
    *,
    written: dict[str, Written] | None = None,
    writeback: bool = False,
    direct: StorageLocation | None = None,
) -> list[str]:
    """DCP-write ``flat`` (this rank's leaves) into ``out_dir``; returns the file names.

    ``mappings`` is DCP's flatten mapping of the rank's whole state dict. ``written``
    receives the data file's size and checksums, computed as it was written (none when
    DCP wrote it out of order); ``writeback`` starts its write to disk as it goes (for a
    file that storage takes as a hard link, and then fsyncs). ``direct``: the data file
    goes straight to that storage directory instead of ``out_dir`` (only the small files
    are written there); a failed write there raises its storage error, unwrapped.
    """
    tmp = writing_path(out_dir, rank, save_id).parent
    shutil.rmtree(tmp, ignore_errors=True)
    data = data_file(rank, save_id)
    try:
        writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=False, thread_count=1)
        fs = None
        if written is not None or writeback or direct is not None:
            tensor_bytes = sum(v.numel() * v.element_size() for v in flat.values() if isinstance(v, torch.Tensor))
            data_path = writing_path(out_dir, rank, save_id)
            opener = (lambda: open(data_path, "wb")) if direct is None else (lambda: open_output(direct, data))  # noqa: SIM115 - closed by _DataFileFs
            writer.fs = fs = _DataFileFs(data_path, opener, writeback and direct is None, tensor_bytes)
        try:
            with _without_zip_crc32():
                dcp.save(
                    _small_first(flat),
                    storage_writer=writer,
                    no_dist=True,
                    planner=DefaultSavePlanner(flatten_state_dict=False),
                )
        except CheckpointException:
            if direct is not None and fs is not None and fs.error is not None:
                raise fs.error from None  # a storage error, as retries classify it
            raise
        with open(tmp / ".metadata", "rb") as f:
            meta = pickle.load(f)  # noqa: S301 - written just now by DCP
        if direct is None:
            os.replace(writing_path(out_dir, rank, save_id), out_dir / data)
        if written is not None and fs is not None and fs.written is not None:
            written[data] = fs.written
        (out_dir / "parts").mkdir(parents=True, exist_ok=True)
        write_staged(
            out_dir / part_file(rank, save_id), pickle.dumps(_globalize(meta, rank, save_id, leaves, mappings))
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write must not keep eating the disk
    return [data, part_file(rank, save_id)]


def merge_parts(parts: list[bytes], step: int) -> tuple[bytes, str]:
    """The global DCP ``.metadata`` (pickled) of the ranks' parts, in rank order, and the
    digest of its entries' names (:func:`keys_digest`).

    Deterministic: racing committers write identical bytes.
    """
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    mappings: dict[str, Any] = {}
    version = None
    for raw in parts:
        meta: Metadata = pickle.loads(raw)  # noqa: S301 - parts of our own checkpoint
        version = version or meta.version
        for fqn, path in (meta.planner_data or {}).items():
            mappings.setdefault(fqn, path)
        for fqn, md in meta.state_dict_metadata.items():
            have = sdm.get(fqn)
            if have is None:
                sdm[fqn] = (
                    md
                    if isinstance(md, BytesStorageMetadata)
                    else TensorStorageMetadata(md.properties, md.size, list(md.chunks))
                )
            elif isinstance(have, TensorStorageMetadata):
                known = {tuple(c.offsets) for c in have.chunks}
                have.chunks.extend(c for c in md.chunks if tuple(c.offsets) not in known)
        for index, info in meta.storage_data.items():
            storage.setdefault(index, info)
    merged = Metadata(
        state_dict_metadata=sdm,
        planner_data=mappings,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=None, save_id=f"step-{step}"),
        version=version,
    )
    out = io.BytesIO()
    pickle.dump(merged, out)
    return out.getvalue(), keys_digest(sdm)


def keys_digest(keys: Iterable[str]) -> str:
    """A digest of a checkpoint's entry names (DCP's flattened state-dict keys): the
    manifest carries it, so a restore knows before reading ``.metadata`` whether it loads
    every entry (and so reads its own data file whole)."""
    return hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest()[:32]
