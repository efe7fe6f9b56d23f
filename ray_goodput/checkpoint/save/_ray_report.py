"""Reporting committed checkpoints to Ray Train, in place or through a pointer checkpoint."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from ray_goodput.runtime import WorkerContext
from ray_goodput.storage import StorageLocation

POINTER_FILE = "ray_goodput_checkpoint.json"


def report_checkpoint(ctx: WorkerContext, step_loc: StorageLocation, metrics: dict[str, Any]) -> None:
    """Report a committed checkpoint to Ray Train (all ranks call; rank 0 passes it).

    A checkpoint inside the run directory is reported in place (NO_UPLOAD). One outside
    it (a custom ``storage_path``) cannot be, by Ray's rules: a small pointer checkpoint
    naming its URI is reported instead.
    """
    # Only Ray Train workers report, and they imported ray.train already; importing it
    # here keeps it (with pandas) out of processes that never report.
    import ray.train  # noqa: PLC0415 - see above
    from ray.train import CheckpointUploadMode  # noqa: PLC0415 - see above

    if ctx.rank != 0:
        ray.train.report(metrics, checkpoint=None, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
        return
    checkpoint = ray.train.Checkpoint(path=step_loc.root, filesystem=step_loc.fs)
    run_fs = ctx.run_storage.storage_filesystem
    managed = run_fs.equals(step_loc.fs) and step_loc.root.startswith(
        ctx.run_storage.experiment_fs_path.rstrip("/") + "/"
    )
    if managed:
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
        return
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, POINTER_FILE).write_text(json.dumps({"uri": step_loc.uri, "path": step_loc.root}))
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(tmp),
            checkpoint_dir_name=step_loc.root.rsplit("/", 1)[-1],
            checkpoint_upload_mode=CheckpointUploadMode.SYNC,
        )


def report_closed(step: int | None) -> None:
    """A last report when the Checkpointer closes and its final ``wait()`` reported no
    checkpoint (every rank calls), so the goodput callback sees the end."""
    import ray.train  # noqa: PLC0415 - see report_checkpoint

    ray.train.report({"step": step, "ray_goodput_closed": 1})
