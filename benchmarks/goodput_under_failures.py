"""Goodput under failures: the same job and failure schedule, plain Ray Train
checkpointing vs ray_goodput, side by side in one run.

plain:       rank 0 torch.save()s the full state, ray.train.report(checkpoint, SYNC upload);
             restore from ray.train.get_checkpoint(); the data restarts from the epoch start.
ray_goodput: Checkpointer (async, sharded, committed), DataLoader position in the checkpoint.

Both feed the same ledger (GoodputCallback), so the numbers are comparable.
Usage: python benchmarks/goodput_under_failures.py [--steps 60 --every 10 --fail-at 23 41]

Each run's measured costs (step, save blocking, time to durable, restore, restart, startup)
and its failure times go to benchmarks/results/goodput_under_failures.json, in the costs
schema of ``ray-goodput simulate --costs``. ``--validate [FILE]`` replays those failure
times through the simulation (ray_goodput.plan.replay) with those costs and prints the
predicted goodput beside the measured one (done after every run too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SAMPLES, BATCH = 256, 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # 32 MiB + Adam


def _decode(data: bytes) -> int:
    return int(data)


def _step(model, optim, ids, compute_s: float) -> None:
    x = torch.sin(ids.float()[:, None] * torch.arange(1024) / 1000.0)
    loss = model(x).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    time.sleep(compute_s)  # the rest of a realistic step


def plain_loop(cfg: dict) -> None:
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode
    from ray.train.torch import prepare_model

    from ray_goodput.data import DataLoader, FileDataset
    from ray_goodput.goodput import get_recorder, record_step
    from ray_goodput.testing import FailAt

    rank = ray.train.get_context().get_world_rank()
    model = prepare_model(_model())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = DataLoader(FileDataset(cfg["data"], decode=_decode, seed=0, cache=None), BATCH, num_workers=0)
    rec, t0, step = get_recorder(), time.time(), 0
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            blob = torch.load(os.path.join(d, "state.pt"), weights_only=False)
        model.module.load_state_dict(blob["model"])
        optim.load_state_dict(blob["optim"])
        step = blob["step"]
        loader.set_epoch(blob["epoch"])  # the position inside the epoch is lost
    rec.restored(step, t0, time.time())
    _train(cfg, rank, model, optim, loader, step, lambda s: _plain_save(model, optim, loader, s, rank))
    rec.end()


def _plain_save(model, optim, loader, step, rank) -> None:
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    from ray_goodput.goodput import get_recorder

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        ckpt = None
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                        "step": step, "epoch": loader.epoch}, os.path.join(d, "state.pt"))
            ckpt = Checkpoint.from_directory(d)
        ray.train.report({"step": step}, checkpoint=ckpt, checkpoint_upload_mode=CheckpointUploadMode.SYNC)
    get_recorder().add_checkpoint_stall(time.perf_counter() - start)


def goodput_loop(cfg: dict) -> None:
    import ray.train
    from ray.train.torch import prepare_model

    from ray_goodput import Checkpointer
    from ray_goodput.data import DataLoader, FileDataset

    rank = ray.train.get_context().get_world_rank()
    model = prepare_model(_model())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = DataLoader(FileDataset(cfg["data"], decode=_decode, seed=0, cache=None), BATCH, num_workers=0)
    state = {"model": model, "optim": optim, "loader": loader}
    with Checkpointer(keep_last=2) as ckpt:
        step = ckpt.restore(state) or 0
        _train(cfg, rank, model, optim, loader, step, lambda s: ckpt.save(s, state))


def _train(cfg, rank, model, optim, loader, step, save) -> None:
    from ray_goodput.goodput import record_step
    from ray_goodput.testing import FailAt

    faults = [FailAt(step=s, rank=1, marker_dir=cfg["markers"]) for s in cfg["fail_at"]]
    log = open(Path(cfg["markers"]) / f"samples-{os.getpid()}-{rank}.jsonl", "a", buffering=1)
    while step < cfg["steps"]:
        for ids in loader:
            step += 1
            _step(model, optim, ids, cfg["compute_s"])
            log.write(json.dumps({"t": time.time(), "step": step, "rank": rank, "epoch": loader.epoch,
                                  "ids": ids.tolist()}) + "\n")
            record_step(step)
            if step % cfg["every"] == 0:
                save(step)
            for f in faults:
                f.maybe_fail(step, rank)
            if step >= cfg["steps"]:
                break


def _repeated_samples(markers: Path) -> int:
    """Samples that kept steps consumed more than once within the same epoch."""
    attempts: dict[str, dict[tuple[int, int], dict]] = {}
    for path in markers.glob("samples-*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            attempts.setdefault(path.name, {})[(r["step"], r["rank"])] = r
    kept: dict[tuple[int, int], dict] = {}
    for name in sorted(attempts, key=lambda n: min(r["t"] for r in attempts[n].values())):
        kept.update(attempts[name])  # a later attempt's run of a step is the one kept
    by_epoch: dict[int, list[int]] = {}
    for r in kept.values():
        by_epoch.setdefault(r["epoch"], []).extend(r["ids"])
    return sum(len(ids) - len(set(ids)) for ids in by_epoch.values())


def run(kind: str, root: Path, args) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_goodput import GoodputCallback

    markers = root / f"{kind}-markers"
    markers.mkdir(parents=True)
    cfg = {"data": str(root / "data"), "markers": str(markers), "steps": args.steps,
           "every": args.every, "fail_at": args.fail_at, "compute_s": args.compute_s}
    trainer = TorchTrainer(
        plain_loop if kind == "plain" else goodput_loop, train_loop_config=cfg,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=kind, storage_path=str(root / "runs"),
                             failure_config=FailureConfig(max_failures=len(args.fail_at) + 1),
                             callbacks=[GoodputCallback(tracking_uri=f"sqlite:///{root}/mlflow.db")]))
    start = time.time()
    trainer.fit()
    wall = time.time() - start
    from ray_goodput.goodput import compute
    from ray_goodput.goodput._events import read_events
    from ray_goodput.goodput._report import summary
    from ray_goodput.storage import resolve

    events = read_events(resolve(str(root / "runs" / kind)))
    ledger = summary(compute(list(events.values()), job_start=start))
    attempts = sorted((a for a in events.values() if a), key=lambda a: a[0]["t"])
    measured = _measured(kind, attempts, start, args.every, root / "runs" / kind, ledger)
    return {"wall": wall, "ledger": ledger, "repeated": _repeated_samples(markers), "measured": measured}


def _median(values: list[float], default: float = 0.0) -> float:
    return statistics.median(values) if values else default


def _durable_after_start(attempts: list[list[dict]], every: int, ckpt_root: Path) -> list[float]:
    """ray_goodput: each committed checkpoint's commit time minus its save's start (the
    saved step's own event ends right before ``save`` is called)."""
    from ray_goodput.checkpoint._catalog import list_checkpoints

    started = {e["step"]: e["t"] for a in attempts for e in a if e["e"] == "step" and e["step"] % every == 0}
    return [c.created - started[c.step] for c in list_checkpoints(str(ckpt_root))
            if c.committed and c.created and c.step in started]


def _measured(kind: str, attempts: list[list[dict]], start: float, every: int, ckpt_root: Path,
              ledger: dict) -> dict:
    """Costs in the schema of ray_goodput.plan's costs JSON, plus this run's failure schedule."""
    steps = [e for a in attempts for e in a if e["e"] == "step"]
    # Mean compute per kept step, so that the replay's kept work equals the ledger's productive.
    step_s = ledger["seconds"]["productive"] / max(1, ledger["steps_kept"])
    blocking = _median([e["ckpt"] for e in steps if e.get("ckpt", 0) > 0])
    restores = [[e["t"] - e["t0"] for e in a if e["e"] == "restore"] for a in attempts]
    durable = blocking if kind == "plain" else _median(_durable_after_start(attempts, every, ckpt_root), blocking)
    failures = max(1, len(attempts) - 1)
    system = {"name": kind, "step_s": step_s, "save_blocking_s": blocking, "durable_s": max(durable, blocking),
              "restore_s": _median([r for rs in restores[1:] for r in rs]),
              "restart_s": ledger["seconds"]["restart_downtime"] / failures, "interval": every * step_s}
    return {"system": system, "failures_s": [a[-1]["t"] - start for a in attempts[:-1]],
            "startup_s": ledger["seconds"]["startup"] + sum(restores[0]) if restores else 0.0,
            "work_s": ledger["seconds"]["productive"], "wall_s": ledger["total_s"],
            "goodput": ledger["goodput"], "seconds": ledger["seconds"]}


RESULTS = Path(__file__).resolve().parent / "results" / "goodput_under_failures.json"


def write_results(results: dict, args, path: Path) -> None:
    """Measured costs (ray-goodput simulate --costs schema) and each run's schedule and ledger."""
    doc = {"source": f"benchmarks/goodput_under_failures.py, {time.strftime('%Y-%m-%d')}, 2 workers, "
                     f"local-directory storage, every {args.every} steps",
           "args": {"steps": args.steps, "every": args.every, "fail_at": args.fail_at, "compute_s": args.compute_s},
           "systems": [r["measured"]["system"] for r in results.values()],
           "runs": {k: {kk: v for kk, v in r["measured"].items() if kk != "system"} for k, r in results.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def validate(path: Path) -> list[dict]:
    """Replay each run's failure times with its measured costs; predicted vs measured."""
    from ray_goodput.plan._simulate import replay, systems_from_json

    doc = json.loads(path.read_text())
    rows = []
    for system in systems_from_json(doc):
        run = doc["runs"][system.name]
        sim = replay(system, run["failures_s"], work_s=run["work_s"], startup_s=run["startup_s"])
        seen = run["seconds"]
        # The simulation has no data stall and no end-of-run wait ("other"): also compare without them.
        core = run["wall_s"] - seen.get("other", 0.0) - seen.get("data_stall", 0.0)
        rows.append({"system": system.name, "measured": run["goodput"], "predicted": sim.goodput,
                     "measured_core": seen["productive"] / core if core > 0 else 0.0,
                     "wall_s": run["wall_s"], "sim_wall_s": sim.wall_s, "seen": seen, "sim": sim.seconds})
    return rows


def print_validation(rows: list[dict]) -> None:
    w = sys.stdout.write
    w("\nvalidation: ray_goodput.plan.replay with the measured costs and failure times\n\n")
    w("| system | measured goodput | predicted | measured w/o other+data_stall | wall s (measured / sim) "
      "| lost s | checkpoint stall s | restore s | restart downtime s | other s |\n")
    w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    for r in rows:
        pair = lambda k: f"{r['seen'][k]:.1f} / {r['sim'][k]:.1f}"  # noqa: E731
        w(f"| {r['system']} | {r['measured']:.1%} | {r['predicted']:.1%} | {r['measured_core']:.1%} | "
          f"{r['wall_s']:.1f} / {r['sim_wall_s']:.1f} | {pair('lost')} | {pair('checkpoint_stall')} | "
          f"{pair('restore')} | {pair('restart_downtime')} | {r['seen'].get('other', 0.0):.1f} |\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--fail-at", type=int, nargs="*", default=[23, 41])
    parser.add_argument("--compute-s", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the measured costs go")
    parser.add_argument("--validate", type=Path, nargs="?", const=RESULTS, default=None,
                        help="only replay a results file through the simulation (no training)")
    args = parser.parse_args()
    if args.validate is not None:
        print_validation(validate(args.validate))
        return 0
    import ray

    ray.init(address="local", num_cpus=4, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1"}})
    root = Path(tempfile.mkdtemp(prefix="goodput-bench-"))
    (root / "data").mkdir()
    for i in range(SAMPLES):
        (root / "data" / f"{i:05d}.txt").write_text(str(i))
    results = {kind: run(kind, root, args) for kind in ("plain", "ray_goodput")}
    w = sys.stdout.write
    w(f"\n{args.steps} steps, 2 workers, checkpoint every {args.every} steps, worker SIGKILL at "
      f"steps {args.fail_at}, state {sum(p.numel() for p in _model().parameters()) * 12 / 2**20:.0f} MiB "
      f"(weights + AdamW) per rank, local-directory storage\n\n")
    w("| | wall s | goodput | steps lost | samples repeated | checkpoint stall s | restore s | restart downtime s |\n")
    w("|---|---:|---:|---:|---:|---:|---:|---:|\n")
    for kind, r in results.items():
        g = r["ledger"]
        w(f"| {kind} | {r['wall']:.1f} | {g['goodput']:.1%} | {g['steps_lost']} | {r['repeated']} | "
          f"{g['seconds']['checkpoint_stall']:.2f} | {g['seconds']['restore']:.2f} | "
          f"{g['seconds']['restart_downtime']:.1f} |\n")
    p, q = results["plain"], results["ray_goodput"]
    w(f"\nratios ray_goodput / plain: wall {q['wall'] / p['wall']:.2f}x, goodput "
      f"{q['ledger']['goodput'] / max(p['ledger']['goodput'], 1e-9):.2f}x, checkpoint stall "
      f"{q['ledger']['seconds']['checkpoint_stall'] / max(p['ledger']['seconds']['checkpoint_stall'], 1e-9):.2f}x\n")
    write_results(results, args, args.out)
    w(f"\nmeasured costs and schedules written to {args.out}\n")
    print_validation(validate(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
