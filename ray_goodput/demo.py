"""The quickstart job: 2 Ray Train workers, committed async checkpoints, one injected
worker failure, automatic resume from the last committed checkpoint.

Runs on an embedded default: a local Ray instance, a local-directory storage and a
sqlite MLflow store, all under ``--root`` (default ``./goodput_runs``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(64, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def train_loop(config: dict[str, Any]) -> None:
    """``train_loop_per_worker`` of the demo (also a template for your own)."""
    import ray.train
    from ray.train.torch import prepare_model

    from ray_goodput import Checkpointer, record_step
    from ray_goodput.testing import FailAt

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    model = prepare_model(_model())
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state: dict[str, Any] = {"model": model, "optim": optim, "step": 0}
    fault = FailAt(step=config["fail_at"], rank=1, marker_dir=config["marker_dir"])
    progress = Path(config["marker_dir"]) / "progress.json"
    with Checkpointer(keep_last=2) as ckpt:
        restored = ckpt.restore(state)
        history = json.loads(progress.read_text()) if progress.exists() else {}
        start = (restored or 0)
        if restored is not None and rank == 0:
            history.setdefault("resumes", []).append(
                {"from_step": restored, "lost": history.get("last_step", restored) - restored})
        for step in range(start + 1, config["steps"] + 1):
            x, y = _batch(step, rank)
            loss = nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            state["step"] = step
            if rank == 0:
                history["last_step"] = step
                progress.write_text(json.dumps(history))
            record_step(step)  # one call per step feeds the goodput ledger (no barrier)
            if step % config["every"] == 0:
                ckpt.save(step, state, metrics={"loss": loss.item()})
            fault.maybe_fail(step, rank)


def run(root: Path, *, steps: int = 60, every: int = 10, fail_at: int = 35) -> dict[str, Any]:
    """Run the demo job; returns what happened (resume points, lost steps, checkpoint)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_goodput import GoodputCallback

    root = root.resolve()
    name = f"quickstart-{time.strftime('%Y%m%d-%H%M%S')}"
    marker_dir = root / name / "_demo"
    marker_dir.mkdir(parents=True, exist_ok=True)
    tracking_uri = f"sqlite:///{root}/mlflow.db"
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    if not ray.is_initialized():
        # Worker logs stay in Ray's log files; the demo prints its own summary.
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}})
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"steps": steps, "every": every, "fail_at": fail_at,
                           "marker_dir": str(marker_dir)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name=name, storage_path=str(root),
                             failure_config=FailureConfig(max_failures=2),
                             callbacks=[GoodputCallback(tracking_uri=tracking_uri)]),
    )
    started = time.monotonic()
    result = trainer.fit()
    history = json.loads((marker_dir / "progress.json").read_text())
    goodput_file = root / name / "goodput" / "summary.json"
    return {"run_dir": str(root / name), "wall_s": time.monotonic() - started, "name": name,
            "tracking_uri": tracking_uri,
            "goodput": json.loads(goodput_file.read_text()) if goodput_file.exists() else None,
            "resumes": history.get("resumes", []), "last_step": history.get("last_step"),
            "checkpoint": result.checkpoint.path if result.checkpoint else None,
            "metrics": result.metrics}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ray-goodput demo", description=__doc__)
    parser.add_argument("--root", default="goodput_runs", help="storage directory (default ./goodput_runs)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--fail-at", type=int, default=35, help="kill worker rank 1 at this step, once")
    args = parser.parse_args(list(argv) if argv is not None else None)
    out = run(Path(args.root), steps=args.steps, every=args.every, fail_at=args.fail_at)
    w = sys.stdout.write
    w(f"run directory: {out['run_dir']}\n")
    w(f"trained {out['last_step']} steps with 2 workers in {out['wall_s']:.1f}s\n")
    w(f"worker rank 1 killed at step {args.fail_at} (SIGKILL)\n")
    for r in out["resumes"]:
        w(f"resumed from committed checkpoint step {r['from_step']}; steps lost: {r['lost']}\n")
    w(f"final checkpoint: {out['checkpoint']}\n")
    w(f"inspect it: ray-goodput ls {out['run_dir']}\n")
    g = out["goodput"]
    if g:
        w(f"goodput {g['goodput']:.1%} of {g['total_s']:.1f}s wall time; "
          f"{g['failures']} failure(s), {g['steps_lost']} steps lost and redone\n")
        for bucket, seconds in g["seconds"].items():
            w(f"  {bucket:<17} {seconds:7.1f}s  {seconds / g['total_s']:6.1%}\n")
        w(f"MLflow (run {out['name']!r}, with chart goodput_breakdown.png): {out['tracking_uri']}\n")
        w(f"  ray-goodput report {out['name']} --tracking-uri {out['tracking_uri']}\n")
    return 0
