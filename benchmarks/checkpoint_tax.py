"""Checkpoint tax: how long training is blocked, and how long until a save is durable.

Compares, on 2 ranks of a ``ray_goodput.TorchTrainer`` (Ray's, which also starts the node
uploaders; ``--trainer ray``: Ray Train's own ``TorchTrainer``, where each Checkpointer
starts its node's uploader itself), gloo on CPU, for one state shape (``--shape``):

  * ``objects`` (default): an FSDP2-sharded model and its AdamW, passed as the objects
    (each rank holds its own distinct shard of model + AdamW state)
  * ``state_dicts``: the same, passed as ``{"model": model.state_dict(), "optim":
    optim.state_dict()}`` (DTensors in plain dicts)
  * ``tensor_dict``: ``{"params": {"0": t0, ..., "3": t3}}``, the same four fp32 tensors on
    every rank (replicated, as a DDP job's)

each way to checkpoint:

  * ``torch.save`` of the gathered full state on rank 0 (S3: to a local file, then uploaded)
  * DCP ``dcp.save`` (S3: DCP into a local dir, then each rank uploads its files)
  * DCP ``dcp.async_save`` (thread executor; S3: a per-rank background thread waits for
    the DCP future, then uploads the rank's files)
  * Ray Train ``ray.train.report(checkpoint=..., checkpoint_upload_mode=SYNC / ASYNC)``
    (each rank DCP-saves its shard into its own local dir and reports it; Ray merges
    them into one directory in the run's storage)
  * ray_goodput ``Checkpointer.save`` (uploader actor; durable = COMMITTED marker seen)

and the floors, measured in the same run, interleaved with the methods:

  * copy floor: ``torch.empty_like(t).copy_(t)`` over all of the rank's tensors (both ranks
    at once); also a copy into preallocated buffers (reported, not used as the floor)
  * upload floor: the rank's bytes written from memory with pyarrow to one file per rank,
    both ranks in parallel, 8 MiB writes (the same write size as ray_goodput's uploads)

Then, with ``--burst N``, saves faster than uploads: N saves ``--burst-gap-ms`` apart
(training steps between them) with ray_goodput, DCP ``async_save`` (which waits for the
previous save before it starts the next, as torchtitan does) and Ray Train's ASYNC report,
each save's blocking against the copy floor. Then the slowdown of a compute-bound step
(~100 ms, calibrated) while a ray_goodput save is being written/uploaded in the
background. Then the read: ``--saves`` rounds of ``Checkpointer.restore`` of the newest
committed checkpoint by a new Checkpointer (as a
restarted worker makes), once with a fresh staging dir (every file from storage) and once
with the staging dir the save left; each once as a first attempt does (rank 0 finds the
newest checkpoint) and once with the step decided by the driver, as ``Recovery`` decides it
for a restarted worker group; against plain reads of the same files (the rank's
``.metadata``, data file and RNG extras) from the same storage and from the node-local
copy. Starts its own moto S3 server (a subprocess at the Ray workers' niceness, 15: it
stands in for remote storage, and at niceness 0 it would outrank the training processes
for the shared cores) and its own Ray. Prints markdown tables and each target's verdict
(MET / MISSED against ``benchmarks/targets.toml``), and writes the results to
``benchmarks/results/checkpoint_tax_<cpu|cuda_gpu>.json`` (``--out``).

    python benchmarks/checkpoint_tax.py                         # defaults: 256 MB/rank, 3 saves
    python benchmarks/checkpoint_tax.py --mb-per-rank 64 --saves 2   # quick mode
    python benchmarks/checkpoint_tax.py --shape state_dicts --storage s3 --burst 4 --out ...
    python benchmarks/checkpoint_tax.py --device cuda --params 1e9 --storage local
    python benchmarks/checkpoint_tax.py --render benchmarks/results/checkpoint_tax_cpu.json

``--device cuda``: a >=1B-parameter model with bf16 weights, fp32 master weights and fp32
AdamW state (14 bytes/parameter), one rank per GPU (at most 2; one rank on a 1-GPU
machine); reports the ray_goodput staging (device-to-host) time against measured D2H
copy bandwidth into pinned, preallocated pageable and fresh pageable host memory.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _results
import _targets
import psutil
import ray
import ray.train
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ray.train import CheckpointConsistencyMode, CheckpointUploadMode
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ray_goodput.storage._durable import fsync_dir, fsync_file
from ray_goodput.testing._s3 import start_moto_server

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

CHUNK = 8 << 20
CPU_METHODS = ["torch_save", "dcp_sync", "dcp_async", "rt_sync", "rt_async", "rg"]
CUDA_METHODS = ["dcp_async", "rg"]
SHAPES = ["objects", "state_dicts", "tensor_dict"]
BURST_METHODS = ["rg", "dcp_async", "rt_async"]
#: The methods that take any state dict (torch_save gathers the model and optimizer objects).
ANY_SHAPE_METHODS = ["dcp_sync", "dcp_async", "rt_sync", "rt_async", "rg"]
LABELS = {
    "copy_floor": "floor: in-memory copy (empty_like+copy_)",
    "copy_warm": "  (copy into preallocated buffers)",
    "d2h_pinned": "  (D2H into preallocated pinned buffers)",
    "upload_floor": "floor: plain pyarrow write/upload, 1 file/rank",
    "upload_floor_fsync": "  (local: the same write + fsync of the file and its directory)",
    "torch_save": "torch.save full state, rank 0",
    "dcp_sync": "DCP dcp.save (sync)",
    "dcp_async": "DCP dcp.async_save (thread)",
    "rt_sync": "Ray Train report SYNC",
    "rt_async": "Ray Train report ASYNC",
    "rg": "ray_goodput Checkpointer.save",
    "rg_wall": "  (ray_goodput: wall time of the save() call)",
}
TABLE_KEYS = [
    "copy_floor",
    "copy_warm",
    "d2h_pinned",
    "upload_floor",
    "upload_floor_fsync",
    "torch_save",
    "dcp_sync",
    "dcp_async",
    "rt_sync",
    "rt_async",
    "rg",
    "rg_wall",
]
TARGETS = _targets.load("checkpoint_tax")  # read by the report only (the driver), never by a worker


# ----------------------------------------------------------------------------- storage helpers


def s3fs(endpoint: str):
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", allow_bucket_creation=True)


def _storage(cfg: dict) -> tuple[Any, str]:
    """(pyarrow filesystem, base path) where the non-Ray-Train methods write."""
    import pyarrow.fs as pafs

    if cfg["storage"] == "s3":
        return s3fs(cfg["endpoint"]), f"{cfg['bucket']}/other"
    return pafs.LocalFileSystem(), os.path.join(cfg["work"], "storage_other")


RETRIES: list[str] = []


def _retried(fn):
    """moto 5.2.5 now and then answers CompleteMultipartUpload of a large object with
    INTERNAL_FAILURE; retry like any S3 client would (ray_goodput retries too). Retries
    are counted in the results and included in the measured time."""

    def run(*args):
        for attempt in range(3):
            try:
                return fn(*args)
            except OSError as exc:
                if attempt == 2 or "INTERNAL_FAILURE" not in str(exc):
                    raise
                RETRIES.append(f"{fn.__name__}: {exc}"[:200])

    return run


@_retried
def _write_views(fs, dest: str, views) -> int:
    """Write byte views to ``dest`` in CHUNK-sized writes (one stream)."""
    n = 0
    with fs.open_output_stream(dest) as out:
        for mv in views:
            for off in range(0, len(mv), CHUNK):
                out.write(mv[off : off + CHUNK])
            n += len(mv)
    return n


@_retried
def _upload_file(fs, local: Path, dest: str) -> int:
    n = 0
    with open(local, "rb") as src, fs.open_output_stream(dest) as out:
        while chunk := src.read(CHUNK):
            out.write(chunk)
            n += len(chunk)
    return n


def _upload_rank_files(fs, local_dir: Path, dest_dir: str, rank: int) -> int:
    """Upload this rank's DCP files (``__<rank>_*``; rank 0 also ``.metadata``)."""
    if fs.type_name == "local":
        fs.create_dir(dest_dir, recursive=True)
    n = 0
    for p in sorted(local_dir.iterdir()):
        if p.name.startswith(f"__{rank}_") or (rank == 0 and p.name == ".metadata"):
            n += _upload_file(fs, p, f"{dest_dir}/{p.name}")
    return n


def _byte_view(t):
    return memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy())


# ----------------------------------------------------------------------------- model state


def _build_modules(cfg: dict, world: int) -> tuple[dict, Any]:
    """({name: module}, the module AdamW trains), before sharding."""
    from torch import nn

    dev = cfg["device"]
    if dev == "cpu":
        # fp32 params + exp_avg + exp_avg_sq = 12 bytes/param; total over ranks.
        d = 2048
        params = cfg["mb_per_rank"] * 2**20 * world / 12
        layers = max(2, round(params / (d * d)))
        model = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(layers)])
        return {"model": model}, model
    d = 4096
    layers = max(1, math.ceil(cfg["params"] / (d * d)))
    with torch.device(dev):
        model = nn.Sequential(*[nn.Linear(d, d, bias=False, dtype=torch.bfloat16) for _ in range(layers)])
        master = nn.Sequential(*[nn.Linear(d, d, bias=False, dtype=torch.float32) for _ in range(layers)])
    return {"model": model, "master": master}, master


def _build_state(cfg: dict, world: int) -> tuple[dict, Any]:
    """FSDP2-sharded model + AdamW with materialized state. Returns (state, trained module)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    modules, trainable = _build_modules(cfg, world)
    if world > 1:
        mesh = init_device_mesh(cfg["device"], (world,))
        for m in modules.values():
            for layer in m:
                fully_shard(layer, mesh=mesh)
            fully_shard(m, mesh=mesh)
    optim = torch.optim.AdamW(trainable.parameters(), lr=1e-4, foreach=False)
    # Materialize the AdamW state (exp_avg, exp_avg_sq) with one step on zero gradients.
    for p in trainable.parameters():
        p.grad = torch.zeros_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return {**modules, "optim": optim}, trainable


def _sharded_sd(state: dict) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    mods = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    sd = {k: get_model_state_dict(m) for k, m in mods.items()}
    owner = mods.get("master", mods.get("model"))
    sd["optim"] = get_optimizer_state_dict(owner, state["optim"])
    return sd


def _walk_tensors(x, out: list) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        out.append(x.to_local())
    elif isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, dict):
        for v in x.values():
            _walk_tensors(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _walk_tensors(v, out)


def _local_tensors(sd: dict) -> list:
    """The rank's tensors (local shards) of a DCP state dict."""
    out: list = []
    _walk_tensors(sd, out)  # modules first, then the optimizer state
    return out


def _tensor_dict(cfg: dict) -> dict:
    """``{"params": {"0": t0, ..., "3": t3}}``: ``mb_per_rank`` MiB of fp32, the same on every
    rank (seeded), as a replicated (DDP) job holds it."""
    gen = torch.Generator().manual_seed(0)
    n = cfg["mb_per_rank"] * 2**20 // 4 // 4
    return {"params": {str(i): torch.randn(n, generator=gen) for i in range(4)}}


# ----------------------------------------------------------------------------- one rank's bench


class _Bench:
    """What every measurement on one rank shares: the state, where it writes, the results."""

    def __init__(self, cfg: dict) -> None:
        from ray_goodput import Checkpointer

        torch.set_num_threads(1 if cfg["device"] == "cpu" else 4)
        self.cfg, self.dev, self.s3 = cfg, cfg["device"], cfg["storage"] == "s3"
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.dev == "cuda":
            torch.cuda.set_device(ray.train.get_context().get_local_rank())
        self.shape = cfg.get("shape", "objects")
        if self.shape == "tensor_dict":
            self.state, self.trainable = _tensor_dict(cfg), None
        else:
            self.state, self.trainable = _build_state(cfg, self.world)
        self.tensors = _local_tensors(self.dcp_sd())
        self.rank_bytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.fs, self.base = _storage(cfg)
        self.stage = Path(cfg["work"]) / "stage"
        self.stage.mkdir(parents=True, exist_ok=True)
        self.run_dir = ray.train.get_context().get_storage().experiment_fs_path
        self.warm = [torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t) for t in self.tensors]
        self.pinned = None
        if self.dev == "cuda":
            self.pinned = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True) for t in self.tensors]
        self.ckpt = Checkpointer(keep_last=1, staging_dir=str(Path(cfg["work"]) / "rg_staging"))
        # As a training script does before its loop (nothing to load here): it also gets
        # the first save ready (the owner plan, the arena's pages, the uploader connection).
        self.ckpt.restore(self.state)
        self.stager = None  # DCP's async stager, made by the first dcp_async save
        self.last_save_cpu = (0.0, 0.0)  # see _rg_save
        self.attempts_made = 0  # restores measured with a driver decision (each a new attempt)
        self.stagers_made = 0
        # dcp.async_save's collectives run in a background thread: on a group of their own,
        # never interleaved with training's on the default group (as torchtitan does).
        self.async_group = dist.new_group(backend="gloo")
        self.rg_step = 0
        self.results: dict[str, dict[str, list[float]]] = {}
        self.restores: dict[str, list[float]] = {}  # restore phase: seconds (or counts) per round

    def saved(self) -> dict:
        """What ``Checkpointer.save``/``restore`` get, as a user with this state shape writes it."""
        if self.shape == "state_dicts":
            return {"model": self.state["model"].state_dict(), "optim": self.state["optim"].state_dict()}
        return self.state

    def dcp_sd(self) -> dict:
        """What DCP and Ray Train's report save: the same tensors as ``saved()``."""
        return _sharded_sd(self.state) if self.shape == "objects" else self.saved()

    def sync(self) -> None:
        if self.dev == "cuda":
            torch.cuda.synchronize()

    def start(self) -> float:
        """All ranks start a measurement together; returns its start time."""
        self.sync()
        dist.barrier()
        return time.perf_counter()

    def allmax(self, x: float) -> float:
        """The slowest rank's value: a save is done when its last rank is."""
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def record_restore(self, name: str, value: float) -> None:
        self.restores.setdefault(name, []).append(value)

    def record(self, name: str, blocked: float | None, durable: float | None) -> None:
        r = self.results.setdefault(name, {"blocked": [], "durable": []})
        if blocked is not None:
            r["blocked"].append(blocked)
        if durable is not None:
            r["durable"].append(durable)

    def host_views(self) -> list:
        """Byte views of the rank's state in host memory (CUDA: the pinned copies)."""
        return [_byte_view(t) for t in (self.tensors if self.dev == "cpu" else self.pinned)]

    def dest_dir(self, name: str) -> str:
        """A fresh destination directory for plain writes (local storage needs it made)."""
        dest = f"{self.base}/{name}"
        if not self.s3:
            self.fs.create_dir(dest, recursive=True)
        return dest

    def dcp_dirs(self, name: str) -> tuple[str, Path]:
        """(destination, where DCP writes): S3 has DCP write locally, then upload."""
        dest = f"{self.base}/{name}"
        return dest, (self.stage / name if self.s3 else Path(dest))

    def rm_dcp(self, dest: str, local: Path) -> None:
        if self.s3:
            shutil.rmtree(local, ignore_errors=True)
        self.rm_remote(dest)

    def rm_remote(self, path: str) -> None:
        dist.barrier()
        if self.rank == 0:
            try:
                if self.s3:
                    self.fs.delete_dir(path)
                else:
                    shutil.rmtree(path, ignore_errors=True)
            except Exception:  # noqa: BLE001 - best effort cleanup
                pass
        dist.barrier()

    def train_step(self) -> None:
        """Mutate the state between saves (what training does): one AdamW step (a tensor
        dict: an in-place add)."""
        if self.trainable is None:
            for t in self.tensors:
                t.add_(1e-3)
            return
        for p in self.trainable.parameters():
            p.grad = torch.full_like(p, 1e-3)
        self.state["optim"].step()
        self.state["optim"].zero_grad(set_to_none=True)


def _timed(b: _Bench, body: Callable[[], Any]) -> float:
    """Seconds of ``body`` on this rank, started together with the other ranks."""
    t0 = b.start()
    body()
    b.sync()
    return time.perf_counter() - t0


def _copy_into(dst: list, src: list, non_blocking: bool) -> None:
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=non_blocking)


# ----------------------------------------------------------------------------- floors


def m_copy_floor(b: _Bench, i: int) -> None:
    copies: list = []  # kept until all copies are timed, as a save's staging copy would be
    fresh = _timed(b, lambda: copies.extend(torch.empty_like(t, device="cpu").copy_(t) for t in b.tensors))
    warm = _timed(b, lambda: _copy_into(b.warm, b.tensors, non_blocking=False))
    pinned = None
    if b.pinned is not None:
        pinned = _timed(b, lambda: _copy_into(b.pinned, b.tensors, non_blocking=True))
    copies.clear()
    b.record("copy_floor", b.allmax(fresh), None)
    b.record("copy_warm", b.allmax(warm), None)
    if pinned is not None:
        b.record("d2h_pinned", b.allmax(pinned), None)


def m_upload_floor(b: _Bench, i: int) -> None:
    dest = b.dest_dir(f"floor-{i}")
    t0 = b.start()
    _write_views(b.fs, f"{dest}/rank-{b.rank}.bin", b.host_views())
    b.record("upload_floor", None, b.allmax(time.perf_counter() - t0))
    if not b.s3:
        # What "durable" means on a file system (ray_goodput fsyncs each file and its
        # directory): the same write, then fsync. Shown beside the plain write, the target's floor.
        t0 = b.start()
        _write_views(b.fs, f"{dest}/rank-{b.rank}-synced.bin", b.host_views())
        fsync_file(f"{dest}/rank-{b.rank}-synced.bin")
        fsync_dir(dest)
        b.record("upload_floor_fsync", None, b.allmax(time.perf_counter() - t0))
    b.rm_remote(dest)


# ----------------------------------------------------------------------------- methods


def _torch_save_rank0(b: _Bench, obj: dict, dest: str, i: int) -> None:
    if not b.s3:
        torch.save(obj, f"{dest}/model.pt")
        return
    # torch.save straight into a pyarrow S3 stream hands pyarrow writes larger than
    # its part size; moto 5.2.5 then fails CompleteMultipartUpload (INTERNAL_FAILURE)
    # now and then. So: torch.save to a local file, then upload it in 8 MiB writes.
    tmp = b.stage / f"torch-save-{i}.pt"
    torch.save(obj, tmp)
    _upload_file(b.fs, tmp, f"{dest}/model.pt")
    tmp.unlink()


def m_torch_save(b: _Bench, i: int) -> None:
    dest = f"{b.base}/torch-save-{i}"
    if b.rank == 0 and not b.s3:
        b.fs.create_dir(dest, recursive=True)
    t0 = b.start()
    msd, osd = get_state_dict(
        b.trainable, b.state["optim"], options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    obj = None  # rank 0 frees the gathered state after the measurement, not inside it
    if b.rank == 0:
        obj = {"model": msd, "optim": osd}
        _torch_save_rank0(b, obj, dest, i)
    del msd, osd
    dist.barrier()
    el = b.allmax(time.perf_counter() - t0)
    b.record("torch_save", el, el)
    b.rm_remote(dest)
    del obj


def m_dcp_sync(b: _Bench, i: int) -> None:
    dest, local = b.dcp_dirs(f"dcp-sync-{i}")
    t0 = b.start()
    dcp.save(b.dcp_sd(), storage_writer=FileSystemWriter(local, sync_files=False))
    if b.s3:
        _upload_rank_files(b.fs, local, dest, b.rank)
    dist.barrier()
    el = b.allmax(time.perf_counter() - t0)
    b.record("dcp_sync", el, el)
    b.rm_dcp(dest, local)


def _dcp_stager(b: _Bench):
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # torch 2.11's async_save closed a stager it was given once the save was done (2.13
    # leaves that to the caller; versions between were not tried), and a closed one cannot
    # stage again (its copy table is emptied): then each save gets a new stager, which
    # allocates its buffers anew. If torch renames that table, a closed stager is reused
    # and its save fails loudly (the error is re-raised).
    closed = b.stager is not None and not getattr(
        getattr(b.stager, "_state_dict_stager", None), "_deepcopy_dispatch", True
    )
    if b.stager is None or closed:
        # CPU: no accelerator -> no pinned memory, no async (stream) staging, no
        # non-blocking copies. CUDA: DCP's defaults (pinned, shared memory, async).
        b.stager = DefaultStager(StagingOptions(False, False, False, False)) if b.dev == "cpu" else DefaultStager()
        b.stagers_made += 1
    return b.stager


def _finish_in_background(b: _Bench, fut, local: Path, dest: str) -> Callable[[], float]:
    """Wait for DCP's write (then upload the rank's files, S3) in a thread; returns a join
    that gives when that finished (re-raising its error in the caller's thread).

    The main thread joins rather than waits itself so it makes no collective while DCP's
    thread uses the process group."""
    done: dict[str, Any] = {}

    def finish() -> None:
        try:
            fut.result()
            if b.s3:
                _upload_rank_files(b.fs, local, dest, b.rank)
            done["t"] = time.perf_counter()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            done["error"] = exc

    th = threading.Thread(target=finish, daemon=True)
    th.start()

    def join() -> float:
        th.join()
        if "error" in done:
            raise done["error"]
        return done["t"]

    return join


def _dcp_async_staged(b: _Bench, stager, local: Path):
    """Start DCP's ``async_save`` of the rank's state into ``local`` and return once it is
    staged (the state may be mutated only then): the future of its write."""
    resp = dcp.async_save(
        b.dcp_sd(),
        storage_writer=FileSystemWriter(local, sync_files=False),
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
        async_stager=stager,
        process_group=b.async_group,
    )
    staged = getattr(resp, "staging_completion", None)
    if staged is not None:
        staged.result()
    return getattr(resp, "upload_completion", resp)


def m_dcp_async(b: _Bench, i: int) -> None:
    stager = _dcp_stager(b)
    dest, local = b.dcp_dirs(f"dcp-async-{i}")
    t0 = b.start()
    fut = _dcp_async_staged(b, stager, local)
    blocked = time.perf_counter() - t0
    durable_at = _finish_in_background(b, fut, local, dest)()
    b.record("dcp_async", b.allmax(blocked), b.allmax(durable_at - t0))
    b.rm_dcp(dest, local)


def _m_ray_train(b: _Bench, i: int, mode: CheckpointUploadMode) -> None:
    name = f"rt-{mode.value.lower()}-{i:03d}"
    local = b.stage / name / f"rank-{b.rank}"
    t0 = b.start()
    dcp.save(b.dcp_sd(), storage_writer=FileSystemWriter(local, sync_files=False))
    ray.train.report(
        {"i": i},
        checkpoint=ray.train.Checkpoint.from_directory(str(local)),
        checkpoint_dir_name=name,
        checkpoint_upload_mode=mode,
        delete_local_checkpoint_after_upload=False,
    )
    blocked = time.perf_counter() - t0
    if mode == CheckpointUploadMode.ASYNC:
        ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
    durable = time.perf_counter() - t0
    key = "rt_sync" if mode == CheckpointUploadMode.SYNC else "rt_async"
    b.record(key, b.allmax(blocked), b.allmax(durable))
    shutil.rmtree(b.stage / name, ignore_errors=True)
    b.rm_remote(f"{b.run_dir}/{name}")


def m_rt_sync(b: _Bench, i: int) -> None:
    _m_ray_train(b, i, CheckpointUploadMode.SYNC)


def m_rt_async(b: _Bench, i: int) -> None:
    _m_ray_train(b, i, CheckpointUploadMode.ASYNC)


def _rg_save(b: _Bench) -> tuple[float, float, float]:
    """(save() wall, stats.last_block_seconds, t0) of one save; durable not awaited.
    ``b.last_save_cpu``: the calling thread's (on CPU, in save(): torch copies on it with
    one thread on CPU; waiting runnable for a core) seconds, to tell a save's own work
    from its waits for a core and from its waits on a lock or I/O (the rest)."""
    b.rg_step += 1
    t0 = b.start()
    c0 = _thread_schedstat()
    b.ckpt.save(b.rg_step, b.saved())
    wall = time.perf_counter() - t0
    c1 = _thread_schedstat()
    b.last_save_cpu = (c1[0] - c0[0], c1[1] - c0[1])
    return wall, b.ckpt.stats.last_block_seconds, t0


def _thread_schedstat() -> tuple[float, float]:
    """This thread's (seconds on CPU, seconds runnable but waiting for a core) so far, from
    Linux's schedstat; (thread CPU time, 0) where it is missing."""
    try:
        on_cpu, run_delay, _ = Path("/proc/thread-self/schedstat").read_text().split()
        return int(on_cpu) / 1e9, int(run_delay) / 1e9
    except (OSError, ValueError):
        return time.thread_time(), 0.0


def _rg_committed(b: _Bench, step: int) -> bool:
    from ray_goodput.checkpoint.protocol._catalog import step_location
    from ray_goodput.checkpoint.protocol._manifest import read_manifest

    return read_manifest(step_location(b.ckpt.root, step)) is not None


def _process_schedstat(pid: int | None) -> tuple[float, float]:
    """(seconds on a core, seconds runnable waiting for one) of process ``pid``'s threads so
    far, from Linux's schedstat; (0, 0) without a pid (a thread that ends meanwhile takes
    its share along)."""
    on_cpu = run_delay = 0.0
    tasks = Path(f"/proc/{pid}/task")
    for task in tasks.iterdir() if pid is not None and tasks.is_dir() else ():
        try:
            on, delay, _ = (task / "schedstat").read_text().split()
        except (OSError, ValueError):
            continue
        on_cpu, run_delay = on_cpu + int(on) / 1e9, run_delay + int(delay) / 1e9
    return on_cpu, run_delay


def _uploader_pid(b: _Bench) -> int | None:
    """Rank 0: the pid of the node uploader both ranks hand their saves to (one node)."""
    actor = getattr(b.ckpt._uploader, "_actor", None)
    if b.rank != 0 or actor is None:
        return None
    return ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=60)


def m_rg(b: _Bench, i: int) -> None:
    started = time.time() - time.perf_counter()  # wall clock at perf_counter 0 (same host)
    pid = _uploader_pid(b)
    up0 = _process_schedstat(pid)
    wall, block, t0 = _rg_save(b)
    # Durable = when the COMMITTED write returned, in the job that wrote it (its wall clock,
    # this host's). Polling storage for it instead (every 25 ms, before the sixteenth
    # round) added up to a poll period and ~40 requests/s to the one S3 server process the
    # upload shares 2 cores with; the upload floor is timed to its write's return, unpolled.
    res = b.ckpt._pending[b.rg_step].handoff.durable.result()  # the job's result
    first_commit = -b.allmax(-res.committed_at if res.committed_at is not None else -math.inf)
    if not math.isfinite(first_commit) or not _rg_committed(b, b.rg_step):
        raise RuntimeError(f"ray_goodput step {b.rg_step}: no job of any rank committed it")
    durable = first_commit - started - t0
    up1 = _process_schedstat(pid)  # the uploader over this save's write, upload and commit
    # Off the save path: the outcome agreement and Ray Train report run in wait().
    t_wait = time.perf_counter()
    b.ckpt.wait()
    b.record("rg_wait_sync", b.allmax(time.perf_counter() - t_wait), None)
    b.record("rg", b.allmax(block), b.allmax(durable))
    b.record("rg_wall", b.allmax(wall), None)
    b.record("rg_write", b.allmax(res.write_seconds), None)
    b.record("rg_upload", b.allmax(res.upload_seconds), None)
    b.record("rg_uploader_on_cpu", b.allmax(up1[0] - up0[0]), None)
    b.record("rg_uploader_runnable", b.allmax(up1[1] - up0[1]), None)


MEASURES: dict[str, Callable[[_Bench, int], None]] = {
    "copy_floor": m_copy_floor,
    "upload_floor": m_upload_floor,
    "torch_save": m_torch_save,
    "dcp_sync": m_dcp_sync,
    "dcp_async": m_dcp_async,
    "rt_sync": m_rt_sync,
    "rt_async": m_rt_async,
    "rg": m_rg,
}


def run_rounds(b: _Bench) -> list[str]:
    """Each method once per round, floors included; returns rank 0's progress log."""
    order = ["copy_floor", "upload_floor", *b.cfg["methods"]]
    log: list[str] = []
    for i in range(b.cfg["saves"]):
        # Rotate the order every round so no method always runs right after the same one.
        rot = order[i % len(order) :] + order[: i % len(order)]
        for name in rot:
            gc.collect()
            t = time.perf_counter()
            MEASURES[name](b, i)
            if b.rank == 0:
                log.append(f"round {i} {name}: {time.perf_counter() - t:.1f}s")
                print(log[-1], flush=True)
        b.train_step()
    return log


# ----------------------------------------------------------------------------- saves faster than uploads


def _between_saves(b: _Bench, gap_s: float) -> None:
    """Training between two saves of a burst: one step, then the rest of ``gap_s`` idle
    (compute would compete with the uploads for the same cores; the idle gap gives the
    uploads every chance, so what a save blocks is its own cost)."""
    t0 = time.perf_counter()
    b.train_step()
    time.sleep(max(0.0, gap_s - (time.perf_counter() - t0)))


def burst_rg(b: _Bench, n: int, gap_s: float) -> None:
    blocked, cpu = [], []
    t_first = b.start()
    for k in range(n):
        _, block, _ = _rg_save(b)
        pairs: list[tuple[float, tuple[float, float]]] = [(0.0, (0.0, 0.0))] * b.world
        dist.all_gather_object(pairs, (block, b.last_save_cpu))
        slowest = max(pairs)  # the slowest rank's blocking, with its on-CPU and runnable shares
        blocked.append(slowest[0])
        cpu.append(slowest[1])
        if k < n - 1:
            _between_saves(b, gap_s)
    b.ckpt.wait()
    r = b.results.setdefault("burst_rg", {"blocked": [], "durable": []})
    r["blocked"] += blocked
    r.setdefault("cpu", []).extend(cpu)
    r["durable"].append(b.allmax(time.perf_counter() - t_first))
    r.setdefault("superseded", []).append(len(b.ckpt.stats.superseded))


def burst_dcp_async(b: _Bench, n: int, gap_s: float) -> None:
    """DCP's async_save, one in flight at a time: each save first waits for the previous
    one to be durable (DCP keeps no queue; torchtitan waits likewise)."""
    stager = _dcp_stager(b)
    blocked, prev, dests = [], None, []
    t_first = b.start()
    for k in range(n):
        dest, local = b.dcp_dirs(f"dcp-burst-{k}")
        dests.append((dest, local))
        t0 = b.start()
        if prev is not None:
            prev()
        fut = _dcp_async_staged(b, stager, local)
        blocked.append(b.allmax(time.perf_counter() - t0))
        prev = _finish_in_background(b, fut, local, dest)
        if k < n - 1:
            _between_saves(b, gap_s)
    prev()
    r = b.results.setdefault("burst_dcp_async", {"blocked": [], "durable": []})
    r["blocked"] += blocked
    r["durable"].append(b.allmax(time.perf_counter() - t_first))
    for dest, local in dests:
        b.rm_dcp(dest, local)


def burst_rt_async(b: _Bench, n: int, gap_s: float) -> None:
    blocked, names = [], []
    t_first = b.start()
    for k in range(n):
        name = f"rt-burst-{b.rg_step}-{k:03d}"
        names.append(name)
        local = b.stage / name / f"rank-{b.rank}"
        t0 = b.start()
        dcp.save(b.dcp_sd(), storage_writer=FileSystemWriter(local, sync_files=False))
        ray.train.report(
            {"burst": k},
            checkpoint=ray.train.Checkpoint.from_directory(str(local)),
            checkpoint_dir_name=name,
            checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
            delete_local_checkpoint_after_upload=False,
        )
        blocked.append(b.allmax(time.perf_counter() - t0))
        if k < n - 1:
            _between_saves(b, gap_s)
    ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
    r = b.results.setdefault("burst_rt_async", {"blocked": [], "durable": []})
    r["blocked"] += blocked
    r["durable"].append(b.allmax(time.perf_counter() - t_first))
    for name in names:
        shutil.rmtree(b.stage / name, ignore_errors=True)
        b.rm_remote(f"{b.run_dir}/{name}")


BURSTS: dict[str, Callable[[_Bench, int, float], None]] = {
    "rg": burst_rg,
    "dcp_async": burst_dcp_async,
    "rt_async": burst_rt_async,
}


def measure_burst(b: _Bench) -> list[str]:
    """``--burst`` saves ``--burst-gap-ms`` apart per method (and a copy floor before each),
    ``--saves`` rounds in rotating order; returns rank 0's progress log."""
    n, gap_s, log = b.cfg["burst"], b.cfg["burst_gap_s"], []
    order = [m for m in BURST_METHODS if m in b.cfg["methods"]]
    for i in range(b.cfg["saves"] if n else 0):
        for name in order[i % len(order) :] + order[: i % len(order)]:
            gc.collect()
            m_copy_floor(b, i)
            t = time.perf_counter()
            BURSTS[name](b, n, gap_s)
            if b.rank == 0:
                log.append(f"burst round {i} {name}: {time.perf_counter() - t:.1f}s")
                print(log[-1], flush=True)
    return log


# ----------------------------------------------------------------------------- step slowdown


def _compute_step(b: _Bench, x, ws: list) -> float:
    """One compute-bound training step (forward, backward, a lockstep all-reduce); seconds."""
    t0 = time.perf_counter()
    y = x
    for w in ws:
        y = torch.tanh(y @ w)
    y.sum().backward()
    for w in ws:
        w.grad = None
    b.sync()
    dist.all_reduce(torch.zeros(1))  # data-parallel lockstep, like a DDP step
    return time.perf_counter() - t0


def _calibrated_step(b: _Bench) -> tuple[Callable[[], float], int]:
    """(a step of about cfg["step_s"] seconds, its layer count), the same on all ranks."""
    width = 1024 if b.dev == "cpu" else 8192
    x = torch.randn(256 if b.dev == "cpu" else 8192, width, device=b.dev)

    def weights(n: int) -> list:
        return [(torch.randn(width, width, device=b.dev) * 0.03).requires_grad_() for _ in range(n)]

    step = functools.partial(_compute_step, b, x, weights(1))
    for _ in range(3):
        step()
    one = statistics.median(step() for _ in range(5))
    n = torch.tensor([min(200, max(1, round(b.cfg["step_s"] / one)))])
    dist.broadcast(n, 0)
    step = functools.partial(_compute_step, b, x, weights(int(n.item())))
    for _ in range(3):
        step()
    return step, int(n.item())


def _steps_while(step: Callable[[], float], busy: Callable[[], bool]) -> list[float]:
    """Compute steps until ``busy()`` is False on every rank (checked between steps)."""
    times = []
    while True:
        times.append(step())
        f = torch.tensor([0.0 if busy() else 1.0])
        dist.all_reduce(f, op=dist.ReduceOp.MIN)
        if f.item() == 1.0:
            return times


def _steps_during_rg_save(b: _Bench, step: Callable[[], float]) -> list[float]:
    """Steps while a ray_goodput save is written, uploaded and committed."""
    _rg_save(b)
    saved = b.rg_step
    times = _steps_while(step, lambda: b.rank == 0 and not _rg_committed(b, saved))
    b.ckpt.wait()
    return times


def _steps_during_plain_upload(b: _Bench, step: Callable[[], float], r: int) -> list[float]:
    """Reference: steps while a background thread writes the same bytes with plain pyarrow."""
    dest = b.dest_dir(f"slow-floor-{r}")
    dist.barrier()
    th = threading.Thread(target=_write_views, args=(b.fs, f"{dest}/rank-{b.rank}.bin", b.host_views()))
    th.start()
    times = _steps_while(step, th.is_alive)
    th.join()
    b.rm_remote(dest)
    return times


def measure_slowdown(b: _Bench) -> dict[str, Any]:
    """Step times without, during and after background saves; {} when not asked for."""
    if "rg" not in b.cfg["methods"] or b.cfg["slowdown_rounds"] <= 0:
        return {}
    step, layers = _calibrated_step(b)
    t: dict[str, list[float]] = {"base": [], "during": [], "floor": [], "after": []}
    counts, floor_counts = [], []
    for r in range(b.cfg["slowdown_rounds"]):
        dist.barrier()
        t["base"] += [step() for _ in range(10)]
        times = _steps_during_rg_save(b, step)
        t["during"] += times
        counts.append(len(times))
        times = _steps_during_plain_upload(b, step, r)
        t["floor"] += times
        floor_counts.append(len(times))
        t["after"] += [step() for _ in range(5)]
    gathered: list[Any] = [None] * b.world
    dist.all_gather_object(gathered, t)
    return {
        "layers": layers,
        "steps_during": counts,
        "steps_floor": floor_counts,
        **{k: [v for g in gathered for v in g[k]] for k in t},
    }


# ----------------------------------------------------------------------------- restore


def _restore_target(b: _Bench):
    """The manifest of the newest committed ray_goodput checkpoint (one save first when no
    ray_goodput method ran)."""
    from ray_goodput.checkpoint.protocol._catalog import step_location
    from ray_goodput.checkpoint.protocol._manifest import read_manifest

    if b.rg_step == 0:
        _rg_save(b)
    b.ckpt.wait()
    manifest = read_manifest(step_location(b.ckpt.root, b.rg_step))
    if manifest is None:
        raise RuntimeError(f"ray_goodput step {b.rg_step} is not committed: nothing to restore")
    return manifest


def _rank_files(b: _Bench, manifest) -> list[str]:
    """What this rank's restore reads at an unchanged world size: DCP's ``.metadata``, the
    rank's data file, its RNG extras (not the per-rank metadata parts)."""
    from ray_goodput.checkpoint.protocol import _layout

    extras = _layout.extras_file(b.rank, manifest.save_id)
    return [
        _layout.DCP_METADATA,
        *(f.name for f in manifest.files if f.name.startswith(f"__{b.rank}_") or f.name == extras),
    ]


def _restore_with(b: _Bench, staging_dir: Path, step: int, *, decided: bool = False):
    """(seconds of ``restore()``, its RestoreInfo) by a new Checkpointer, as a restarted
    worker makes, whose node-local copy lives under ``staging_dir``. ``decided``: the
    driver chose ``step`` for this attempt, as ``Recovery`` does before a restarted worker
    group's training function starts (rank 0 then reads that step's commit, no listing of
    every checkpoint); else rank 0 finds the newest itself (a first attempt, or no Recovery)."""
    from ray_goodput import Checkpointer
    from ray_goodput.runtime._resume import ResumeDecision, root_key, set_decision

    if decided:  # what Recovery installs in each worker process (attempt: any new one)
        set_decision(ResumeDecision(attempt=b.attempts_made + 1, step=step, root_key=root_key(b.ckpt.root)))
    try:
        # Not closed: close() would add a Ray Train report. It saved nothing; it holds no
        # uploader, only the arena its restore prepared for a first save, released here.
        ck = Checkpointer(keep_last=1, staging_dir=str(staging_dir), uploader="thread")
        got: list = []
        seconds = _timed(b, lambda: got.append(ck.restore(b.saved())))
        ck._release()  # after the timing: joins the arena's prefault, unlinks it
    finally:
        set_decision(None)
        b.attempts_made += 1
    if got != [step]:
        raise RuntimeError(f"restore loaded step {got[0] if got else None}, expected {step}")
    return seconds, ck.last_restore


def m_restore_cold(b: _Bench, i: int, step: int, *, decided: bool = False) -> None:
    from ray_goodput.checkpoint.restore._reader import wait_for_node_local_copies

    # Fresh and this rank's own: every file comes from storage (in a shared one, DCP's
    # .metadata fetched by one rank of the node is a local read for the other).
    stage = Path(b.cfg["work"]) / f"cold-restore-{i}-{int(decided)}-rank{b.rank}"
    seconds, info = _restore_with(b, stage, step, decided=decided)
    key = "rs_cold_decided" if decided else "rs_cold"
    b.record_restore(key, b.allmax(seconds))
    b.record_restore(f"{key}_load", b.allmax(info.seconds))
    if b.allmax(info.local_files):  # on every rank alike: none raises alone
        raise RuntimeError("the cold restore read files from a node-local copy; its staging dir was not fresh")
    # The files it fetched go into the node-local copy in the background once the load is
    # over; let that finish before the next round is timed (training would overlap it).
    if not wait_for_node_local_copies(60):
        raise RuntimeError("the cold restore's node-local copy was still being written after 60 s")
    shutil.rmtree(stage, ignore_errors=True)


def m_restore_warm(b: _Bench, step: int, *, decided: bool = False) -> None:
    seconds, info = _restore_with(b, b.ckpt.staging.parent, step, decided=decided)  # the copy the save left
    key = "rs_warm_decided" if decided else "rs_warm"
    b.record_restore(key, b.allmax(seconds))
    b.record_restore(f"{key}_load", b.allmax(info.seconds))
    b.record_restore(f"{key}_remote_files", b.allmax(info.remote_files))


def _read_whole(fs, paths: list[str]) -> int:
    n = 0
    for path in paths:
        with fs.open_input_file(path) as f:
            n += len(f.read())
    return n


def m_read_floor(b: _Bench, loc, names: list[str]) -> None:
    """Floor: the same files read whole into memory from the same storage, same fs."""
    n: list[int] = []
    seconds = _timed(b, lambda: n.append(_read_whole(loc.fs, [loc.join(x) for x in names])))
    b.record_restore("read_floor", b.allmax(seconds))
    b.record_restore("read_bytes", b.allmax(n[0]))


def _peer_ranges(b: _Bench, manifest, loc, own: list[str]) -> list[tuple[str, int, int]]:
    """``(file, offset, length)`` of what this rank's restore reads from other ranks'
    files: the manifest blocks holding the entries it loads from them (replicated leaves,
    written once by their owner), found with DCP's own load planner, as the restore finds
    them. The read floor above does not read these bytes; the restore must."""
    import pickle

    from torch.distributed.checkpoint import DefaultLoadPlanner

    from ray_goodput.checkpoint.protocol import _layout
    from ray_goodput.checkpoint.restore._storage_fetch import _block_runs
    from ray_goodput.checkpoint.save import _state_dict

    with loc.fs.open_input_file(loc.join(_layout.DCP_METADATA)) as f:
        metadata = pickle.loads(f.read())  # the benchmark's own checkpoint
    roles = _state_dict.classify(b.saved())
    with _state_dict.made_up_state(roles, keep=True):
        planner = DefaultLoadPlanner()
        planner.set_up_planner(_state_dict.to_state_dict(roles), metadata, is_coordinator=False)
        plan = planner.create_local_plan()
    wanted: dict[str, list[tuple[int, int]]] = {}
    for item in plan.items:
        info = metadata.storage_data[item.storage_index]
        if info.relative_path not in own:
            wanted.setdefault(info.relative_path, []).append((info.offset, info.length))
    entries = {f.name: f for f in manifest.files}
    out = []
    for name, ranges in sorted(wanted.items()):
        want = entries[name]
        runs = _block_runs(want, ranges)
        if runs is None:  # most of the file (a replicated state is all in rank 0's): read whole
            out.append((name, 0, want.size))
            continue
        for first, last in runs:
            start = first * want.block_bytes
            out.append((name, start, min((last + 1) * want.block_bytes, want.size) - start))
    return out


def m_read_floor_peers(b: _Bench, loc, names: list[str], peers: list[tuple[str, int, int]]) -> None:
    """Floor: the same bytes the restore reads from storage: the rank's files whole, and
    the blocks of other ranks' files (:func:`_peer_ranges`), both at once in two threads
    (as the restore overlaps them)."""
    import concurrent.futures

    def read_peers() -> int:
        n = 0
        for name, offset, length in peers:
            with loc.fs.open_input_file(loc.join(name)) as f:
                n += len(f.read_at(length, offset))
        return n

    n: list[int] = []

    def both() -> None:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            theirs = pool.submit(read_peers)
            mine = _read_whole(loc.fs, [loc.join(x) for x in names])
            n.append(mine + theirs.result())

    seconds = _timed(b, both)
    b.record_restore("read_floor_peers", b.allmax(seconds))
    b.record_restore("read_bytes_peers", b.allmax(n[0]))


def m_local_read_floor(b: _Bench, local_dir: Path, names: list[str]) -> None:
    """Floor: the same files read whole from the node-local copy (plain Python reads)."""
    seconds = _timed(b, lambda: [(local_dir / x).read_bytes() for x in names])
    b.record_restore("local_floor", b.allmax(seconds))


def measure_restore(b: _Bench) -> list[str]:
    """``--saves`` rounds of: restore from storage (cold node-local copy), restore from the
    node-local copy, and both floors, in rotating order; returns rank 0's progress log."""
    from ray_goodput.checkpoint.protocol import _layout
    from ray_goodput.checkpoint.protocol._catalog import step_location

    manifest = _restore_target(b)
    names = _rank_files(b, manifest)
    loc = step_location(b.ckpt.root, manifest.step)
    peers = _peer_ranges(b, manifest, loc, names)
    local_dir = b.ckpt.staging / _layout.step_dir(manifest.step)
    todo: dict[str, Callable[[int], None]] = {
        "restore_cold": lambda i: m_restore_cold(b, i, manifest.step),
        "read_floor": lambda i: m_read_floor(b, loc, names),
        "read_floor_peers": lambda i: m_read_floor_peers(b, loc, names, peers),
        "restore_warm": lambda i: m_restore_warm(b, manifest.step),
        "restore_cold_decided": lambda i: m_restore_cold(b, i, manifest.step, decided=True),
        "restore_warm_decided": lambda i: m_restore_warm(b, manifest.step, decided=True),
        "local_floor": lambda i: m_local_read_floor(b, local_dir, names),
    }
    order, log = list(todo), []
    for i in range(b.cfg["saves"]):
        for name in order[i % len(order) :] + order[: i % len(order)]:
            gc.collect()
            t = time.perf_counter()
            todo[name](i)
            if b.rank == 0:
                log.append(f"restore round {i} {name}: {time.perf_counter() - t:.1f}s")
                print(log[-1], flush=True)
    return log


# ----------------------------------------------------------------------------- worker entry


def _write_result(b: _Bench, log: list[str], slow: dict[str, Any], *, final: bool) -> None:
    """Rank 0 writes what was measured so far to ``cfg["out"]`` (after each phase, so a run
    stopped at a time limit still leaves its finished phases); ``final`` also closes."""
    arenas = b.ckpt._arenas.arenas  # report only
    arena = str(arenas[0].path) if arenas else None
    pinned = [a.pinned for a in arenas] if b.dev == "cuda" else None
    if final:
        b.ckpt.close()
        if b.stager is not None:
            b.stager.close()
    sizes: list[Any] = [None] * b.world
    dist.all_gather_object(sizes, b.rank_bytes)
    if b.rank == 0:
        Path(b.cfg["out"]).write_text(
            json.dumps(
                {
                    "storage": b.cfg["storage"],
                    "shape": b.shape,
                    "world": b.world,
                    "rank_bytes": sizes,
                    "results": b.results,
                    "slowdown": slow,
                    "restore": b.restores,
                    "arena": arena,
                    "arena_pinned": pinned,
                    "log": log,
                    "torch_threads": torch.get_num_threads(),
                    "retries_rank0": RETRIES,
                    "dcp_stagers_made": b.stagers_made,
                    "torch": torch.__version__,
                    "final": final,
                }
            )
        )


def train_loop(cfg: dict) -> None:
    """Ray Train worker: every measurement on this rank; rank 0 writes ``cfg["out"]``."""
    b = _Bench(cfg)
    log = run_rounds(b)
    _write_result(b, log, {}, final=False)
    log += measure_burst(b)
    _write_result(b, log, {}, final=False)
    slow = measure_slowdown(b)
    _write_result(b, log, slow, final=False)
    log += measure_restore(b)
    _write_result(b, log, slow, final=True)


# ----------------------------------------------------------------------------- report


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * p / 100))]


def _medians(run: dict) -> dict[str, tuple[float | None, float | None]]:
    """{method: (median blocked, median durable)}"""
    return {k: (_med(v["blocked"]), _med(v["durable"])) for k, v in run["results"].items()}


def _copy_floor_key(med: dict) -> str:
    """The copy that blocking is measured against: on CUDA the device-to-host copy into
    preallocated pinned memory (what a save's copy can be at best; a fresh pageable copy
    there is page faults, not a floor), else a fresh in-memory copy."""
    return "d2h_pinned" if "d2h_pinned" in med else "copy_floor"


def _copy_floor(med: dict) -> float | None:
    return med.get(_copy_floor_key(med), (None, None))[0]


def _table_rows(run: dict, med: dict) -> list[str]:
    res, st = run["results"], run["storage"]
    copy_floor = _copy_floor(med)
    up_floor = med.get("upload_floor", (None, None))[1]
    rg_block = med.get("rg", (None, None))[0]
    rows = []
    for key in (k for k in TABLE_KEYS if k in med):
        b, d = med[key]
        rb = b / copy_floor if b is not None and copy_floor else None
        rd = d / up_floor if d is not None and up_floor else None
        rt = b / rg_block if key == "torch_save" and b is not None and rg_block else None
        rows.append(
            f"| {LABELS[key]} | {st} | {_f(b)} | {_f(d)} | {_f(rb, '{:.1f}×')} "
            f"| {_f(rd, '{:.2f}×')} | {_f(rt, '{:.2f}×' if rt is not None and rt < 10 else '{:.0f}×')} "
            f"| {_f(res[key]['blocked'][0] if res[key]['blocked'] else None)} |"
        )
    return rows


def _first_save_verdict(run: dict, med: dict) -> list[str]:
    """The first save's blocking against the first copy of the round (both cold)."""
    res, key = run["results"], _copy_floor_key(med)
    first = res.get("rg", {}).get("blocked", [])[:1]
    floor = res.get(key, {}).get("blocked", [])[:1]
    if not first or not floor or not floor[0]:
        return []
    r = first[0] / floor[0]
    return [
        f"- {run['storage']}: ray_goodput first save blocked {first[0]:.2f} s = {r:.2f}× the first "
        f"{'pinned D2H' if key == 'd2h_pinned' else 'in-memory'} copy ({floor[0]:.2f} s) → "
        f"{TARGETS['first_save_blocked'].verdict(r)}"
    ]


def _target_verdicts(run: dict, med: dict) -> list[str]:
    """Blocking (every save, the first one) vs the copy floor, durable vs the upload floor,
    rank-0 torch.save vs ray_goodput; the bounds are ``benchmarks/targets.toml``'s."""
    st, out = run["storage"], []
    copy_floor = _copy_floor(med)
    up_floor = med.get("upload_floor", (None, None))[1]
    rg_block = med.get("rg", (None, None))[0]
    if "rg" in med and copy_floor:
        r = med["rg"][0] / copy_floor
        floor = "pinned D2H floor" if "d2h_pinned" in med else "copy floor"
        out.append(
            f"- {st}: ray_goodput blocking {med['rg'][0]:.2f} s = {r:.2f}× {floor} "
            f"({copy_floor:.2f} s) → {TARGETS['blocked'].verdict(r)}"
        )
    out += _first_save_verdict(run, med)
    if "rg" in med and up_floor and med["rg"][1] is not None:
        r = med["rg"][1] / up_floor
        out.append(
            f"- {st}: ray_goodput time to durable {med['rg'][1]:.2f} s = {r:.2f}× upload floor "
            f"({up_floor:.2f} s) → {TARGETS['durable'].verdict(r)}"
        )
        synced = med.get("upload_floor_fsync", (None, None))[1]
        if synced:
            out.append(
                f"- {st}: (against the same write + fsync, {synced:.2f} s: "
                f"{med['rg'][1] / synced:.2f}×; ray_goodput fsyncs what it calls durable)"
            )
    if st == "s3" and "rg" in med and "torch_save" in med and rg_block:
        r = med["torch_save"][0] / rg_block
        out.append(
            f"- s3: rank-0 torch.save blocks {med['torch_save'][0]:.2f} s = {r:.0f}× ray_goodput "
            f"blocking → {TARGETS['torch_save_blocked'].verdict(r)}"
        )
    return out


def _phase_verdicts(run: dict, med: dict, device: str) -> list[str]:
    """Where ray_goodput's time goes: D2H bandwidths (CUDA), background write vs upload."""
    st, out = run["storage"], []
    if "copy_warm" in med and device == "cuda":
        gb = max(run["rank_bytes"]) / 1e9
        bw = {k: gb / med[k][0] for k in ("copy_floor", "copy_warm", "d2h_pinned", "rg") if k in med}
        out.append(
            f"- {st}: D2H of {gb:.1f} GB/rank: fresh pageable {bw.get('copy_floor', 0):.1f} GB/s, "
            f"preallocated pageable {bw.get('copy_warm', 0):.1f} GB/s, pinned "
            f"{bw.get('d2h_pinned', 0):.1f} GB/s; ray_goodput staging (blocked) "
            f"{med.get('rg', (0,))[0]:.2f} s = {bw.get('rg', 0):.1f} GB/s into arena {run.get('arena')} "
            f"(pinned: {run.get('arena_pinned')}); DCP stagers made: {run.get('dcp_stagers_made')} "
            f"(torch {run.get('torch')})"
        )
    if "rg_write" in med:
        out.append(
            f"- {st}: ray_goodput background phases (median, slowest rank): local DCP write "
            f"{med['rg_write'][0]:.2f} s, upload+marker+commit {med['rg_upload'][0]:.2f} s"
        )
    if "rg_uploader_on_cpu" in med:
        out.append(
            f"- {st}: the node uploader, all its threads, from save() to the end of rank 0's job "
            f"(median; both ranks' jobs): {med['rg_uploader_on_cpu'][0]:.2f} s on a core, "
            f"{med['rg_uploader_runnable'][0]:.2f} s runnable waiting for one"
        )
    if "rg_wait_sync" in med:
        out.append(
            f"- {st}: ray_goodput outcome agreement + Ray Train report, moved from save() to "
            f"wait() (every sync_every saves otherwise): {med['rg_wait_sync'][0]:.3f} s per call"
        )
    return out


def _slowdown_verdicts(run: dict) -> list[str]:
    st, sl, out = run["storage"], run.get("slowdown") or {}, []
    if sl.get("base") and sl.get("during"):
        b, d = _med(sl["base"]), _med(sl["during"])
        pct = (d / b - 1) * 100
        # at most at_most x the slowdown a plain upload of the same bytes causes (never under
        # min_allowed_pct, see targets.toml), else without_reference_pct
        t = TARGETS["step_slowdown"]
        limit = (
            max(t.extra["min_allowed_pct"], t.at_most * (_med(sl["floor"]) / b - 1) * 100)
            if sl.get("floor")
            else t.extra["without_reference_pct"]
        )
        out.append(
            f"- {st}: step slowdown during a ray_goodput write+upload: median step {b * 1e3:.0f} ms without "
            f"checkpoint vs {d * 1e3:.0f} ms during ({pct:+.0f}%; p90 {_pct(sl['during'], 90) * 1e3:.0f} ms; "
            f"after {(_med(sl['after']) or 0) * 1e3:.0f} ms; {sum(sl['steps_during'])} steps × {run['world']} "
            f"ranks during {len(sl['steps_during'])} uploads) → target ≤ {limit:+.0f}% ({t.at_most:g}× a plain "
            f"upload's): {'MET' if pct <= limit else 'MISSED'}"
        )
    if sl.get("floor") and sl.get("base"):
        f, b = _med(sl["floor"]), _med(sl["base"])
        out.append(
            f"- {st}: reference, steps during a plain pyarrow upload of the same bytes (no "
            f"ray_goodput): median {f * 1e3:.0f} ms ({(f / b - 1) * 100:+.0f}%)"
        )
    return out


# The restore targets: (restore, its floor, the target in targets.toml, where from, the floor in words).
_SAME_BYTES = "a plain read of the same bytes from storage (own files and peers' blocks)"
RESTORE_TARGETS = [
    ("rs_cold", "read_floor", "restore_from_storage", "from storage", "a plain read from storage"),
    ("rs_cold", "read_floor_peers", "restore_from_storage", "from storage", _SAME_BYTES),
    ("rs_warm", "local_floor", "restore_from_local_copy", "from the node-local copy", "a plain local read"),
    (
        "rs_cold_decided",
        "read_floor_peers",
        "restore_from_storage",
        "from storage, step decided by the driver",
        _SAME_BYTES,
    ),
    (
        "rs_warm_decided",
        "local_floor",
        "restore_from_local_copy",
        "from the node-local copy, step decided by the driver",
        "a plain local read",
    ),
]
RESTORE_LABELS = {
    "read_floor": "floor: plain read of the rank's files from storage (whole files)",
    "read_floor_peers": "floor: the same bytes as the restore (own files whole, peers' blocks)",
    "rs_cold": "Checkpointer.restore, cold node-local copy (all from storage)",
    "rs_cold_load": "  (of which loading: fetch, check, DCP read)",
    "local_floor": "floor: plain local read of the node-local copy",
    "rs_warm": "Checkpointer.restore from the node-local copy",
    "rs_warm_load": "  (of which loading: check, DCP read)",
    "rs_cold_decided": "Checkpointer.restore of the step the driver decided (Recovery's restart), all from storage",
    "rs_cold_decided_load": "  (of which loading)",
    "rs_warm_decided": "Checkpointer.restore of the step the driver decided, from the node-local copy",
    "rs_warm_decided_load": "  (of which loading)",
}
RESTORE_FLOOR = {
    "rs_cold": "read_floor",
    "rs_cold_load": "read_floor",
    "rs_warm": "local_floor",
    "rs_warm_load": "local_floor",
    "rs_cold_decided": "read_floor_peers",
    "rs_cold_decided_load": "read_floor_peers",
    "rs_warm_decided": "local_floor",
    "rs_warm_decided_load": "local_floor",
}


def _restore_rows(run: dict) -> list[str]:
    med = {k: _med(v) for k, v in (run.get("restore") or {}).items()}
    rows = []
    for key in (k for k in RESTORE_LABELS if med.get(k) is not None):
        floor = med.get(RESTORE_FLOOR.get(key, key))
        rows.append(
            f"| {RESTORE_LABELS[key]} | {run['storage']} | {med[key]:.2f} "
            f"| {_f(med[key] / floor if floor else None, '{:.2f}×')} |"
        )
    return rows


def _restore_verdicts(run: dict) -> list[str]:
    med = {k: _med(v) for k, v in (run.get("restore") or {}).items()}
    out = []
    for key, floor, target, where, floor_words in RESTORE_TARGETS:
        if med.get(key) is None or not med.get(floor):
            continue
        r = med[key] / med[floor]
        out.append(
            f"- {run['storage']}: restore {where} {med[key]:.2f} s = {r:.2f}× {floor_words} "
            f"({med[floor]:.2f} s) → {TARGETS[target].verdict(r)}"
        )
    for key in ("rs_warm_remote_files", "rs_warm_decided_remote_files"):
        if med.get(key):
            out.append(
                f"- {run['storage']}: a restore from the node-local copy ({key}) still fetched "
                f"{med[key]:.0f} file(s) from storage (median, slowest rank)"
            )
    return out


def _restore_table(runs: list[dict]) -> list[str]:
    """Restore of the newest committed ray_goodput checkpoint against plain reads."""
    rows = [row for run in runs for row in _restore_rows(run)]
    if not rows:
        return []
    sizes = ", ".join(
        f"{r['storage']}: {_med(r['restore'].get('read_bytes', [0])) / 2**20:.0f} MiB own, "
        f"{_med(r['restore'].get('read_bytes_peers', [0])) / 2**20:.1f} MiB with peers' blocks"
        for r in runs
        if r.get("restore")
    )
    head = [
        f"Restore (median of the rounds, slowest rank; bytes each rank reads: {sizes}):",
        "",
        "| restore | storage | s (median) | / its floor |",
        "|---|---|---|---|",
    ]
    return head + rows + [""] + [v for run in runs for v in _restore_verdicts(run)]


BURST_LABELS = {
    "burst_rg": "ray_goodput Checkpointer.save",
    "burst_dcp_async": "DCP dcp.async_save (one in flight)",
    "burst_rt_async": "Ray Train report ASYNC",
}


def _burst_table(runs: list[dict], args) -> list[str]:
    """Saves faster than uploads: each save's blocking in a burst against the copy floor."""
    rows, verdicts = [], []
    for run in runs:
        floor = _copy_floor(_medians(run))
        for key, label in BURST_LABELS.items():
            res = run["results"].get(key)
            if not res or not res["blocked"]:
                continue
            worst, mid = max(res["blocked"]), _med(res["blocked"])
            extra = f"; {sum(res['superseded'])} superseded" if res.get("superseded") else ""
            rows.append(
                f"| {label} | {run['storage']} | {len(res['blocked'])}{extra} | {mid:.2f} | {worst:.2f} "
                f"| {_f(mid / floor if floor else None, '{:.2f}×')} "
                f"| {_f(worst / floor if floor else None, '{:.2f}×')} "
                f"| {_f(_med(res['durable']))} |"
            )
            if key == "burst_rg" and floor:
                verdicts.append(
                    f"- {run['storage']}: saves faster than uploads, the slowest ray_goodput save() of "
                    f"{len(res['blocked'])} blocked {worst:.2f} s = {worst / floor:.2f}× the copy floor "
                    f"({floor:.2f} s) → {TARGETS['burst_blocked'].verdict(worst / floor)}"
                )
                if res.get("cpu"):
                    on_cpu, runnable = res["cpu"][res["blocked"].index(worst)]
                    verdicts.append(
                        f"- {run['storage']}: of that save's {worst:.2f} s, its thread was {on_cpu:.2f} s on a core "
                        f"({on_cpu / floor:.2f}× the copy floor), {runnable:.2f} s runnable waiting for one, and "
                        f"{max(0.0, worst - on_cpu - runnable):.2f} s blocked (a lock, a page fault's I/O, a reply)"
                    )
    if not rows:
        return []
    head = [
        f"Saves faster than uploads: bursts of {getattr(args, 'burst', '?')} saves "
        f"{getattr(args, 'burst_gap_ms', '?')} ms apart, every save of every round (slowest rank):",
        "",
        "| method | storage | saves | blocked s (median) | blocked s (slowest) | median / copy floor "
        "| slowest / copy floor | burst until the last durable s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    return head + rows + [""] + verdicts


def _one(value: Any, default: str) -> str:
    """A results file's shape/trainer: one name (older files), or the first of a list."""
    if isinstance(value, list):
        return value[0] if value else default
    return value or default


def render(runs: list[dict], args) -> str:
    """Every (shape, trainer) of the runs, each with its own tables, in the order run."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        key = (
            run.get("shape") or _one(getattr(args, "shape", None), "objects"),
            run.get("trainer") or _one(getattr(args, "trainer", None), "ray_goodput"),
        )
        groups.setdefault(key, []).append(run)
    parts = [_render_group(group, args, shape, trainer) for (shape, trainer), group in groups.items()]
    if len(parts) == 1:
        return parts[0]
    return "\n\n".join(
        f"### `{shape}` on {trainer}'s TorchTrainer\n\n{part}" for (shape, trainer), part in zip(groups, parts)
    )


def _render_group(runs: list[dict], args, shape: str, trainer: str) -> str:
    cuda = any("d2h_pinned" in run["results"] for run in runs)
    lines = [
        f"| method | storage | blocked s (median) | durable s (median) | blocked / "
        f"{'pinned D2H floor' if cuda else 'copy floor'} "
        "| durable / upload floor | torch.save rank-0 blocked / ray_goodput blocked | 1st save blocked s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    verdict = []
    for run in runs:
        med = _medians(run)
        lines += _table_rows(run, med)
        verdict += _target_verdicts(run, med) + _phase_verdicts(run, med, args.device) + _slowdown_verdicts(run)
    sizes = ", ".join(f"{r['storage']}: {[round(b / 2**20) for b in r['rank_bytes']]} MiB/rank" for r in runs)
    head = [
        f"State per rank ({sizes}), passed as `{shape}`; {args.saves} saves per "
        f"method (median over all saves, the first one included), {runs[0]['world'] if runs else '?'} ranks "
        f"of {trainer}'s TorchTrainer, device {args.device}"
        + (
            f"; the S3 server at niceness {args.storage_server_nice} (Ray workers: 15)."
            if any(r["storage"] == "s3" for r in runs) and getattr(args, "storage_server_nice", None) is not None
            else "."
        )
    ]
    restore, burst = _restore_table(runs), _burst_table(runs, args)
    return "\n".join(
        head + [""] + lines + [""] + verdict + ([""] + burst if burst else []) + ([""] + restore if restore else [])
    )


# ----------------------------------------------------------------------------- main


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb-per-rank", type=int, default=256, help="CPU: model+AdamW MiB per rank")
    ap.add_argument("--saves", type=int, default=3, help="saves per method (median reported)")
    ap.add_argument("--storage", choices=["local", "s3", "both"], default="both")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--params", type=float, default=1.0e9, help="CUDA: parameters (bf16 + fp32 master + AdamW)")
    ap.add_argument("--methods", default=None, help=f"comma list of {CPU_METHODS}")
    ap.add_argument(
        "--shape",
        nargs="+",
        choices=[*SHAPES, "all"],
        default=["objects"],
        help="how the state is passed (see above); several, or all: one run each",
    )
    ap.add_argument(
        "--trainer",
        nargs="+",
        choices=["ray_goodput", "ray", "both"],
        default=["ray_goodput"],
        help="run the workers under ray_goodput.TorchTrainer, Ray Train's own TorchTrainer, or both",
    )
    ap.add_argument("--burst", type=int, default=0, help="saves per burst (saves faster than uploads); 0: none")
    ap.add_argument("--burst-gap-ms", type=float, default=300.0, help="time between two saves of a burst")
    ap.add_argument(
        "--storage-server-nice",
        type=int,
        default=15,
        help="niceness of the local S3 server (default 15, Ray's worker niceness: it stands in for remote "
        "storage and must not outrank the training workers for the shared cores; at 0 it did, 28 to 1)",
    )
    ap.add_argument("--slowdown-rounds", type=int, default=2, help="ray_goodput saves with steps running")
    ap.add_argument("--step-ms", type=float, default=100.0, help="compute step length to calibrate to")
    ap.add_argument(
        "--out",
        "--json",
        default=None,
        help="write the results here (default benchmarks/results/checkpoint_tax_<cpu|cuda_gpu>.json)",
    )
    ap.add_argument("--markdown", default=None, help="also write the table here")
    ap.add_argument(
        "--render",
        nargs="+",
        default=None,
        metavar="RESULT_JSON",
        help="only print the tables of results files (this benchmark's --out, or a run's "
        "result-<storage>.json, written after each phase, so also a run stopped early)",
    )
    args = ap.parse_args()
    if args.device == "cuda" and args.params < 1e9:
        ap.error("--device cuda measures a >=1B-parameter model: --params >= 1e9")
    args.shape = SHAPES if "all" in args.shape else list(dict.fromkeys(args.shape))
    args.trainer = ["ray_goodput", "ray"] if "both" in args.trainer else list(dict.fromkeys(args.trainer))
    if args.device == "cuda" and args.shape != ["objects"]:
        ap.error("--device cuda measures the model and optimizer objects: --shape objects")
    args.methods = args.methods.split(",") if args.methods else None
    unknown = [m for m in args.methods or [] if m not in CPU_METHODS]
    if unknown:
        ap.error(f"--methods: unknown {unknown}; choose from {CPU_METHODS}")
    if args.shape != ["objects"] and "torch_save" in (args.methods or []):
        ap.error("--methods torch_save gathers the model and optimizer objects: --shape objects")
    return args


def _methods(args: argparse.Namespace, shape: str) -> list[str]:
    """``--methods``, else every method that takes ``shape`` on ``--device``."""
    if args.methods:
        return args.methods
    default = CPU_METHODS if args.device == "cpu" else CUDA_METHODS
    return default if shape == "objects" else [m for m in default if m in ANY_SHAPE_METHODS]


def _worker_count(device: str) -> int:
    """Two ranks; on CUDA one per GPU, at most two."""
    return max(1, min(2, torch.cuda.device_count())) if device == "cuda" else 2


def _worker_cfg(st: str, shape: str, args: argparse.Namespace, work: Path, endpoint: str | None) -> dict:
    return {
        "storage": st,
        "device": args.device,
        "mb_per_rank": args.mb_per_rank,
        "params": args.params,
        "saves": args.saves,
        "methods": _methods(args, shape),
        "slowdown_rounds": args.slowdown_rounds,
        "step_s": args.step_ms / 1e3,
        "shape": shape,
        "burst": args.burst,
        "burst_gap_s": args.burst_gap_ms / 1e3,
        "work": str(work / st),
        "out": str(work / f"result-{st}.json"),
        "endpoint": endpoint,
    }


def _run_config(cfg: dict, work: Path):
    """Ray Train's storage for ``cfg["storage"]``; on S3 also makes the bucket (sets cfg["bucket"])."""
    from ray.train import FailureConfig, RunConfig

    st = cfg["storage"]
    name = f"tax-{cfg['shape']}-{st}-{uuid.uuid4().hex[:6]}"  # Ray Train's run dir: one per run
    if st != "s3":
        return RunConfig(name=name, storage_path=str(work / "ray_local"), failure_config=FailureConfig(max_failures=0))
    cfg["bucket"] = f"tax-{uuid.uuid4().hex[:10]}"
    fs = s3fs(cfg["endpoint"])
    fs.create_dir(cfg["bucket"])
    return RunConfig(
        name=name,
        storage_path=f"{cfg['bucket']}/ray",
        storage_filesystem=fs,
        failure_config=FailureConfig(max_failures=0),
    )


def _fit(cfg: dict, args: argparse.Namespace, work: Path, trainer_name: str) -> dict | None:
    """One storage's run on a fresh TorchTrainer; its results, or None if it failed."""
    import ray.train.torch
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig

    import ray_goodput
    from ray_goodput.runtime import _services

    # ray_goodput's trainer (Ray's plus callbacks) starts each node's uploader when the
    # worker group starts, as a user of the library gets it; no driver-side Recovery here.
    # Ray Train's own: each worker's Checkpointer starts its node's uploader itself.
    extra = {"recovery": None} if trainer_name == "ray_goodput" else {}
    trainer_class = ray_goodput.TorchTrainer if trainer_name == "ray_goodput" else ray.train.torch.TorchTrainer
    trainer = trainer_class(
        train_loop,
        train_loop_config=cfg,
        **extra,
        scaling_config=ScalingConfig(num_workers=_worker_count(args.device), use_gpu=args.device == "cuda"),
        torch_config=TorchConfig(backend="cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"),
        run_config=_run_config(cfg, work),
    )
    try:
        trainer.fit()
    except Exception as exc:  # noqa: BLE001 - report the other storage anyway
        print(f"[{cfg['storage']}] run FAILED: {exc}", flush=True)
        return None
    finally:
        _services.shutdown("uploader")
    return {**json.loads(Path(cfg["out"]).read_text()), "trainer": trainer_name}


def _delete_bucket(endpoint: str, bucket: str) -> None:
    try:
        s3fs(endpoint).delete_dir(bucket)
    except Exception:  # noqa: BLE001 - cleanup only
        pass


def _save(args: argparse.Namespace, meta: dict, runs: list[dict], table: str | None = None) -> None:
    """The results file (after each storage's run too, so a run stopped early leaves those)."""
    _results.write(
        args.out,
        meta,
        {"args": {k: v for k, v in vars(args).items() if k != "render"}, "runs": runs, "markdown": table},
    )


def _run_all(args: argparse.Namespace, meta: dict, work: Path, endpoint: str | None) -> list[dict]:
    runs = []
    for trainer in args.trainer:
        for shape in args.shape:
            for st in ["local", "s3"] if args.storage == "both" else [args.storage]:
                (work / f"{trainer}-{shape}").mkdir(parents=True, exist_ok=True)
                cfg = _worker_cfg(st, shape, args, work / f"{trainer}-{shape}", endpoint)
                t = time.perf_counter()
                run = _fit(cfg, args, work, trainer)
                if run is None:
                    continue
                runs.append(run)
                _save(args, meta, runs)
                print(f"[{trainer} {shape} {st}] run took {time.perf_counter() - t:.0f} s", flush=True)
                if st == "s3":
                    _delete_bucket(endpoint, cfg["bucket"])
    return runs


def _rendered(paths: list[str], args: argparse.Namespace) -> str:
    """The tables of results files: this benchmark's (``{"run", "args", "runs"}``), the raw
    list of runs it wrote before, or one run's ``result-<storage>.json``."""
    runs: list[dict] = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        if isinstance(doc, dict) and "runs" in doc:
            for key in ("saves", "device", "shape", "trainer", "burst", "burst_gap_ms"):  # the head line
                setattr(args, key, doc.get("args", {}).get(key, getattr(args, key)))
            # Runs before the flag existed had the server at moto's default niceness, 0.
            args.storage_server_nice = doc.get("args", {}).get("storage_server_nice", 0)
        runs += doc["runs"] if isinstance(doc, dict) and "runs" in doc else doc if isinstance(doc, list) else [doc]
    return render(runs, args)


def main() -> None:
    args = _parse_args()
    if args.render:
        print(_rendered(args.render, args))
        return
    args.out = args.out or str(_results.default_path("checkpoint_tax", args.device))
    meta = _results.start_run("checkpoint_tax")
    work = Path(tempfile.mkdtemp(prefix="ckpt_tax_"))
    moto = endpoint = None
    env = {
        k: os.environ[k]
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_EC2_METADATA_DISABLED")
    }
    try:
        if args.storage in ("s3", "both"):
            moto, endpoint = start_moto_server()
            psutil.Process(moto.pid).nice(args.storage_server_nice)
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=True,
            object_store_memory=512 << 20,
            runtime_env={"env_vars": env},
        )
        runs = _run_all(args, meta, work, endpoint)
    finally:
        ray.shutdown()
        if moto is not None:
            moto.terminate()
            moto.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)
    table = render(runs, args)
    print(table)
    _save(args, meta, runs, table)
    print(f"\nresults written to {args.out}")
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")


if __name__ == "__main__":
    main()
