"""Shared fixtures: a real S3 endpoint over HTTP (moto's server), real Ray clusters."""

from __future__ import annotations

import os
import uuid

import pytest

os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


class S3Server:
    """moto's S3 server in a subprocess, on a free loopback port."""

    def __init__(self) -> None:
        from ray_goodput.testing._s3 import start_moto_server

        self.proc, self.endpoint = start_moto_server()

    def bucket_uri(self, prefix: str = "") -> str:
        """A fresh bucket; returns an s3:// URI with the endpoint override."""
        import pyarrow.fs as pafs

        bucket = f"b-{uuid.uuid4().hex[:12]}"
        fs = pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http",
                               allow_bucket_creation=True)
        fs.create_dir(bucket)
        path = f"{bucket}/{prefix}".rstrip("/")
        return f"s3://{path}?endpoint_override={self.endpoint}&scheme=http"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server()
    yield server
    server.close()
