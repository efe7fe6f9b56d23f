"""The quickstart job: 2 Ray Train workers train a small MLP,
save committed async checkpoints, lose one worker to a SIGKILL, resume from the last
committed checkpoint, and print where the job's wall time went.

Runs on an embedded default: a local Ray instance, a local-directory storage and a
sqlite MLflow store with its artifacts, all under ``--root`` (default ``./goodput_runs``).
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
from urllib.parse import unquote, urlsplit

import ray
import ray.train
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import prepare_model
from torch import nn

from ray_goodput.checkpoint import Checkpointer
from ray_goodput.driver import GoodputCallback, TorchTrainer
from ray_goodput.goodput import record_step
from ray_goodput.testing import FailAt

logger = logging.getLogger(__name__)

EXPERIMENT = "ray_goodput"
_IN, _HIDDEN = 64, 1024


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(_IN, _HIDDEN), nn.GELU(), nn.Linear(_HIDDEN, _HIDDEN), nn.GELU(), nn.Linear(_HIDDEN, 1)
    )


def _batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh batch of a fixed smooth function to fit (the loss goes down)."""
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(size, _IN, generator=g)
    return x, (x[:, : _IN // 2].sum(dim=1, keepdim=True) / 4).sin()


class _Progress:
    """Rank 0's notes for the demo's printout: resumes, steps lost, losses (a JSON file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}

    def resumed(self, step: int) -> None:
        lost = self.data.get("last_step", step) - step
        self.data.setdefault("resumes", []).append({"from_step": step, "lost": lost})

    def stepped(self, step: int, loss: float) -> None:
        self.data["last_step"] = step
        self.data.setdefault("first_loss", loss)
        self.data["last_loss"] = loss
        self.path.write_text(json.dumps(self.data))

    def saved(self, step: int, block_s: float) -> None:
        self.data.setdefault("stalls", {})[str(step)] = block_s


def train_loop(config: dict[str, Any]) -> None:
    """``train_loop_per_worker`` of the demo (also a template for your own)."""
    torch.set_num_threads(1)  # 2 workers on 2 cores: one thread each, no oversubscription
    rank = ray.train.get_context().get_world_rank()
    model = prepare_model(_model())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state: dict[str, Any] = {"model": model, "optim": optim}
    fault = FailAt(step=config["fail_at"], rank=1, marker_dir=config["marker_dir"])
    notes = _Progress(Path(config["marker_dir"]) / "progress.json")
    with Checkpointer(keep_last=2) as ckpt:
        start = ckpt.restore(state) or 0  # the newest committed checkpoint, if any
        if start and rank == 0:
            notes.resumed(start)
        for step in range(start + 1, config["steps"] + 1):
            x, y = _batch(step, rank, config["batch_size"])
            loss = nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            record_step(step)  # one call per step feeds the goodput ledger (no barrier)
            if step % config["every"] == 0:
                ckpt.save(step, state, metrics={"loss": loss.item()})
                notes.saved(step, ckpt.stats.last_block_seconds)
            if rank == 0:
                notes.stepped(step, loss.item())
            fault.maybe_fail(step, rank)


def _ensure_experiment(tracking_uri: str, root: Path) -> None:
    """Create the MLflow experiment with its artifacts under ``root`` (else MLflow puts
    them in ``./mlruns`` of whichever process creates the experiment)."""
    import mlflow  # noqa: PLC0415 - here, not at the top: every training worker imports this module

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    location = (root / "mlartifacts").as_uri()
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        client.create_experiment(EXPERIMENT, artifact_location=location)
    elif exp.artifact_location != location:
        logger.warning("MLflow experiment %r already stores artifacts at %s", EXPERIMENT, exp.artifact_location)


def _chart_path(tracking_uri: str, name: str) -> str | None:
    """Local path of the run's goodput chart, when its artifact store is a directory."""
    import mlflow  # noqa: PLC0415 - as above: not in every training worker

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.runName = '{name}'") if exp else []
    if not runs or not runs[0].info.artifact_uri.startswith("file:"):
        return None
    path = Path(unquote(urlsplit(runs[0].info.artifact_uri).path)) / "goodput_breakdown.png"
    return str(path) if path.exists() else None


def _init_ray() -> None:
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    if not ray.is_initialized():
        # Worker logs stay in Ray's log files; the demo prints its own summary.
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=False,
            runtime_env={"env_vars": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}},
        )


def run(root: Path, *, steps: int = 120, every: int = 20, fail_at: int = 70, batch_size: int = 1280) -> dict[str, Any]:
    """Run the demo job; returns what happened (resume points, lost steps, goodput summary,
    checkpoint stalls, losses, chart path). ``batch_size`` sets the work per step."""
    root = root.resolve()
    name = f"quickstart-{time.strftime('%Y%m%d-%H%M%S')}"
    marker_dir = root / name / "_demo"
    marker_dir.mkdir(parents=True, exist_ok=True)
    tracking_uri = f"sqlite:///{root}/mlflow.db"
    _ensure_experiment(tracking_uri, root)
    _init_ray()
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "steps": steps,
            "every": every,
            "fail_at": fail_at,
            "batch_size": batch_size,
            "marker_dir": str(marker_dir),
        },
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            name=name,
            storage_path=str(root),
            failure_config=FailureConfig(max_failures=2),
            callbacks=[GoodputCallback(tracking_uri=tracking_uri, experiment_name=EXPERIMENT)],
        ),
    )
    started = time.monotonic()
    result = trainer.fit()
    wall = time.monotonic() - started
    notes = json.loads((marker_dir / "progress.json").read_text())
    goodput_file = root / name / "goodput" / "summary.json"
    return {
        "run_dir": str(root / name),
        "wall_s": wall,
        "name": name,
        "tracking_uri": tracking_uri,
        "goodput": json.loads(goodput_file.read_text()) if goodput_file.exists() else None,
        "resumes": notes.get("resumes", []),
        "last_step": notes.get("last_step"),
        "stalls": notes.get("stalls", {}),
        "first_loss": notes.get("first_loss"),
        "last_loss": notes.get("last_loss"),
        "chart": _chart_path(tracking_uri, name),
        "checkpoint": result.checkpoint.path if result.checkpoint else None,
        "metrics": result.metrics,
    }


def _print_goodput(w: Any, g: dict[str, Any]) -> None:
    w(
        f"\ngoodput {g['goodput']:.1%} of {g['total_s']:.1f}s wall time "
        f"({g['attempts']} attempts, {g['failures']} failure(s), {g['steps_lost']} steps lost and redone)\n"
    )
    w(f"| {'bucket':<17} | {'seconds':>7} | {'share':>6} |\n|{'-' * 19}|{'-' * 8}:|{'-' * 7}:|\n")
    for bucket, seconds in g["seconds"].items():
        w(f"| {bucket:<17} | {seconds:7.1f} | {seconds / g['total_s']:6.1%} |\n")


def _print(out: dict[str, Any], fail_at: int) -> None:
    w = sys.stdout.write
    w(f"run directory: {out['run_dir']}\n")
    w(
        f"trained {out['last_step']} steps with 2 workers in {out['wall_s']:.1f}s "
        f"(loss {out['first_loss']:.4f} -> {out['last_loss']:.4f})\n"
    )
    w(f"worker rank 1 killed at step {fail_at} (SIGKILL)\n")
    for r in out["resumes"]:
        w(f"resumed from committed checkpoint step {r['from_step']}; steps lost: {r['lost']}\n")
    stalls = ", ".join(f"{float(s):.2f}" for s in out["stalls"].values())
    w(f"checkpoint stall per save (s, rank 0): {stalls}\n")
    w(f"final checkpoint: {out['checkpoint']}\n")
    w(f"inspect it: ray-goodput ls {out['run_dir']}\n")
    if out["goodput"]:
        _print_goodput(w, out["goodput"])
    w(f"\nsummary: {out['run_dir']}/goodput/summary.json\n")
    w(f"chart: {out['chart'] or '(not found; see the MLflow run)'}\n")
    w(f"MLflow run {out['name']!r}: {out['tracking_uri']}\n")
    w(f"  ray-goodput report {out['name']} --tracking-uri {out['tracking_uri']}\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ray-goodput demo", description=__doc__)
    parser.add_argument("--root", default="goodput_runs", help="storage directory (default ./goodput_runs)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    parser.add_argument("--fail-at", type=int, default=70, help="kill worker rank 1 at this step, once")
    parser.add_argument("--batch-size", type=int, default=1280, help="samples per worker per step (work per step)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    out = run(Path(args.root), steps=args.steps, every=args.every, fail_at=args.fail_at, batch_size=args.batch_size)
    _print(out, args.fail_at)
    return 0
