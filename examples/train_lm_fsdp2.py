"""Train a small decoder-only language model with FSDP2 on Ray Train, with ray_goodput's
committed async checkpoints, resumable Parquet data and goodput accounting.

    python examples/train_lm_fsdp2.py --smoke        # 2 CPU workers, ~1 min, one worker killed
    python examples/train_lm_fsdp2.py --workers 8    # a GPU node: NCCL + bf16

Token data is Parquet (one row = one sequence) read through ``ParquetDataset`` and the
node cache; without ``--data`` a synthetic corpus (a random Markov chain over the
vocabulary, so the loss has a floor of ln 4 = 1.39 to head for) is written on first run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class Size:
    vocab: int
    dim: int
    layers: int
    heads: int
    seq: int
    batch: int  # sequences per worker per step
    rows: int  # sequences in the generated corpus
    steps: int
    every: int  # checkpoint interval (steps)
    log_every: int


SMOKE = Size(vocab=256, dim=128, layers=2, heads=4, seq=64, batch=8, rows=4000, steps=60, every=10, log_every=10)
GPU = Size(
    vocab=8192, dim=1024, layers=8, heads=16, seq=1024, batch=8, rows=100_000, steps=2000, every=200, log_every=50
)


# -- model: a few pre-norm transformer blocks written with torch.nn --
class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, s: Size) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(s.vocab, s.dim), nn.Embedding(s.seq, s.dim)
        self.blocks = nn.ModuleList(Block(s.dim, s.heads) for _ in range(s.layers))
        self.norm, self.head = nn.LayerNorm(s.dim), nn.Linear(s.dim, s.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def shard(model: nn.Module, device: torch.device) -> nn.Module:
    """FSDP2: each block is its own unit, then the root (embeddings, head)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda"
        else MixedPrecisionPolicy()
    )  # CPU: fp32 throughout
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


# -- data: synthetic token Parquet, generated once --
def make_corpus(path: Path, s: Size, files: int = 4) -> None:
    """Sequences of a random Markov chain (4 successors per token) as Parquet files."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.exists() and any(path.glob("*.parquet")):
        return
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    successors = rng.integers(0, s.vocab, size=(s.vocab, 4))
    tokens = np.empty((s.rows, s.seq + 1), dtype=np.int32)
    tokens[:, 0] = rng.integers(0, s.vocab, size=s.rows)
    for t in range(1, s.seq + 1):
        tokens[:, t] = successors[tokens[:, t - 1], rng.integers(0, 4, size=s.rows)]
    for i, part in enumerate(np.array_split(tokens, files)):
        table = pa.table({"tokens": pa.array(list(part), type=pa.list_(pa.int32()))})
        pq.write_table(table, path / f"part-{i:03d}.parquet", row_group_size=500)


def collate(rows: list[dict[str, Any]]) -> torch.Tensor:
    return torch.tensor([r["tokens"] for r in rows], dtype=torch.long)


# -- the training function, run by every Ray Train worker --
def train_loop(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    from ray_goodput import Checkpointer, record_step
    from ray_goodput.data import DataLoader, ParquetDataset
    from ray_goodput.testing import FailAt

    s, rank = Size(**config["size"]), ray.train.get_context().get_world_rank()
    device = ray.train.torch.get_device()
    torch.manual_seed(0)
    model = shard(TinyLM(s).to(device), device)
    optim = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    loader = DataLoader(
        ParquetDataset(config["data"], columns=["tokens"], seed=0),
        batch_size=s.batch,
        num_workers=config["loader_workers"],
        collate_fn=collate,
    )
    state: dict[str, Any] = {"model": model, "optim": optim, "loader": loader, "history": {"stalls": {}, "resumes": []}}
    fault = FailAt(step=config["fail_at"], rank=1, marker_dir=config["fault_dir"]) if config["fail_at"] else None
    with Checkpointer(keep_last=2) as ckpt:
        start = ckpt.restore(state) or 0  # model, optimizer, data position, history
        history = state["history"]
        if start:
            history["resumes"].append(start)
            _say(
                rank,
                f"resumed from committed checkpoint step {start} "
                f"(data: epoch {loader.epoch}, {loader.state_dict()['consumed']} samples consumed)",
            )
        step, t0, loss = start, time.perf_counter(), torch.zeros(())
        while step < s.steps:
            loader.set_epoch(loader.epoch)  # keeps a resumed position within the epoch
            for tokens in loader:
                tokens = tokens.to(device, non_blocking=True)
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
                optim.zero_grad(set_to_none=True)
                loss.backward()
                optim.step()
                step += 1
                record_step(step)  # feeds the goodput ledger; no barrier
                if step % s.log_every == 0:
                    rate = (step - start) / (time.perf_counter() - t0)
                    history["steps_per_s"] = rate
                    history.setdefault("losses", {})[step] = round(loss.item(), 4)
                    _say(rank, f"step {step:5d}  loss {loss.item():.3f}  {rate:.2f} steps/s")
                if step % s.every == 0 or step == s.steps:
                    _save(ckpt, step, state, loss, rank)
                if fault is not None:
                    fault.maybe_fail(step, rank)
                if step >= s.steps:
                    break


def _save(ckpt: Any, step: int, state: dict[str, Any], loss: torch.Tensor, rank: int) -> None:
    history = state["history"]
    history["final_loss"] = loss.item()
    ckpt.save(step, state, metrics={"loss": loss.item(), "history": json.dumps(history)})
    history["stalls"][step] = ckpt.stats.last_block_seconds  # recorded in the next save
    _say(rank, f"checkpoint step {step}: save() blocked {ckpt.stats.last_block_seconds:.3f} s")


def _say(rank: int, line: str) -> None:
    if rank == 0:
        print(line, flush=True)


# -- driver --
def _tracking(out: Path) -> str:
    """A sqlite MLflow store with its artifacts under ``out`` (not ./mlruns)."""
    import mlflow

    uri = f"sqlite:///{out}/mlflow.db"
    client = mlflow.MlflowClient(tracking_uri=uri)
    if client.get_experiment_by_name("ray_goodput") is None:
        client.create_experiment("ray_goodput", artifact_location=(out / "mlartifacts").as_uri())
    return uri


def _report(result: Any, storage: str, name: str, wall: float) -> None:
    from ray_goodput.storage import read_bytes, resolve

    history = json.loads(result.metrics.get("history", "{}"))
    stalls = history.get("stalls", {})
    print(
        f"\nfinished in {wall:.1f}s; final loss {history.get('final_loss', math.nan):.3f}; "
        f"{history.get('steps_per_s', math.nan):.2f} steps/s (last attempt)"
    )
    print("loss by step: " + ", ".join(f"{k}: {v:.3f}" for k, v in history.get("losses", {}).items()))
    for step in history.get("resumes", []):
        print(f"resumed from committed checkpoint step {step}")
    print("checkpoint stall per save, rank 0 (s): " + ", ".join(f"step {k}: {v:.3f}" for k, v in stalls.items()))
    try:
        g = json.loads(read_bytes(resolve(storage).child(name), "goodput/summary.json"))
    except FileNotFoundError:
        print("goodput summary not written (see the MLflow run)")
        return
    print(
        f"goodput {g['goodput']:.1%} of {g['total_s']:.1f}s ({g['failures']} failure(s), "
        f"{g['steps_lost']} steps lost); checkpoint stall {g['seconds']['checkpoint_stall']:.2f}s, "
        f"data stall {g['seconds']['data_stall']:.2f}s, restart downtime {g['seconds']['restart_downtime']:.1f}s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 CPU workers, one worker killed mid-run")
    p.add_argument("--workers", type=int, default=None, help="default: 2 (smoke) or 8 (GPU)")
    p.add_argument("--data", default=None, help="directory or s3:// prefix of token Parquet (column 'tokens')")
    p.add_argument("--out", default="lm_runs", help="local directory: MLflow db, generated data, default storage")
    p.add_argument("--storage", default=None, help="checkpoint/run storage URI, e.g. s3://bucket/runs (default: --out)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--fail-at", type=int, default=None, help="SIGKILL worker 1 at this step (smoke: 35)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    args = p.parse_args()
    run(args)


def run(args: argparse.Namespace) -> None:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer  # later: from ray_goodput import TorchTrainer

    from ray_goodput import GoodputCallback

    size = SMOKE if args.smoke else GPU
    if args.steps:
        size = Size(**{**asdict(size), "steps": args.steps})
    out = Path(args.out).resolve()
    data = args.data or str(out / f"tokens-v{size.vocab}-s{size.seq}")
    if args.data is None:
        make_corpus(Path(data), size)
    name = f"lm-{time.strftime('%Y%m%d-%H%M%S')}"
    storage = args.storage or str(out)
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")  # detect the killed worker fast
    fail_at = args.fail_at if args.fail_at is not None else (35 if args.smoke else 0)
    # Smoke: worker output stays in Ray's log files (the killed worker's gloo traceback is
    # long); the summary below is printed from the final report and the goodput summary.
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}},
    ) if args.smoke else ray.init(address=args.address)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "size": asdict(size),
            "data": data,
            "lr": 3e-3 if args.smoke else 3e-4,
            "fail_at": fail_at,
            "fault_dir": str(out / name / "_faults"),
            "loader_workers": 1 if args.smoke else 4,
        },
        scaling_config=ScalingConfig(num_workers=args.workers or (2 if args.smoke else 8), use_gpu=not args.smoke),
        run_config=RunConfig(
            name=name,
            storage_path=storage,
            failure_config=FailureConfig(max_failures=3),
            callbacks=[GoodputCallback(tracking_uri=_tracking(out))],
        ),
    )
    t0 = time.monotonic()
    result = trainer.fit()
    _report(result, storage, name, time.monotonic() - t0)


if __name__ == "__main__":
    main()
