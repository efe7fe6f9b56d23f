"""What the Checkpointer needs from its surroundings: rank, world, storage, reporting.

Inside a Ray Train worker these come from ``ray.train.get_context()``; under plain
``torch.distributed`` from the process group; otherwise a single process.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ray_goodput.errors import ConfigError
from ray_goodput.storage import StorageLocation, resolve

logger = logging.getLogger(__name__)

POINTER_FILE = "ray_goodput_checkpoint.json"


def _ray_train_context() -> Any | None:
    try:
        import ray.train  # noqa: PLC0415

        ctx = ray.train.get_context()
        ctx.get_world_rank()
        return ctx
    except Exception:  # noqa: BLE001 - not inside a Ray Train worker
        return None


@dataclass
class WorkerContext:
    rank: int
    world_size: int
    in_ray_train: bool
    run_storage: Any | None  # Ray Train StorageContext (DeveloperAPI) or None

    @staticmethod
    def detect() -> WorkerContext:
        ctx = _ray_train_context()
        if ctx is not None:
            return WorkerContext(rank=ctx.get_world_rank(), world_size=ctx.get_world_size(),
                                 in_ray_train=True, run_storage=ctx.get_storage())
        if dist.is_available() and dist.is_initialized():
            return WorkerContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                                 in_ray_train=False, run_storage=None)
        return WorkerContext(rank=0, world_size=1, in_ray_train=False, run_storage=None)

    def storage_root(self, storage_path: str | None) -> StorageLocation:
        """The checkpoint root: ``storage_path``, or the Ray Train run's directory."""
        if storage_path is not None:
            return resolve(storage_path)
        if self.run_storage is None:
            raise ConfigError(
                "Checkpointer(storage_path=None) needs a Ray Train run to take the storage "
                "from; outside Ray Train pass storage_path='s3://bucket/prefix' or a directory"
            )
        fs = self.run_storage.storage_filesystem
        root = self.run_storage.experiment_fs_path
        scheme = "" if fs.type_name == "local" else f"{fs.type_name}://"
        return StorageLocation(uri=f"{scheme}{root}", fs=fs, root=root)


def report_checkpoint(ctx: WorkerContext, step_loc: StorageLocation, metrics: dict[str, Any]) -> None:
    """Report a committed checkpoint to Ray Train (all ranks call; rank 0 passes it).

    A checkpoint inside the run directory is reported in place (NO_UPLOAD). One outside
    it (a custom ``storage_path``) cannot be, by Ray's rules: a small pointer checkpoint
    naming its URI is reported instead.
    """
    import ray.train  # noqa: PLC0415
    from ray.train import CheckpointUploadMode  # noqa: PLC0415

    if ctx.rank != 0:
        ray.train.report(metrics, checkpoint=None, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
        return
    checkpoint = ray.train.Checkpoint(path=step_loc.root, filesystem=step_loc.fs)
    run_fs = ctx.run_storage.storage_filesystem
    managed = (run_fs.equals(step_loc.fs)
               and step_loc.root.startswith(ctx.run_storage.experiment_fs_path.rstrip("/") + "/"))
    if managed:
        ray.train.report(metrics, checkpoint=checkpoint,
                         checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
        return
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, POINTER_FILE).write_text(json.dumps({"uri": step_loc.uri, "path": step_loc.root}))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                         checkpoint_dir_name=step_loc.root.rsplit("/", 1)[-1],
                         checkpoint_upload_mode=CheckpointUploadMode.SYNC)
