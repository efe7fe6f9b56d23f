"""Reading a checkpoint's tensors straight into the live state.

DCP reads each tensor of a data file with ``torch.load`` (a copy of the record into a new
storage) and then copies that into the live tensor: with the file read and its check,
three passes over the bytes where the floor is one. A DCP data file is a row of
``torch.save`` records (zip archives, stored uncompressed), so when a record holds exactly
the tensor the live one expects (same dtype and shape, contiguous from the start of its
storage, the whole chunk, not a slice of it, a CPU target) its bytes are copied into the
live tensor directly: from the file's mapping (a local file), the held buffer (a file read
from object storage), or read from the file when it could not be mapped.

Anything else (a resharded slice, a non-contiguous record, a GPU target, a storage
transform, a record this module cannot parse) goes through DCP's own read, unchanged.
The file's checksum was verified before either runs (``TieredReader.read_data``).
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ray_goodput.checkpoint.restore._byte_ranges import ReadAtFile

#: ``read_at(offset, size)``: bytes of the data file.
ReadAt = Callable[[int, int], bytes]

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")
_LOCAL_SIGNATURE = b"PK\x03\x04"


@dataclass(frozen=True)
class Record:
    """The one tensor of a ``torch.save`` record, and where its bytes are in the file."""

    dtype: torch.dtype
    size: tuple[int, ...]
    data_offset: int  # in the data file
    nbytes: int


class Unparsable(Exception):
    """A record this module does not read directly; DCP's own read takes it."""


#: The legacy storage names a plain tensor's pickle names (a table: asking torch's storage
#: classes for their dtype warns that TypedStorage is deprecated). Others (float8, the
#: wider unsigned types: ``_rebuild_tensor_v3``) go through DCP's read.
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


class _TensorPickle(pickle.Unpickler):
    """Reads the pickle of a saved tensor without building it: only the names a plain
    tensor's pickle uses are resolved, anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_args
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise Unparsable(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid


def _rebuild_args(
    storage: Any,
    offset: int,
    size: Any,
    stride: Any,
    requires_grad: bool = False,
    hooks: Any = None,
    metadata: Any = None,
    *rest: Any,
) -> tuple:
    if metadata or rest:  # e.g. {"conj": True}: the raw bytes alone read wrong
        raise Unparsable(f"tensor metadata {metadata!r}")
    return storage, offset, tuple(size), tuple(stride)


def _window(read_at: ReadAt, base: int, length: int) -> ReadAtFile:
    """The record as a file of its own, for zipfile to find its directory (at the end)
    without reading the data."""
    return ReadAtFile(lambda offset, size: read_at(base + offset, size), length)


def _entry_data(read_at: ReadAt, base: int, info: zipfile.ZipInfo) -> int:
    """Offset in the data file where the (stored) entry's bytes begin."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise Unparsable(f"{info.filename} is compressed")
    header = read_at(base + info.header_offset, _LOCAL_HEADER.size)
    fields = _LOCAL_HEADER.unpack(header)
    if fields[0] != _LOCAL_SIGNATURE:
        raise Unparsable(f"{info.filename}: no local header")
    return base + info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]


def _contiguous(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(size):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def parse_record(read_at: ReadAt, base: int, length: int) -> Record:
    """The tensor in the ``torch.save`` record at ``[base, base + length)``; raises
    ``Unparsable`` for what a direct read cannot take."""
    try:
        return _parse(read_at, base, length)
    except (
        zipfile.BadZipFile,
        OSError,
        ValueError,
        TypeError,
        EOFError,
        pickle.UnpicklingError,
        struct.error,
        KeyError,
        IndexError,
        AttributeError,
    ) as exc:
        raise Unparsable(f"{type(exc).__name__}: {exc}") from exc


def _parse(read_at: ReadAt, base: int, length: int) -> Record:
    entries = {i.filename.split("/", 1)[-1]: i for i in zipfile.ZipFile(_window(read_at, base, length)).infolist()}
    order = entries.get("byteorder")
    if order is not None and read_at(_entry_data(read_at, base, order), order.file_size) != sys.byteorder.encode():
        raise Unparsable("byte order")
    pkl = entries.get("data.pkl")
    if pkl is None:
        raise Unparsable("no data.pkl")
    raw = read_at(_entry_data(read_at, base, pkl), pkl.file_size)
    storage, offset, size, stride = _TensorPickle(io.BytesIO(raw)).load()
    _, dtype, key, location, numel = storage
    data = entries.get(f"data/{key}")
    if data is None or location != "cpu" or offset != 0 or stride != _contiguous(size):
        raise Unparsable("not a whole contiguous storage")
    nbytes = int(np.prod(size, dtype=np.int64)) * dtype.itemsize
    if data.file_size != nbytes or int(numel) * dtype.itemsize != nbytes:
        raise Unparsable("storage larger than the tensor")
    return Record(dtype=dtype, size=size, data_offset=_entry_data(read_at, base, data), nbytes=nbytes)


def can_take(target: torch.Tensor) -> bool:
    """Whether bytes can be written straight into ``target``'s memory (a plain, strided,
    contiguous CPU tensor without a conj or neg bit). Cheap: checked before parsing."""
    return (
        type(target) is torch.Tensor
        and target.layout == torch.strided
        and target.device.type == "cpu"
        and not target.is_conj()
        and not target.is_neg()
        and target.is_contiguous()
    )


def fits(record: Record, target: torch.Tensor) -> bool:
    """Whether ``record``'s bytes can be read straight into ``target``."""
    return (
        can_take(target)
        and target.dtype == record.dtype
        and tuple(target.shape) == record.size
        and target.numel() * target.element_size() == record.nbytes
    )


def byte_view(target: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    return memoryview(target.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def fill_from_buffer(target: torch.Tensor, data: bytes | memoryview, offset: int, nbytes: int) -> None:
    byte_view(target)[:nbytes] = memoryview(data)[offset : offset + nbytes]


def fill_from_file(target: torch.Tensor, f: Any, offset: int, nbytes: int) -> None:
    view, done = byte_view(target), 0
    f.seek(offset)
    while done < nbytes:
        got = f.readinto(view[done:nbytes])
        if not got:
            raise EOFError(f"the data file ended {nbytes - done} bytes early")
        done += got
