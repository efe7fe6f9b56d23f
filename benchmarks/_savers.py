"""Ray Train's own ways to checkpoint, as the goodput benchmarks run them (shared by the
``s3-poisson`` and ``step-failures`` modes of ``goodput_under_failures.py``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch


class TorchSaveSync:
    """Rank 0 gathers the full state, torch.save()s it, ray.train.report(SYNC) uploads it."""

    def __init__(self, cfg: dict, model, optim) -> None:
        import torch.distributed as dist

        self.model, self.optim, self.rank = model, optim, dist.get_rank()
        self.stage = Path(cfg["stage"]) / f"rank-{self.rank}"
        self.stage.mkdir(parents=True, exist_ok=True)

    def restore(self) -> int:
        import ray.train
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            return 0
        with ckpt.as_directory() as d:  # every rank downloads it: no rank-0 broadcast on CPU
            blob = torch.load(os.path.join(d, "state.pt"), weights_only=False, mmap=True)
            set_state_dict(
                self.model,
                self.optim,
                model_state_dict=blob["model"],
                optim_state_dict=blob["optim"],
                options=StateDictOptions(full_state_dict=True),
            )
        dist.barrier()
        return int(blob["step"])

    def save(self, step: int) -> None:
        import ray.train
        from ray.train import Checkpoint, CheckpointUploadMode
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(
            self.model, self.optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        with tempfile.TemporaryDirectory(dir=self.stage) as d:
            ckpt = None
            if self.rank == 0:
                torch.save({"model": msd, "optim": osd, "step": step}, os.path.join(d, "state.pt"))
                ckpt = Checkpoint.from_directory(d)
            del msd, osd
            ray.train.report(
                {"step": step},
                checkpoint=ckpt,
                checkpoint_dir_name=f"step-{step:07d}",
                checkpoint_upload_mode=CheckpointUploadMode.SYNC,
            )

    def wait_durable(self) -> float | None:
        """Seconds this waited for the saves made so far to be durable: 0, the SYNC report
        returned after its upload."""
        return 0.0

    def close(self) -> dict:
        return {}


class RayAsyncDcp(TorchSaveSync):
    """Every rank dcp.save()s its shard into a local directory, then
    ray.train.report(checkpoint_upload_mode=ASYNC) uploads it in Ray's background thread."""

    def restore(self) -> int:
        import ray.train
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            return 0
        msd, osd = get_state_dict(self.model, self.optim)
        sd = {"model": msd, "optim": osd}
        with ckpt.as_directory() as d:
            dcp.load(sd, checkpoint_id=d)
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        dist.barrier()
        return int(Path(ckpt.path).name.split("-")[-1])

    def save(self, step: int) -> None:
        import ray.train
        import torch.distributed.checkpoint as dcp
        from ray.train import Checkpoint, CheckpointUploadMode
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.state_dict import get_state_dict

        name = f"step-{step:07d}"
        local = self.stage / name
        msd, osd = get_state_dict(self.model, self.optim)
        dcp.save({"model": msd, "optim": osd}, storage_writer=FileSystemWriter(str(local), sync_files=False))
        ray.train.report(
            {"step": step},
            checkpoint=Checkpoint.from_directory(str(local)),
            checkpoint_dir_name=name,
            checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
            delete_local_checkpoint_after_upload=True,
        )

    def wait_durable(self) -> float | None:
        """None: Ray Train gives the training loop no way to wait for an ASYNC upload."""
        return None
