"""Goodput under failures: the same job and failure schedule, plain Ray Train
checkpointing vs ray_goodput, side by side in one run.

plain:       rank 0 torch.save()s the full state, ray.train.report(checkpoint, SYNC upload);
             restore from ray.train.get_checkpoint(); the data restarts from the epoch start.
ray_goodput: Checkpointer (async, sharded, committed), DataLoader position in the checkpoint.

Both feed the same ledger (GoodputCallback), so the numbers are comparable.
Usage: python benchmarks/goodput_under_failures.py [--steps 60 --every 10 --fail-at 23 41]

Each run's measured costs (step, save blocking, time to durable, restore, restart, startup)
and its failure times go to benchmarks/results/goodput_under_failures_cpu.json (``--out``), in
the costs schema of ``ray-goodput simulate --costs``. ``--validate [FILE]`` replays those failure
times through the simulation (ray_goodput.plan.replay) with those costs and prints the
predicted goodput beside the measured one (done after every run too).

``--mode s3-poisson``: checkpoints at their real price. moto S3 over HTTP, FSDP2 state of
--mb-per-rank MiB per rank, worker SIGKILLs at seeded Poisson times (wall seconds from the
run's first step), and three systems (rank-0 torch.save + report SYNC, Ray Train report
ASYNC with dcp.save, ray_goodput) each saving at Daly's interval for its own blocking time,
measured by one calibration save; MET / MISSED against ``benchmarks/targets.toml``'s
``goodput_under_failures`` target. Results: benchmarks/results/goodput_under_failures_s3_poisson_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _results
import _savers
import _step_failures
import _targets
import torch

SAMPLES, BATCH = 256, 4


def _goodput_callbacks(root: Path) -> list:
    """The goodput ledger's callback and its controller hooks, for every system alike
    (ray_goodput's trainer would add the hooks): its MLflow work holds up no report."""
    from ray_goodput import GoodputCallback

    goodput = GoodputCallback(tracking_uri=f"sqlite:///{root}/mlflow.db")
    return [goodput, goodput.controller_callback()]


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
    from ray.train.torch import prepare_model

    from ray_goodput.data import DataLoader, FileDataset
    from ray_goodput.goodput import get_recorder

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
            torch.save(
                {"model": model.module.state_dict(), "optim": optim.state_dict(), "step": step, "epoch": loader.epoch},
                os.path.join(d, "state.pt"),
            )
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
    log = open(Path(cfg["markers"]) / f"samples-{os.getpid()}-{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 - for the whole run
    while step < cfg["steps"]:
        for ids in loader:
            step += 1
            _step(model, optim, ids, cfg["compute_s"])
            log.write(
                json.dumps({"t": time.time(), "step": step, "rank": rank, "epoch": loader.epoch, "ids": ids.tolist()})
                + "\n"
            )
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

    markers = root / f"{kind}-markers"
    markers.mkdir(parents=True)
    cfg = {
        "data": str(root / "data"),
        "markers": str(markers),
        "steps": args.steps,
        "every": args.every,
        "fail_at": args.fail_at,
        "compute_s": args.compute_s,
    }
    trainer = TorchTrainer(
        plain_loop if kind == "plain" else goodput_loop,
        train_loop_config=cfg,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=kind,
            storage_path=str(root / "runs"),
            failure_config=FailureConfig(max_failures=len(args.fail_at) + 1),
            callbacks=_goodput_callbacks(root),
        ),
    )
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
    from ray_goodput.checkpoint.protocol._catalog import list_checkpoints

    started = {e["step"]: e["t"] for a in attempts for e in a if e["e"] == "step" and e["step"] % every == 0}
    return [
        c.created - started[c.step]
        for c in list_checkpoints(str(ckpt_root))
        if c.committed and c.created and c.step in started
    ]


def _measured(kind: str, attempts: list[list[dict]], start: float, every: int, ckpt_root: Path, ledger: dict) -> dict:
    """Costs in the schema of ray_goodput.plan's costs JSON, plus this run's failure schedule."""
    steps = [e for a in attempts for e in a if e["e"] == "step"]
    # Mean compute per kept step, so that the replay's kept work equals the ledger's productive.
    step_s = ledger["seconds"]["productive"] / max(1, ledger["steps_kept"])
    blocking = _median([e["ckpt"] for e in steps if e.get("ckpt", 0) > 0])
    restores = [[e["t"] - e["t0"] for e in a if e["e"] == "restore"] for a in attempts]
    durable = blocking if kind == "plain" else _median(_durable_after_start(attempts, every, ckpt_root), blocking)
    failures = max(1, len(attempts) - 1)
    system = {
        "name": kind,
        "step_s": step_s,
        "save_blocking_s": blocking,
        "durable_s": max(durable, blocking),
        "restore_s": _median([r for rs in restores[1:] for r in rs]),
        "restart_s": ledger["seconds"]["restart_downtime"] / failures,
        "interval": every * step_s,
    }
    return {
        "system": system,
        "failures_s": [a[-1]["t"] - start for a in attempts[:-1]],
        "startup_s": ledger["seconds"]["startup"] + sum(restores[0]) if restores else 0.0,
        "work_s": ledger["seconds"]["productive"],
        "wall_s": ledger["total_s"],
        "goodput": ledger["goodput"],
        "seconds": ledger["seconds"],
    }


# ----------------------------------------------------------------------------- --mode s3-poisson
# Checkpoints at their real price: S3 (moto over HTTP), FSDP2-sharded state of --mb-per-rank
# MiB per rank, a seeded Poisson failure schedule, and each system saving at the interval
# ray_goodput.plan recommends for its own blocking time, measured by a calibration save.

S3_SYSTEMS = {
    "torch_save_sync": "rank-0 torch.save + report SYNC",
    "rt_async_dcp": "Ray Train report ASYNC (dcp.save)",
    "ray_goodput": "ray_goodput Checkpointer",
}
CAL_STEP = 5  # steps 2..5 give the step time; the save after step 5 is the calibration save


def poisson_failures(seed: int, mtbf_s: float, horizon_s: float) -> list[float]:
    """Failure times (wall seconds from the run's first step) of a Poisson process."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t > horizon_s:
            return out
        out.append(round(t, 2))


def _sharded_state(cfg: dict):
    """FSDP2-sharded Linear stack + AdamW with materialized state: mb_per_rank MiB per rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    d = 2048 if cfg["mb_per_rank"] >= 128 else 512
    layers = max(2, round(cfg["mb_per_rank"] * 2**20 * world / 12 / (d * d)))  # fp32 param+exp_avg+exp_avg_sq
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    _adam_step(model, optim)
    return model, optim


def _adam_step(model, optim) -> None:
    """A training step's update of the whole shard (synthetic gradient; the forward pass is
    replaced by compute_s of sleep so the 2 shared cores stay free for the savers)."""
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optim.step()
    optim.zero_grad(set_to_none=True)


def _allmax(x: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class _GoodputSaver:
    """ray_goodput's Checkpointer on the run's storage (the same S3 bucket)."""

    def __init__(self, cfg: dict, model, optim) -> None:
        from ray_goodput import Checkpointer

        self.state = {"model": model, "optim": optim}
        self.ckpt = Checkpointer(keep_last=2, staging_dir=cfg["stage"])

    def restore(self) -> int:
        return self.ckpt.restore(self.state) or 0

    def save(self, step: int) -> None:
        self.ckpt.save(step, self.state)

    def wait_durable(self) -> float | None:
        """Seconds until the saves made so far have committed (``Checkpointer.wait``)."""
        began = time.perf_counter()
        self.ckpt.wait()
        return time.perf_counter() - began

    def close(self) -> dict:
        self.ckpt.close()
        return {"superseded": len(self.ckpt.stats.superseded), "committed": len(self.ckpt.stats.committed)}


SAVERS = {"torch_save_sync": _savers.TorchSaveSync, "rt_async_dcp": _savers.RayAsyncDcp, "ray_goodput": _GoodputSaver}


def _killer(cfg: dict, t0: float) -> None:
    """SIGKILL this worker at each scheduled time not yet fired (a marker per failure, so a
    restarted worker group skips the ones already fired; one overdue during the downtime
    fires as soon as the next attempt's killer starts)."""
    from ray_goodput.testing import kill_self

    for i, t in enumerate(cfg["failures_s"]):
        marker = Path(cfg["markers"]) / f"poisson-{i}.fired"
        if marker.exists():
            continue
        time.sleep(max(0.0, t0 + t - time.time()))
        marker.write_text(f"{time.time()}")
        kill_self()


def _start_killer(cfg: dict, rank: int, first_step: bool) -> bool:
    """Start the kill thread on the kill rank once the run's first-step time is known."""
    import threading

    if rank != 1:
        return True
    origin = Path(cfg["markers"]) / "first-step.t"
    if not origin.exists():
        if not first_step:
            return False
        origin.write_text(f"{time.time()}")
    threading.Thread(target=_killer, args=(cfg, float(origin.read_text())), daemon=True).start()
    return True


def _plan_every(cfg: dict, step_times: list[float], save_s: float, durable_s: float | None) -> dict:
    """Daly's interval for this system's measured blocking time and, where the loop can wait
    for it, time to durable (the planner never goes below the upload), in whole steps (same
    on all ranks)."""
    from ray_goodput.plan import optimal_interval_s

    step_s = _allmax(statistics.median(step_times))
    save_s = _allmax(save_s)
    durable_s = None if durable_s is None else _allmax(durable_s)  # None on every rank alike
    interval_s = optimal_interval_s(save_s, cfg["mtbf_s"], durable_s=durable_s)
    return {
        "step_s": step_s,
        "save_s": save_s,
        "durable_s": durable_s,
        "interval_s": interval_s,
        "every": max(1, round(interval_s / step_s)),
    }


def s3_loop(cfg: dict) -> None:
    import torch.distributed as dist

    from ray_goodput.goodput import get_recorder, record_step

    torch.set_num_threads(1)
    rank, rec = dist.get_rank(), get_recorder()
    model, optim = _sharded_state(cfg)
    saver = SAVERS[cfg["system"]](cfg, model, optim)
    killing = _start_killer(cfg, rank, first_step=False)
    t0 = time.time()
    step = saver.restore()
    if cfg["system"] != "ray_goodput":
        rec.restored(step, t0, time.time())
    plan_file = Path(cfg["markers"]) / "plan.json"
    plan = json.loads(plan_file.read_text()) if plan_file.exists() else None
    log = open(Path(cfg["markers"]) / f"saves-{os.getpid()}-{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 - for the whole run
    times, since = [], 0
    while step < cfg["steps"]:
        t = time.perf_counter()
        _adam_step(model, optim)
        dist.all_reduce(torch.zeros(1))  # data-parallel lockstep
        time.sleep(cfg["compute_s"])
        step, since = step + 1, since + 1
        times.append(time.perf_counter() - t)
        record_step(step)
        killing = killing or _start_killer(cfg, rank, first_step=True)
        if plan is None and len(times) < CAL_STEP:
            continue
        if plan is not None and since < plan["every"]:
            continue
        b = time.perf_counter()
        saver.save(step)
        blocked = time.perf_counter() - b
        if cfg["system"] != "ray_goodput":
            rec.add_checkpoint_stall(blocked)
        since = 0
        if plan is None:
            # The calibration save's time to durable, where the loop can wait for it (not
            # for Ray Train's ASYNC upload); the wait is a checkpoint stall, once.
            waited = saver.wait_durable()
            if waited:
                rec.add_checkpoint_stall(waited)
            plan = _plan_every(cfg, times[1:], blocked, None if waited is None else blocked + waited)
            if rank == 0:
                plan_file.write_text(json.dumps(plan))
        log.write(json.dumps({"t": time.time(), "step": step, "blocked": blocked}) + "\n")
    stats = saver.close()
    log.write(json.dumps({"t": time.time(), "end": step, **stats}) + "\n")
    if cfg["system"] != "ray_goodput":
        rec.end()


RESULTS = _results.default_path("goodput_under_failures")


def write_results(results: dict, args, path: Path, meta: dict) -> None:
    """Measured costs (ray-goodput simulate --costs schema) and each run's schedule and ledger."""
    _results.write(
        path,
        meta,
        {
            "source": f"benchmarks/goodput_under_failures.py, {time.strftime('%Y-%m-%d')}, 2 workers, "
            f"local-directory storage, every {args.every} steps",
            "args": {"steps": args.steps, "every": args.every, "fail_at": args.fail_at, "compute_s": args.compute_s},
            "systems": [r["measured"]["system"] for r in results.values()],
            "runs": {k: {kk: v for kk, v in r["measured"].items() if kk != "system"} for k, r in results.items()},
        },
    )


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
        rows.append(
            {
                "system": system.name,
                "measured": run["goodput"],
                "predicted": sim.goodput,
                "measured_core": seen["productive"] / core if core > 0 else 0.0,
                "wall_s": run["wall_s"],
                "sim_wall_s": sim.wall_s,
                "seen": seen,
                "sim": sim.seconds,
            }
        )
    return rows


def print_validation(rows: list[dict]) -> None:
    w = sys.stdout.write
    w("\nvalidation: ray_goodput.plan.replay with the measured costs and failure times\n\n")
    w(
        "| system | measured goodput | predicted | measured w/o other+data_stall | wall s (measured / sim) "
        "| lost s | checkpoint stall s | restore s | restart downtime s | other s |\n"
    )
    w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    for r in rows:
        pair = lambda k, r=r: f"{r['seen'][k]:.1f} / {r['sim'][k]:.1f}"  # noqa: E731 - a one-line formatter
        w(
            f"| {r['system']} | {r['measured']:.1%} | {r['predicted']:.1%} | {r['measured_core']:.1%} | "
            f"{r['wall_s']:.1f} / {r['sim_wall_s']:.1f} | {pair('lost')} | {pair('checkpoint_stall')} | "
            f"{pair('restore')} | {pair('restart_downtime')} | {r['seen'].get('other', 0.0):.1f} |\n"
        )


def run_s3(system: str, root: Path, endpoint: str, args, failures: list[float]) -> dict:
    """One system's run on its own bucket; its ledger, saves and calibrated plan."""
    import pyarrow.fs as pafs
    import ray.train.torch
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    import ray_goodput
    from ray_goodput.goodput import compute
    from ray_goodput.goodput._events import read_events
    from ray_goodput.goodput._report import summary
    from ray_goodput.storage import StorageLocation

    fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", allow_bucket_creation=True)
    bucket = f"bench-{system.replace('_', '-')}-{os.getpid()}"
    fs.create_dir(bucket)
    markers = root / f"{system}-markers"
    markers.mkdir(parents=True)
    cfg = {
        "system": system,
        "markers": str(markers),
        "stage": str(root / f"{system}-stage"),
        "steps": args.steps,
        "compute_s": args.compute_s,
        "mb_per_rank": args.mb_per_rank,
        "failures_s": failures,
        "mtbf_s": args.mtbf_s,
    }
    trainer_cls = ray_goodput.TorchTrainer if system == "ray_goodput" else ray.train.torch.TorchTrainer
    run_config = RunConfig(
        name=system,
        storage_path=f"{bucket}/runs",
        storage_filesystem=fs,
        failure_config=FailureConfig(max_failures=len(failures) + 2),
        callbacks=_goodput_callbacks(root),
    )
    extra = {}
    if system == "ray_goodput":
        # One node: the injected kills must not get it isolated (Recovery's default is 2 failures).
        extra["recovery"] = ray_goodput.Recovery(max_failures_per_node=len(failures) + 3)
    trainer = trainer_cls(
        s3_loop, train_loop_config=cfg, scaling_config=ScalingConfig(num_workers=2), run_config=run_config, **extra
    )
    start = time.time()
    trainer.fit()
    wall = time.time() - start
    where = f"{bucket}/runs/{system}"
    events = read_events(StorageLocation(uri=f"s3://{where}", fs=fs, root=where))
    ledger = summary(compute(list(events.values()), job_start=start))
    saves = [json.loads(line) for f in markers.glob("saves-*-0.jsonl") for line in f.read_text().splitlines()]
    fired = sorted(float(f.read_text()) for f in markers.glob("poisson-*.fired"))
    origin = float((markers / "first-step.t").read_text())
    return {
        "system": system,
        "wall": wall,
        "ledger": ledger,
        "plan": json.loads((markers / "plan.json").read_text()),
        "saves": sum("step" in r for r in saves),
        "blocked": [r["blocked"] for r in saves if "step" in r],
        "failures_fired_s": [round(t - origin, 1) for t in fired],
    }


def _s3_table(results: list[dict], args, failures: list[float]) -> str:
    out = [
        f"{args.steps} steps of ~{args.compute_s:.2f} s compute + an AdamW update, 2 workers, "
        f"{args.mb_per_rank} MiB of FSDP2 state (weights + AdamW) per rank, moto S3 over HTTP; "
        f"worker SIGKILLs (rank 1) at {failures} s after each run's first step "
        f"(Poisson, seed {args.seed}, MTBF {args.mtbf_s:.0f} s)\n",
        "| system | calibration save s | its time to durable s | interval s (steps) | wall s | goodput "
        "| goodput w/o startup | productive s | lost s | checkpoint stall s | restore s | restart downtime s "
        "| startup s | other s | failures | saves "
        "| superseded |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        g, p, sec = r["ledger"], r["plan"], r["ledger"]["seconds"]
        durable = "-" if p.get("durable_s") is None else f"{p['durable_s']:.2f}"  # None: not measurable
        sup = g["checkpoints_superseded"] if r["system"] == "ray_goodput" else "-"
        out.append(
            f"| {S3_SYSTEMS[r['system']]} | {p['save_s']:.2f} | {durable} | {p['interval_s']:.1f} ({p['every']}) | "
            f"{r['wall']:.1f} | {g['goodput']:.1%} | {_no_startup(g):.1%} | {sec['productive']:.1f} | "
            f"{sec['lost']:.1f} | {sec['checkpoint_stall']:.1f} | {sec['restore']:.1f} | "
            f"{sec['restart_downtime']:.1f} | {sec['startup']:.1f} | {sec.get('other', 0.0):.1f} | "
            f"{g['failures']} | {r['saves']} | {sup} |"
        )
    rg = next((r for r in results if r["system"] == "ray_goodput"), None)
    target = _targets.load("goodput_under_failures")["s3_poisson_goodput"]
    for name, key in (("goodput", lambda g: g["goodput"]), ("goodput w/o startup", _no_startup)):
        native = max((r for r in results if r["system"] != "ray_goodput"), key=lambda r: key(r["ledger"]), default=None)
        if native and rg:
            ratio = key(rg["ledger"]) / max(key(native["ledger"]), 1e-9)
            out.append(
                f"\nray_goodput {name} / best Ray-native ({S3_SYSTEMS[native['system']]}): {ratio:.2f}× "
                f"→ {target.verdict(ratio)}"
            )
    return "\n".join(out) + "\n"


def _no_startup(ledger: dict) -> float:
    """Goodput of the time after startup (Ray, worker group, first restore): what checkpointing can change."""
    sec = ledger["seconds"]
    return sec["productive"] / max(1e-9, ledger["total_s"] - sec["startup"])


S3_RESULTS = _results.default_path("goodput_under_failures_s3_poisson")


def main_s3(args, meta: dict) -> int:
    failures = poisson_failures(args.seed, args.mtbf_s, args.horizon_s)
    results = []
    with _step_failures.local_s3_and_ray(4, args.storage_server_nice, "goodput-s3-") as (endpoint, root):
        for system in args.systems:
            results.append(run_s3(system, root, endpoint, args, failures))
            sys.stdout.write(f"[{system}] {results[-1]['wall']:.0f} s\n")
            sys.stdout.flush()
            _results.write(
                args.out,
                meta,
                {
                    "source": "benchmarks/goodput_under_failures.py --mode s3-poisson, "
                    + time.strftime("%Y-%m-%d %H:%M"),
                    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "failures_s": failures,
                    "load_avg": os.getloadavg(),
                    "runs": results,
                },
            )
    sys.stdout.write("\n" + _s3_table(results, args, failures))
    sys.stdout.write(f"\nresults written to {args.out}; load average at the end {os.getloadavg()}\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--fail-at", type=int, nargs="*", default=[23, 41])
    parser.add_argument("--compute-s", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the measured costs go")
    parser.add_argument(
        "--validate",
        type=Path,
        nargs="?",
        const=RESULTS,
        default=None,
        help="only replay a results file through the simulation (no training)",
    )
    parser.add_argument(
        "--mode",
        choices=["fixed", "s3-poisson", "step-failures"],
        default="fixed",
        help="fixed: local storage, --every, --fail-at (the default); s3-poisson: moto S3, "
        "a Poisson failure schedule, each system at its planned interval; step-failures: replica "
        "mode against whole-group restarts, failures counted in steps (benchmarks/_step_failures.py)",
    )
    parser.add_argument("--mb-per-rank", type=int, default=256, help="s3-poisson: state per rank, MiB")
    parser.add_argument("--mtbf-s", type=float, default=60.0, help="s3-poisson: the schedule's mean")
    parser.add_argument("--seed", type=int, default=0, help="s3-poisson: the schedule's seed")
    parser.add_argument("--horizon-s", type=float, default=900.0, help="s3-poisson: schedule length")
    parser.add_argument("--systems", nargs="+", choices=list(S3_SYSTEMS), default=list(S3_SYSTEMS))
    parser.add_argument("--table", action="store_true", help="s3-poisson: only print the table of --out")
    parser.add_argument(
        "--storage-server-nice",
        type=int,
        default=15,
        help="S3 modes: niceness of the local S3 server (default 15, Ray's worker niceness: it stands in for "
        "remote storage, which takes no CPU from the node; at moto's default, 0, it outranks every Ray "
        "worker for the shared cores, 28 to 1, and slows whichever process waits on a core while it serves)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="step-failures: schedule seeds")
    parser.add_argument("--failures", type=int, default=3, help="step-failures: failures per run")
    parser.add_argument(
        "--min-gap",
        type=int,
        default=5,
        help="step-failures: fewest steps between two failures; more than a replacement takes, in the "
        "survivors' steps, or replica mode meets fewer failures than scheduled and the verdict is void",
    )
    parser.add_argument("--state-mb", type=int, default=72, help="step-failures: DDP state per rank, MiB")
    parser.add_argument(
        "--workers", type=int, default=2, help="step-failures: training workers (replica mode: one replica each)"
    )
    parser.add_argument(
        "--step-systems", nargs="+", choices=list(_step_failures.SYSTEMS), default=list(_step_failures.SYSTEMS)
    )
    args = parser.parse_args()
    if args.mode == "step-failures":
        if args.out == RESULTS:
            args.out = _step_failures.RESULTS
        args.mb_per_rank, args.systems = args.state_mb, args.step_systems
        return _step_failures.main(args, _results.start_run("goodput_under_failures"))
    if args.mode == "s3-poisson":
        if args.out == RESULTS:
            args.out = S3_RESULTS
        if args.table:
            doc = json.loads(args.out.read_text())
            sys.stdout.write(_s3_table(doc["runs"], argparse.Namespace(**doc["args"]), doc["failures_s"]))
            return 0
        return main_s3(args, _results.start_run("goodput_under_failures"))
    if args.validate is not None:
        print_validation(validate(args.validate))
        return 0
    meta = _results.start_run("goodput_under_failures")
    import ray

    ray.init(
        address="local",
        num_cpus=4,
        log_to_driver=False,
        runtime_env={"env_vars": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1"}},
    )
    root = Path(tempfile.mkdtemp(prefix="goodput-bench-"))
    (root / "data").mkdir()
    for i in range(SAMPLES):
        (root / "data" / f"{i:05d}.txt").write_text(str(i))
    results = {kind: run(kind, root, args) for kind in ("plain", "ray_goodput")}
    w = sys.stdout.write
    w(
        f"\n{args.steps} steps, 2 workers, checkpoint every {args.every} steps, worker SIGKILL at "
        f"steps {args.fail_at}, state {sum(p.numel() for p in _model().parameters()) * 12 / 2**20:.0f} MiB "
        f"(weights + AdamW) per rank, local-directory storage\n\n"
    )
    w("| | wall s | goodput | steps lost | samples repeated | checkpoint stall s | restore s | restart downtime s |\n")
    w("|---|---:|---:|---:|---:|---:|---:|---:|\n")
    for kind, r in results.items():
        g = r["ledger"]
        w(
            f"| {kind} | {r['wall']:.1f} | {g['goodput']:.1%} | {g['steps_lost']} | {r['repeated']} | "
            f"{g['seconds']['checkpoint_stall']:.2f} | {g['seconds']['restore']:.2f} | "
            f"{g['seconds']['restart_downtime']:.1f} |\n"
        )
    p, q = results["plain"], results["ray_goodput"]
    w(
        f"\nratios ray_goodput / plain: wall {q['wall'] / p['wall']:.2f}x, goodput "
        f"{q['ledger']['goodput'] / max(p['ledger']['goodput'], 1e-9):.2f}x, checkpoint stall "
        f"{q['ledger']['seconds']['checkpoint_stall'] / max(p['ledger']['seconds']['checkpoint_stall'], 1e-9):.2f}x\n"
    )
    write_results(results, args, args.out, meta)
    w(f"\nmeasured costs and schedules written to {args.out}\n")
    print_validation(validate(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
