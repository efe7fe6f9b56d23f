"""Where a whole-group restart's seconds go, phase by phase, for Ray Train and ray_goodput.

    python benchmarks/restart_anatomy.py [--failures 3] [--mb-per-rank 16] [--storage local|s3]

Each system runs the step-failures benchmark's DDP loop (2 CPU workers over gloo,
checkpoints every ``--every`` steps on a local directory, or with ``--storage s3`` on a
local moto S3 server at the Ray workers' niceness, as ``goodput_under_failures.py --mode
step-failures`` runs it); rank 1 is SIGKILLed at
``--failures`` steps. The controller's hooks are timed by two callbacks (``_anatomy.py``)
and the workers' side by the kill markers, the goodput events (restore) and the step
logs. Per restart:

    detection          the kill -> the controller's poll sees the failure
    decide + shutdown  -> the old group is shut down (failure decision, process-group
                          teardown bounded by TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, actors killed)
    start hooks        -> every controller callback's on_controller_start_worker_group returned
                          (ray_goodput: Recovery's resume choice and node checks)
    actor start        -> the new worker actors are up (placement group, new processes, import ray)
    train context      -> init_train_context returned (Ray Train's worker module, its imports)
    process group      -> the backend's process group and the after-start callbacks
    launch             -> the training function runs
    set-up             -> the restore begins (the loop builds its model, optimizer and
                          checkpointer; the start of the goodput events' restore)
    restore            -> the checkpoint is loaded (the end of the goodput events' restore)
    first step         -> the first step after the restore ended

Both systems run in one invocation, interleaved per repeat; the table gives each phase's
mean and ray_goodput / Ray Train per phase. Results: benchmarks/results/restart_anatomy_<kind>.json.
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

import _anatomy
import _results
import _step_failures
import psutil

from ray_goodput.goodput._events import read_events
from ray_goodput.storage import StorageLocation

PHASES = [
    "detection",
    "decide + shutdown",
    "start hooks",
    "actor start",
    "train context",
    "process group",
    "launch",
    "set-up",
    "restore",
    "first step",
]
SYSTEMS = {"rt_async_dcp": "Ray Train (ASYNC dcp report)", "rg_whole": "ray_goodput whole-group"}
RESULTS = _results.default_path("restart_anatomy")
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def _marks(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _after(marks: list[dict], what: str, t: float) -> float | None:
    return next((m["t"] for m in marks if m["what"] == what and m["t"] >= t), None)


def restarts(marks: list[dict], kills: list[float], restores: list[dict], first_steps: list[float]) -> list[dict]:
    """One row of phase durations per kill (None where a clock is missing)."""
    rows = []
    for kill in sorted(kills):
        seen = _after(marks, "late:failure_seen", kill)
        points = {"kill": kill, "seen": seen}
        if seen is not None:
            points["shutdown"] = _after(marks, "late:shutdown_done", seen)
        if points.get("shutdown") is not None:
            points["hooks"] = _after(marks, "late:start_worker_group", points["shutdown"])
        if points.get("hooks") is not None:
            points["actors"] = _after(marks, "late:actors_up", points["hooks"])
        if points.get("actors") is not None:
            points["context"] = _after(marks, "early:after_worker_group_start", points["actors"])
        if points.get("context") is not None:
            points["pg"] = _after(marks, "late:after_worker_group_start", points["context"])
        if points.get("pg") is not None:
            points["launch"] = _after(marks, "late:training_started", points["pg"])
        hooks_began = _after(marks, "early:start_worker_group", points.get("shutdown") or kill)
        if points.get("launch") is not None:
            restore = next((r for r in sorted(restores, key=lambda r: r["t"]) if r["t"] >= points["launch"]), None)
            points["restore_began"] = restore["t0"] if restore else None
            points["restored"] = restore["t"] if restore else None
            first = next((t for t in sorted(first_steps) if t >= (points["restored"] or points["launch"])), None)
            points["first"] = first
        keys = ["kill", "seen", "shutdown", "hooks", "actors", "context", "pg", "launch", "restore_began", "restored",
                "first"]  # fmt: skip
        row = {}
        for phase, (a, b) in zip(PHASES, zip(keys, keys[1:])):
            ta, tb = points.get(a), points.get(b)
            if phase == "start hooks" and hooks_began is not None:
                ta = hooks_began  # the hooks' own time, not the wait between shutdown and them
            row[phase] = None if ta is None or tb is None else round(tb - ta, 3)
        row["total"] = None if points.get("first") is None else round(points["first"] - kill, 3)
        rows.append(row)
    return rows


def _storage(system: str, rep: int, work: Path, args) -> tuple[dict, StorageLocation]:
    """RunConfig's storage arguments, and where the run's goodput events land."""
    import pyarrow.fs as pafs

    if args.storage == "local":
        run_dir = str(work / "runs" / system)
        return {"storage_path": str(work / "runs")}, StorageLocation(
            uri=run_dir, fs=pafs.LocalFileSystem(), root=run_dir
        )
    fs = pafs.S3FileSystem(endpoint_override=args.endpoint, scheme="http", allow_bucket_creation=True)
    bucket = f"anatomy-{system.replace('_', '-')}-{rep}-{os.getpid()}"
    fs.create_dir(bucket)
    run_dir = f"{bucket}/runs/{system}"
    location = StorageLocation(uri=f"s3://{run_dir}", fs=fs, root=run_dir)
    return {"storage_path": f"{bucket}/runs", "storage_filesystem": fs}, location


def run_one(system: str, rep: int, root: Path, args) -> dict:
    import ray.train.torch
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    import ray_goodput

    work = root / f"{system}-{rep}"
    markers = work / "markers"
    markers.mkdir(parents=True)
    fail_at = [args.first_fail + i * args.fail_gap for i in range(args.failures)]
    cfg = {
        "system": system,
        "markers": str(markers),
        "stage": str(work / "stage"),
        "steps": fail_at[-1] + args.fail_gap,
        "every": args.every,
        "compute_s": args.compute_s,
        "mb_per_rank": args.mb_per_rank,
        "fail_at": fail_at,
    }
    clocks = work / "clocks.jsonl"
    os.environ["ANATOMY_OUT"] = str(clocks)  # read by both clocks where they are built, here
    late = _anatomy.Clock()
    goodput = ray_goodput.GoodputCallback(tracking_uri=f"sqlite:///{work}/mlflow.db")
    storage, events_at = _storage(system, rep, work, args)
    run_config = RunConfig(name=system, failure_config=FailureConfig(max_failures=args.failures + 2), **storage)
    common = {"train_loop_config": cfg, "scaling_config": ScalingConfig(num_workers=2)}
    if system == "rt_async_dcp":
        callbacks = [goodput, goodput.controller_callback(), late]  # the hooks ray_goodput's trainer adds
        run_config = run_config.__class__(**{**run_config.__dict__, "callbacks": callbacks})
        trainer = ray.train.torch.TorchTrainer(_step_failures.whole_group_loop, run_config=run_config, **common)
    else:
        recovery = ray_goodput.Recovery(max_failures_per_node=args.failures + 3)  # one node
        trainer = ray_goodput.TorchTrainer(
            _step_failures.whole_group_loop, run_config=run_config, callbacks=[goodput, recovery, late], **common
        )
    began = time.time()
    trainer.fit()
    wall = time.time() - began
    kills = [p.stat().st_mtime for p in markers.glob("*.fired")]
    events = [e for attempt in read_events(events_at).values() for e in attempt]
    restores = [e for e in events if e.get("e") == "restore"]
    first_steps = []
    for p in markers.glob("steps-0-*.jsonl"):
        lines = p.read_text().splitlines()
        if lines:
            first_steps.append(json.loads(lines[0])["t"])
    rows = restarts(_marks(clocks), kills, restores, first_steps)
    return {"system": system, "rep": rep, "wall_s": wall, "restarts": rows}


def _mean(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.fmean(got) if got else None


def summarize(results: list[dict]) -> dict:
    out = {}
    for system in SYSTEMS:
        rows = [row for r in results if r["system"] == system for row in r["restarts"]]
        out[system] = {p: _mean([row[p] for row in rows]) for p in [*PHASES, "total"]}
        out[system]["restarts"] = len(rows)
    return out


def table(summary: dict) -> str:
    ray_, ours = summary["rt_async_dcp"], summary["rg_whole"]
    lines = [
        f"| phase | {SYSTEMS['rt_async_dcp']} s | {SYSTEMS['rg_whole']} s | ray_goodput / Ray |",
        "|---|---|---|---|",
    ]
    for p in [*PHASES, "total"]:
        a, b = ray_[p], ours[p]
        ratio = f"{b / a:.2f}x" if a and b is not None and a > 0.005 else "-"
        fa, fb = ("-" if a is None else f"{a:.2f}"), ("-" if b is None else f"{b:.2f}")
        lines.append(f"| {p} | {fa} | {fb} | {ratio} |")
    lines.append(f"\nrestarts measured: Ray Train {ray_['restarts']}, ray_goodput {ours['restarts']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--failures", type=int, default=3, help="kills per run")
    parser.add_argument("--repeats", type=int, default=1, help="runs per system, interleaved")
    parser.add_argument("--first-fail", type=int, default=12)
    parser.add_argument("--fail-gap", type=int, default=8, help="steps between kills")
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--compute-s", type=float, default=0.05)
    parser.add_argument("--mb-per-rank", type=int, default=16)
    parser.add_argument("--storage", choices=["local", "s3"], default="local", help="where checkpoints go")
    parser.add_argument(
        "--storage-server-nice",
        type=int,
        default=15,
        help="--storage s3: niceness of the local S3 server (default 15, Ray's worker niceness: it stands in "
        "for remote storage, which takes no CPU from the node)",
    )
    parser.add_argument("--out", type=Path, default=None, help="default: restart_anatomy_<kind>[_s3].json")
    args = parser.parse_args()
    if args.out is None:
        args.out = RESULTS if args.storage == "local" else _results.default_path("restart_anatomy_s3")
    run = _results.start_run("restart_anatomy")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    # Ray builds the env-var callbacks in the driver and ships them to the controller by
    # value: the controller cannot import this directory.
    os.environ["RAY_TRAIN_CALLBACKS"] = "_anatomy.EarlyClock"
    import ray
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(_anatomy)
    env = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"]}
    moto = None
    if args.storage == "s3":
        from ray_goodput.testing._s3 import start_moto_server

        for k, v in S3_ENV.items():
            os.environ.setdefault(k, v)
        env.update(S3_ENV)
        moto, args.endpoint = start_moto_server()
        psutil.Process(moto.pid).nice(args.storage_server_nice)
    ray.init(log_to_driver=False, runtime_env={"env_vars": env})
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="anatomy-") as tmp:
            for rep in range(args.repeats):
                for system in SYSTEMS:
                    results.append(run_one(system, rep, Path(tmp), args))
                    print(f"[{system} #{rep}] {results[-1]['wall_s']:.0f} s, {len(results[-1]['restarts'])} "
                          "restarts", file=sys.stderr)  # fmt: skip
    finally:
        ray.shutdown()
        if moto is not None:
            moto.terminate()
            moto.wait(timeout=10)
    summary = summarize(results)
    text = table(summary)
    print(text)
    _results.write(args.out, run, {"args": {k: str(v) for k, v in vars(args).items()}, "runs": results,
                                   "summary": summary, "table": text})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
