"""The one place where ray_goodput reads environment variables."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

#: Overrides the node-local staging directory of checkpoints.
STAGING_DIR_VAR = "RAY_GOODPUT_STAGING_DIR"
#: Overrides the node-local data cache directory.
CACHE_DIR_VAR = "RAY_GOODPUT_CACHE_DIR"
#: Endpoint (``http://host:port``) used for ``s3://`` URIs that carry no ``endpoint_override``.
S3_ENDPOINT_VAR = "RAY_GOODPUT_S3_ENDPOINT"


def staging_root() -> Path:
    """Node-local directory under which checkpoint shards are staged."""
    value = os.environ.get(STAGING_DIR_VAR)
    return Path(value) if value else Path(tempfile.gettempdir()) / "ray_goodput" / "staging"


def cache_root() -> Path:
    """Node-local directory of the data cache."""
    value = os.environ.get(CACHE_DIR_VAR)
    return Path(value) if value else Path(tempfile.gettempdir()) / "ray_goodput" / "cache"


def s3_endpoint() -> str | None:
    """Default S3 endpoint override, or None for AWS."""
    return os.environ.get(S3_ENDPOINT_VAR) or None
