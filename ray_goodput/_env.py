"""The one place where ray_goodput reads environment variables."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

#: Overrides the node-local staging directory of checkpoints.
STAGING_DIR_VAR = "RAY_GOODPUT_STAGING_DIR"
#: Overrides the node-local data cache directory.
CACHE_DIR_VAR = "RAY_GOODPUT_CACHE_DIR"
#: Overrides the node-local directory of the goodput event spools (``goodput._events``).
EVENTS_SPOOL_DIR_VAR = "RAY_GOODPUT_EVENTS_SPOOL_DIR"
#: Endpoint (``http://host:port``) used for ``s3://`` URIs that carry no ``endpoint_override``.
S3_ENDPOINT_VAR = "RAY_GOODPUT_S3_ENDPOINT"
#: Fault injection for soaks and tests: ``name:probability[:action],...`` (see ``_faults``).
FAULT_VAR = "RAY_GOODPUT_FAULT"
#: Seed of the fault draws (each process adds its pid).
FAULT_SEED_VAR = "RAY_GOODPUT_FAULT_SEED"


def staging_root() -> Path:
    """Node-local directory under which checkpoint shards are staged."""
    value = os.environ.get(STAGING_DIR_VAR)
    return Path(value) if value else Path(tempfile.gettempdir()) / "ray_goodput" / "staging"


def cache_root() -> Path:
    """Node-local directory of the data cache."""
    value = os.environ.get(CACHE_DIR_VAR)
    return Path(value) if value else Path(tempfile.gettempdir()) / "ray_goodput" / "cache"


def user_dir() -> Path:
    """Node-local directory of this user's private files (``$TMPDIR/ray_goodput-<uid>``)."""
    return Path(tempfile.gettempdir()) / f"ray_goodput-{os.getuid()}"


def events_spool_dir() -> Path:
    """Node-local directory of the goodput event spools: this user's alone by default."""
    value = os.environ.get(EVENTS_SPOOL_DIR_VAR)
    return Path(value) if value else user_dir() / "goodput-spool"


def s3_endpoint() -> str | None:
    """Default S3 endpoint override, or None for AWS."""
    return os.environ.get(S3_ENDPOINT_VAR) or None


def fault_spec() -> str:
    """The raw fault-injection spec, empty when unset."""
    return os.environ.get(FAULT_VAR, "").strip()


def fault_seed() -> int | None:
    """The fault-draw seed, or None when unset."""
    value = os.environ.get(FAULT_SEED_VAR, "").strip()
    return int(value) if value else None
