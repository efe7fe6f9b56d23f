"""Resolve a storage URI to a ``pyarrow.fs`` filesystem and a root path inside it."""

from __future__ import annotations

import logging
import posixpath
import socket
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pyarrow.fs as pafs

from ray_goodput import _env
from ray_goodput.errors import ConfigError, StorageUnreachableError, StorageUnusableError
from ray_goodput.storage._retry import RetryPolicy, is_outage

logger = logging.getLogger(__name__)


def _with_default_endpoint(uri: str) -> str:
    """Add the ``RAY_GOODPUT_S3_ENDPOINT`` override to an ``s3://`` URI that has none."""
    endpoint = _env.s3_endpoint()
    parts = urlsplit(uri)
    if parts.scheme != "s3" or not endpoint:
        return uri
    query = dict(parse_qsl(parts.query))
    if "endpoint_override" in query:
        return uri
    ep = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    query.update(endpoint_override=ep.netloc, scheme=ep.scheme or "http")
    return urlunsplit(parts._replace(query=urlencode(query)))


def _with_delayed_open(uri: str) -> str:
    """Let an ``s3://`` stream open lazily unless the URI says otherwise: opened eagerly,
    pyarrow starts a multipart upload, and every small write (a marker, a manifest) costs
    three round trips instead of one PUT. Errors then surface at write or close, which
    every writer here reaches inside its retried call (the storage probe included)."""
    parts = urlsplit(uri)
    query = dict(parse_qsl(parts.query))
    if parts.scheme != "s3" or "allow_delayed_open" in query:
        return uri
    query["allow_delayed_open"] = "true"
    return urlunsplit(parts._replace(query=urlencode(query)))


def _s3_endpoint(uri: str) -> tuple[str, int] | None:
    """(host, port) of an ``s3://`` URI's custom endpoint; None for AWS's own."""
    parts = urlsplit(_with_default_endpoint(uri))
    query = dict(parse_qsl(parts.query))
    if parts.scheme != "s3" or not query.get("endpoint_override"):
        return None
    endpoint = urlsplit(f"//{query['endpoint_override']}")
    default = 80 if query.get("scheme") == "http" else 443
    try:
        return endpoint.hostname or "", endpoint.port or default
    except ValueError:  # a port that is not a number: pyarrow's own error says more
        return None


#: Retries the S3 client makes of a failed request before the error reaches
#: :class:`RetryPolicy`: 25, 50, 100 and 200 ms apart, so that a blip (a reset connection,
#: a 503, one failed part of a multipart upload) is retried in place within ~0.4 s, and an
#: outage reaches RetryPolicy, the one layer that backs off for long, within its stated
#: bound. ``pyarrow.fs.FileSystem.from_uri`` left the client on the AWS SDK's own default,
#: which retried a request that kept failing for ~6 s (~40 requests against an endpoint
#: failing them all) under every RetryPolicy attempt.
S3_CLIENT_RETRIES = 4


def _with_client_retries(fs: pafs.FileSystem) -> pafs.FileSystem:
    """``fs`` with the S3 client's retries bounded (other filesystems as they are).

    The options come from the filesystem's pickle form (which drops the retry strategy:
    :class:`StorageLocation` re-applies it when unpickled)."""
    if not isinstance(fs, pafs.S3FileSystem):
        return fs
    _, args = fs.__reduce__()
    if len(args) != 1 or not isinstance(args[0], dict):  # a pyarrow that pickles differently
        logger.warning("cannot bound the S3 client's retries on this pyarrow (%s)", pafs.__name__)
        return fs
    return pafs.S3FileSystem(**args[0], retry_strategy=pafs.AwsDefaultS3RetryStrategy(max_attempts=S3_CLIENT_RETRIES))


def _location(uri: str, fs: pafs.FileSystem, root: str) -> StorageLocation:
    return StorageLocation(uri=uri, fs=_with_client_retries(fs), root=root)


@dataclass(frozen=True)
class StorageLocation:
    """A filesystem plus a root directory in it. Picklable; cheap to pass to actors.

    ``uri`` is what the user gave; ``root`` is the path inside ``fs`` (no scheme).
    """

    uri: str
    fs: pafs.FileSystem = field(repr=False, compare=False)
    root: str

    def __reduce__(self) -> tuple:
        return _location, (self.uri, self.fs, self.root)

    def join(self, *parts: str) -> str:
        """Path inside ``fs`` of ``parts`` under the root."""
        return posixpath.join(self.root, *parts)

    def child(self, *parts: str) -> StorageLocation:
        """The location of a subdirectory, keeping the same filesystem."""
        sub = "/".join(p.strip("/") for p in parts)
        split = urlsplit(self.uri)  # keep ?endpoint_override=... at the end of the URI
        uri = urlunsplit(split._replace(path=f"{split.path.rstrip('/')}/{sub}"))
        return StorageLocation(uri=uri, fs=self.fs, root=self.join(sub))

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def _write(self, path: str, data: bytes) -> None:
        with self.fs.open_output_stream(path) as out:
            out.write(data)

    def _read(self, path: str) -> bytes:
        with self.fs.open_input_file(path) as inp:
            return inp.read()

    def _connect_to_endpoint(self, timeout_s: float = 10.0) -> None:
        """Fail in a moment, not after the S3 client's retries (~12 s per request), when
        nothing accepts connections at a custom endpoint."""
        endpoint = _s3_endpoint(self.uri)
        if endpoint is None:
            return
        try:
            socket.create_connection(endpoint, timeout=timeout_s).close()
        except OSError as exc:
            # from None: the probe's message shows the cause of a retried error, and this
            # one already says it.
            raise ConnectionError(
                f"nothing accepts connections at {endpoint[0]}:{endpoint[1]} "
                f"({type(exc).__name__}: {exc}; waited up to {timeout_s:.0f} s)"
            ) from None

    def probe(self, policy: RetryPolicy | None = None, *, outage_wait_s: float = 0.0) -> None:
        """Write, read back and delete a small object under the root, each retried by
        ``policy`` (by default 3 attempts within ~1 s; pass the policy the storage will
        be used with, so that storage it can use is never refused at start).

        Raises StorageUnusableError naming the URI and the cause when storage is unreachable,
        refuses credentials or is read-only: StorageUnreachableError (its subclass) when
        every cause is one an outage also gives (nothing accepting connections, timeouts,
        5xx). ``outage_wait_s``: how long to go on probing through such errors first (a
        restart, where this storage worked: an outage, not a wrong endpoint). Call it
        early: at start, not at the first save.
        """
        retry = policy or RetryPolicy(attempts=3, initial_delay=0.2, max_delay=1.0)
        deadline = time.monotonic() + outage_wait_s
        pause = 1.0
        while True:
            try:
                self._probe_once(retry)
                return
            except StorageUnusableError:
                raise
            except Exception as exc:  # classified below: an outage's, or anything else
                outage = _outage_like(exc)
                left = deadline - time.monotonic()
                if not outage or left <= 0:
                    kind = StorageUnreachableError if outage else StorageUnusableError
                    cause = exc.__cause__ or exc
                    waited = f" (probed for {outage_wait_s:.0f} s)" if outage_wait_s > 0 else ""
                    raise kind(
                        f"storage {self.uri!r} is not usable: a probe write/read failed with "
                        f"{type(cause).__name__}: {cause}{waited}. Check the URI, that the bucket or "
                        "directory exists and is writable, the credentials (e.g. AWS_ACCESS_KEY_ID) and, "
                        "for a custom S3 endpoint, '?endpoint_override=host:port&scheme=http' or "
                        f"{_env.S3_ENDPOINT_VAR}."
                    ) from exc
                logger.warning(
                    "storage %s does not answer (%s: %s); probing again for up to %.0f s more",
                    self.uri,
                    type(exc.__cause__ or exc).__name__,
                    exc.__cause__ or exc,
                    left,
                )
                time.sleep(min(pause, left))
                pause = min(2 * pause, 15.0)

    def _probe_once(self, retry: RetryPolicy) -> None:
        path = self.join(f".ray_goodput_probe-{uuid.uuid4().hex}")
        payload = b"ray_goodput probe"
        self._connect_to_endpoint()
        retry.call("probe mkdir", lambda: self.fs.create_dir(self.root, recursive=True))
        retry.call("probe write", lambda: self._write(path, payload))
        back = retry.call("probe read", lambda: self._read(path))
        retry.call("probe delete", lambda: self.fs.delete_file(path))
        if back != payload:
            raise StorageUnusableError(f"storage {self.uri!r} returned different bytes than written")


def _outage_like(exc: BaseException) -> bool:
    """Whether a failed probe failed as an outage also fails: nothing accepting
    connections at the endpoint (``_connect_to_endpoint``'s one try, made to fail fast at
    a first start), or an error the retry policy retried to its end (``is_outage``)."""
    return isinstance(exc, ConnectionError) or is_outage(exc)


def resolve(uri: str | StorageLocation) -> StorageLocation:
    """Resolve ``uri`` to a :class:`StorageLocation`.

    Accepts a plain path, ``file://``, ``s3://`` (``?endpoint_override=host:port&scheme=http``
    for a custom endpoint, or the ``RAY_GOODPUT_S3_ENDPOINT`` variable), ``gs://``,
    ``hdfs://`` and anything else ``pyarrow.fs.FileSystem.from_uri`` knows. Does no I/O
    beyond what pyarrow needs to build the filesystem.
    """
    if isinstance(uri, StorageLocation):
        return uri
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError(f"storage_path must be a non-empty URI or path, got {uri!r}")
    uri = uri.strip()
    if "://" not in uri:
        fs = pafs.LocalFileSystem()
        root = posixpath.abspath(uri)
        return StorageLocation(uri=root, fs=fs, root=root)
    try:
        fs, root = pafs.FileSystem.from_uri(_with_delayed_open(_with_default_endpoint(uri)))
    except Exception as exc:
        raise ConfigError(
            f"cannot resolve storage URI {uri!r}: {exc}. Use a local path, file://, s3://bucket/"
            "prefix (with ?endpoint_override=host:port&scheme=http for a custom endpoint), "
            "gs://, or hdfs://."
        ) from exc
    return _location(uri.rstrip("/"), fs, root.rstrip("/"))
