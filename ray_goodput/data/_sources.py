"""Turn a dataset ``source`` (a directory URI or a list of file URIs) into a file set."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from ray_goodput import _env, storage
from ray_goodput.data._cache_files import CacheLayout
from ray_goodput.errors import ConfigError, DataError, StorageError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileSet:
    """Files of a dataset on one filesystem. Picklable (DataLoader workers get a copy).

    ``ident`` names the filesystem (scheme and endpoint) so that cache keys of two
    endpoints never collide; ``paths`` are paths inside ``fs``; ``sizes`` are bytes and
    ``mtimes`` modification times in ns as listed, -1 (or no ``mtimes``) where not listed.
    """

    ident: str
    fs: pafs.FileSystem
    paths: tuple[str, ...]
    sizes: tuple[int, ...]
    mtimes: tuple[int, ...] = ()

    def uri(self, i: int) -> str:
        """Printable name of file ``i`` for messages and logs."""
        return f"{self.ident.split('?')[0]}{self.paths[i]}"

    def cache_key(self, i: int) -> str:
        """The node cache's name of file ``i``: its filesystem, path, listed size and
        modification time, so that a file rewritten in place is fetched again (a list of
        file URIs lists neither: only the path tells)."""
        return CacheLayout.key(self.ident, self.paths[i], self.sizes[i], self.mtimes[i] if self.mtimes else -1)

    def cache_id(self) -> int:
        """63-bit int naming this file list as the node cache knows it: its filesystem,
        paths, sizes and modification times."""
        h = hashlib.blake2b(self.ident.encode(), digest_size=8)
        return self.fingerprint([*self.sizes, *self.mtimes, int.from_bytes(h.digest(), "little", signed=True)])

    def fingerprint(self, extra: Sequence[int] = ()) -> int:
        """63-bit int naming this file list (and e.g. row counts), for loader states."""
        h = hashlib.blake2b(digest_size=8)
        for p in self.paths:
            h.update(p.encode())
            h.update(b"\0")
        for x in extra:
            h.update(int(x).to_bytes(8, "little", signed=True))
        return int.from_bytes(h.digest(), "little") & (2**63 - 1)


#: Schemes whose URI host is the bucket, which pyarrow keeps in the path of every file.
_BUCKET_SCHEMES = ("s3", "gs", "gcs")


def _ident(uri: str) -> str:
    """The filesystem of ``uri``: its scheme, its endpoint (the S3 endpoint set by
    ``RAY_GOODPUT_S3_ENDPOINT`` included) and, where the path does not carry it, its host
    (an HDFS namenode, an Azure account)."""
    parts = urlsplit(uri)
    if "://" not in uri or parts.scheme == "file":
        return "file://"
    query = parts.query
    endpoint = _env.s3_endpoint()
    if parts.scheme == "s3" and endpoint and "endpoint_override" not in query:
        query = f"{query}&endpoint_override={endpoint}" if query else f"endpoint_override={endpoint}"
    host = "" if parts.scheme in _BUCKET_SCHEMES else parts.netloc
    return f"{parts.scheme}://{host}?{query}"


def _list_directory(uri: str, suffixes: tuple[str, ...]) -> FileSet:
    loc = storage.resolve(uri)
    try:
        infos = storage.list_dir(loc, recursive=True)
    except StorageError as exc:
        raise StorageError(f"cannot list dataset source {uri!r}: {exc}") from exc
    files = sorted(
        (i.path, i.size, i.mtime_ns)
        for i in infos
        if i.type == pafs.FileType.File and _wanted(i.path[len(loc.root) :], suffixes)
    )
    if not files:
        raise DataError(
            f"dataset source {uri!r} holds no files"
            + (f" ending in {suffixes}" if suffixes else "")
            + "; check the URI (and its ?endpoint_override for a custom S3)"
        )
    return FileSet(
        ident=_ident(uri),
        fs=loc.fs,
        paths=tuple(p for p, _, _ in files),
        sizes=tuple(int(s) if s is not None else -1 for _, s, _ in files),
        mtimes=tuple(int(t) if t is not None else -1 for _, _, t in files),
    )


def _wanted(relative: str, suffixes: tuple[str, ...]) -> bool:
    """Whether a listed file (its path below the source's root) is data: not one whose
    name, or the name of a folder it is in, starts with ``.`` or ``_`` (``_SUCCESS``,
    ``.part`` files, a writer's ``_temporary/`` or ``.hive-staging*/``)."""
    parts = [p for p in relative.split("/") if p]
    if not parts or any(p.startswith((".", "_")) for p in parts):
        return False
    return not suffixes or parts[-1].endswith(suffixes)


def _list_files(uris: Sequence[str]) -> FileSet:
    if not uris:
        raise DataError("dataset source is an empty list of files; pass at least one URI")
    idents = {_ident(u) for u in uris}
    if len(idents) > 1:
        raise ConfigError(f"dataset files must be on one filesystem/endpoint, got {sorted(idents)}")
    first = storage.resolve(uris[0])
    paths = []
    for u in uris:
        # Only the path differs between files of one filesystem: take it without building
        # one filesystem per file (~ms each on S3, a namenode connection on HDFS) where the
        # URI says it: on S3 and GCS the host is the bucket, kept in the path; on HDFS the
        # path is the URI's. Elsewhere (an Azure container and account) pyarrow resolves it.
        scheme = urlsplit(u).scheme if "://" in u else ""
        if scheme in _BUCKET_SCHEMES:
            paths.append(_remote_path(u))
        elif scheme in ("hdfs", "viewfs"):
            paths.append(urlsplit(u).path)
        else:
            paths.append(storage.resolve(u).root)
    return FileSet(ident=_ident(uris[0]), fs=first.fs, paths=tuple(paths), sizes=tuple(-1 for _ in paths))


def _remote_path(uri: str) -> str:
    parts = urlsplit(uri)
    return f"{parts.netloc}{parts.path}".rstrip("/")


def resolve_source(source: str | Sequence[str], suffixes: tuple[str, ...] = ()) -> FileSet:
    """A FileSet from a directory URI (listed recursively, sorted) or a list of file URIs."""
    if isinstance(source, str):
        return _list_directory(source, suffixes)
    if isinstance(source, Sequence):
        return _list_files([str(u) for u in source])
    raise ConfigError(f"source must be a directory URI or a list of file URIs, got {type(source)}")
