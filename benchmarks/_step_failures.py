"""``goodput_under_failures.py --mode step-failures``: replica mode against whole-group restarts.

One seeded failure schedule **counted in steps of work** (rank 1 is SIGKILLed during those
steps, once each: a restarted group redoes the step without dying), so every system meets
the same failures; several seeds; the systems interleaved within each seed. In replica mode
rank 1 may still be being replaced when the survivor steps past a scheduled step: that
failure then kills the replacement at its first step (``FailAt(or_later=True)``). Every run
counts the failures it met (the fault markers); a run that met fewer than scheduled (the
job ended first) voids its seed's comparison, and the verdict says so: space the failures
further apart (``--min-gap``, in steps) than a replacement takes. A DDP model with
``--mb-per-rank`` MiB of state per rank (weights + AdamW), real gradients all-reduced over
gloo, checkpoints on S3 (moto over HTTP) every ``--every`` steps:

    rt_async_dcp   stock Ray Train: dcp.save into a local dir, ray.train.report(ASYNC);
                   a failure restarts the whole group, which resumes from Ray's checkpoint
    rg_whole       ray_goodput.TorchTrainer + Checkpointer; whole-group restart
    rg_replicas    ray_goodput.TorchTrainer(fault_tolerance=ReplicaGroups()) + Replica: only
                   the failed replica is replaced, the survivor keeps stepping

Every system feeds the same goodput ledger (GoodputCallback). Reported: goodput, every
badput bucket, the cost per failure (lost + restart downtime + restore + degraded seconds
over failures) and the survivors' largest step gap; MET / MISSED against ``targets.toml``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import _results
import _savers
import _targets
import psutil
import torch

SYSTEMS = {
    "rt_async_dcp": "Ray Train, whole-group restart, ASYNC dcp report",
    "rg_whole": "ray_goodput, whole-group restart",
    "rg_replicas": "ray_goodput, replica mode",
}
SAMPLES, BATCH, DIM = 100_000, 8, 1024
RESULTS = _results.default_path("goodput_under_failures_step_failures")


def failure_steps(seed: int, steps: int, failures: int, min_gap: int = 5) -> list[int]:
    """``failures`` distinct steps in ``[10, steps - 5)``, seeded, at least ``min_gap`` apart."""
    span = range(10, steps - 5)
    if min_gap < 1:
        raise ValueError(f"--min-gap must be at least 1 step (two failures on one step are one), got {min_gap}")
    if failures < 1 or len(span) < 1 + (failures - 1) * min_gap:
        raise ValueError(
            f"cannot place {failures} failures {min_gap} steps apart in steps 10..{steps - 6}: "
            "use more --steps, fewer --failures or a smaller --min-gap"
        )
    # Uniform over the placements that fit: each is `failures` non-decreasing offsets in
    # [0, slack] (the slack beyond the minimum gaps), i.e. `failures` distinct values drawn
    # from slack + failures, less their rank.
    rng = random.Random(seed)
    slack = len(span) - 1 - (failures - 1) * min_gap
    cuts = [x - i for i, x in enumerate(sorted(rng.sample(range(slack + failures), failures)))]
    return [span.start + cut + i * min_gap for i, cut in enumerate(cuts)]


def failures_met(markers: Path) -> int:
    """The scheduled failures a run met: one fault marker each (``FailAt``)."""
    return len(list(markers.glob("fault-step*-rank1.fired")))


class _Ints(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def _model(mb_per_rank: int) -> torch.nn.Module:
    layers = max(1, round(mb_per_rank * 2**20 / 12 / (DIM * DIM)))  # fp32 weights + exp_avg + exp_avg_sq
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM, bias=False) for _ in range(layers)])


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    x = torch.sin(ids.float()[:, None] * torch.arange(DIM) / 1000.0)
    return model(x).pow(2).mean()


def _faults(cfg: dict):
    from ray_goodput.testing import FailAt

    return [FailAt(step=s, rank=1, marker_dir=cfg["markers"], or_later=True) for s in cfg["fail_at"]]


def _log(cfg: dict, rank: int):
    return open(Path(cfg["markers"]) / f"steps-{rank}-{os.getpid()}.jsonl", "a", buffering=1)


def whole_group_loop(cfg: dict) -> None:
    """rt_async_dcp and rg_whole: torch DDP over gloo, a whole-group restart per failure."""
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    from ray_goodput.goodput import get_recorder, record_step

    torch.set_num_threads(1)
    rank, rec = dist.get_rank(), get_recorder()
    base = _model(cfg["mb_per_rank"])
    model = ray.train.torch.prepare_model(base)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    saver = _savers.RayAsyncDcp(cfg, base, optim) if cfg["system"] == "rt_async_dcp" else _Goodput(base, optim)
    t0 = time.time()
    step = saver.restore()
    if cfg["system"] == "rt_async_dcp":
        rec.restored(step, t0, time.time())
    faults, log = _faults(cfg), _log(cfg, rank)
    while step < cfg["steps"]:
        for f in faults:
            f.maybe_fail(step + 1, rank)
        ids = torch.arange(step * 2 * BATCH + rank * BATCH, step * 2 * BATCH + (rank + 1) * BATCH)
        optim.zero_grad()
        _loss(model, ids).backward()
        optim.step()
        time.sleep(cfg["compute_s"])
        step += 1
        record_step(step)
        log.write(json.dumps({"step": step, "t": time.time()}) + "\n")
        if step % cfg["every"] == 0:
            b = time.perf_counter()
            saver.save(step)
            if cfg["system"] == "rt_async_dcp":
                rec.add_checkpoint_stall(time.perf_counter() - b)
    saver.close()
    if cfg["system"] == "rt_async_dcp":
        rec.end()


def replica_loop(cfg: dict, clocks: dict[str, float] | None = None) -> None:
    """rg_replicas: each worker a torchft replica group; a failure replaces that one alone.

    ``clocks`` (``replacement_anatomy.py``): filled with when the training function began
    and each stage of its set-up ended, and written to ``clocks-<slot>-<pid>.json`` once the
    ``Replica`` is entered."""
    marks = {} if clocks is None else clocks
    marks["train_fn"] = time.time()
    import ray.train

    from ray_goodput.replica import Replica

    torch.set_num_threads(1)
    slot = ray.train.get_context().get_world_rank()
    marks["imports"] = time.time()
    model = _model(cfg["mb_per_rank"])
    marks["model"] = time.time()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    marks["optimizer"] = time.time()
    faults, log = _faults(cfg), _log(cfg, slot)
    with Replica(
        model, optim, _Ints(), batch_size=BATCH, shuffle=False, save_every=cfg["every"], checkpoint={"keep_last": 2}
    ) as rep:
        marks["replica"] = time.time()
        if clocks is not None:
            (Path(cfg["markers"]) / f"clocks-{slot}-{os.getpid()}.json").write_text(json.dumps(marks))
        for ids in rep.batches(total_steps=cfg["steps"]):
            for f in faults:
                f.maybe_fail(rep.current_step + 1, slot)
            _loss(rep.model, ids).backward()
            time.sleep(cfg["compute_s"])
            if rep.step():
                log.write(json.dumps({"step": rep.current_step, "t": time.time(), "n": rep.participants}) + "\n")


class _Goodput:
    def __init__(self, model, optim) -> None:
        from ray_goodput import Checkpointer

        self.state = {"model": model, "optim": optim}
        self.ckpt = Checkpointer(keep_last=2)

    def restore(self) -> int:
        return self.ckpt.restore(self.state) or 0

    def save(self, step: int) -> None:
        self.ckpt.save(step, self.state)

    def close(self) -> dict:
        self.ckpt.close()
        return {}


def run_one(system: str, seed: int, fail_at: list[int], root: Path, endpoint: str, args, loop=None) -> dict:
    """One system's run of the schedule; ``loop`` replaces the system's training function
    (``replacement_anatomy.py`` logs clocks from its own)."""
    import pyarrow.fs as pafs
    import ray.train.torch
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    import ray_goodput
    from ray_goodput.goodput import compute
    from ray_goodput.goodput._events import read_events
    from ray_goodput.goodput._report import summary
    from ray_goodput.storage import StorageLocation

    fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", allow_bucket_creation=True)
    bucket = f"bench-{system.replace('_', '-')}-{seed}-{os.getpid()}"
    fs.create_dir(bucket)
    markers = root / f"{system}-{seed}"
    markers.mkdir(parents=True)
    cfg = {
        "system": system,
        "markers": str(markers),
        "stage": str(root / f"{system}-{seed}-stage"),
        "steps": args.steps,
        "every": args.every,
        "compute_s": args.compute_s,
        "mb_per_rank": args.mb_per_rank,
        "fail_at": fail_at,
    }
    goodput = ray_goodput.GoodputCallback(tracking_uri=f"sqlite:///{root}/mlflow.db")
    run_config = RunConfig(
        name=system,
        storage_path=f"{bucket}/runs",
        storage_filesystem=fs,
        failure_config=FailureConfig(max_failures=len(fail_at) + 2),
        # Its controller hooks too, for every system (ray_goodput's trainer would add them):
        # the accounting's MLflow work must not hold up any system's reports.
        callbacks=[goodput, goodput.controller_callback()],
    )
    common = {
        "train_loop_config": cfg,
        "scaling_config": ScalingConfig(num_workers=args.workers),
        "run_config": run_config,
    }
    if system == "rt_async_dcp":
        trainer = ray.train.torch.TorchTrainer(whole_group_loop, **common)
    else:
        extra = {"recovery": ray_goodput.Recovery(max_failures_per_node=len(fail_at) + 3)}  # one node
        if system == "rg_replicas":
            extra["fault_tolerance"] = ray_goodput.ReplicaGroups()
        loop = loop or (replica_loop if system == "rg_replicas" else whole_group_loop)
        trainer = ray_goodput.TorchTrainer(loop, **common, **extra)
    start = time.time()
    trainer.fit()
    end = time.time()
    wall = end - start
    where = f"{bucket}/runs/{system}"
    events = list(read_events(StorageLocation(uri=f"s3://{where}", fs=fs, root=where)).values())
    ledger = summary(compute(events, job_start=start, job_end=end))  # fit()'s whole wall time counts
    return {
        "system": system,
        "seed": seed,
        "fail_at": fail_at,
        "failures_met": failures_met(markers),
        "wall_s": wall,
        "ledger": ledger,
        **_survivor_gap(markers),
    }


def _survivor_gap(markers: Path) -> dict:
    """Rank 0's largest wait between two recorded steps (None: it restarted), and where it
    was: the step it followed and the replicas in the steps either side."""
    logs = list(markers.glob("steps-0-*.jsonl"))
    recs = [json.loads(line) for line in logs[0].read_text().splitlines()] if len(logs) == 1 else []
    if len(recs) < 2:
        return {"survivor_max_gap_s": None, "survivor_max_gap_at": None}
    a, b = max(zip(recs, recs[1:]), key=lambda ab: ab[1]["t"] - ab[0]["t"])
    return {
        "survivor_max_gap_s": round(b["t"] - a["t"], 3),
        "survivor_max_gap_at": {"after_step": a["step"], "replicas_before": a.get("n"), "replicas_after": b.get("n")},
    }


def table(results: list[dict], args) -> str:
    out = [
        f"{args.steps} steps, {args.workers} workers, DDP with {args.mb_per_rank} MiB of state per rank, "
        f"checkpoints every {args.every} steps on moto S3 (the server at niceness "
        f"{getattr(args, 'storage_server_nice', 0)}; Ray workers: 15); rank 1 SIGKILLed during the steps of "
        "`fail at`, seeded per seed\n",
        "| seed | system | fail at | failures met | wall s | goodput | productive s | degraded s | lost s "
        "| checkpoint stall s | restore s | restart downtime s | startup s | other s | cost per failure s "
        "| survivor max gap s | work steps / s |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        g, sec = r["ledger"], r["ledger"]["seconds"]
        met = r["failures_met"]
        cost = sec["lost"] + sec["restart_downtime"] + sec["restore"] + sec.get("degraded", 0.0)
        per = f"{cost / met:.1f}" if met else "-"
        gap = "-" if r["survivor_max_gap_s"] is None else f"{r['survivor_max_gap_s']:.2f}"
        rate = "-" if (work_rate := _work_rate(r)) is None else f"{work_rate:.2f}"
        at = r.get("survivor_max_gap_at")
        if at:  # after which step, and the replicas stepping before and after it
            gap += f" (after step {at['after_step']}, {at['replicas_before']}→{at['replicas_after']} replicas)"
        out.append(
            f"| {r['seed']} | {SYSTEMS[r['system']]} | {r['fail_at']} | {met} | {r['wall_s']:.1f} | "
            f"{g['goodput']:.1%} | "
            f"{sec['productive']:.1f} | {sec.get('degraded', 0.0):.1f} | {sec['lost']:.1f} | "
            f"{sec['checkpoint_stall']:.1f} | {sec['restore']:.1f} | {sec['restart_downtime']:.1f} | "
            f"{sec['startup']:.1f} | {sec.get('other', 0.0):.1f} | {per} | {gap} | {rate} |"
        )
    return "\n".join(out) + "\n\n" + verdicts(results) + "\n"


def _work_rate(result: dict | None) -> float | None:
    """Work steps per wall second (None: no run, or a results file from before the ledger
    counted work steps)."""
    if result is None or result["ledger"].get("work_steps") is None:
        return None
    return result["ledger"]["work_steps"] / result["wall_s"]


def verdicts(results: list[dict]) -> str:
    targets = _targets.load("goodput_under_failures")
    by = {(r["seed"], r["system"]): r for r in results}
    seeds = sorted({r["seed"] for r in results})
    # Goodput counts a step's time as productive however long it took, so a system whose
    # steps are slower (replica mode's all-reduce after the backward pass, background saves)
    # gains goodput by it. The work rate does not: the ledger's work steps (kept steps, each
    # weighted by the share of replicas that computed it) per wall second, against Ray's;
    # shown beside goodput, for information (the targets are on goodput).
    # A run that met fewer failures than scheduled (the job ended while a replacement that
    # would have met the next one was starting) did less failing than the others: its
    # seed's comparisons with it are void, and a target on them is not met while one is.
    short = {(r["seed"], r["system"]): r for r in results if r["failures_met"] < len(r["fail_at"])}
    void = {
        s: [
            f"{SYSTEMS[sys_]} met {r['failures_met']} of {len(r['fail_at'])} failures"
            for (s2, sys_), r in short.items()
            if s2 == s
        ]
        for s in {seed for seed, _ in short}
    }
    compares = {  # the systems each target's ratio or gap comes from
        "replica_goodput": {"rt_async_dcp", "rg_replicas"},
        "survivor_step_gap_s": {"rt_async_dcp", "rg_replicas"},
        "whole_group_goodput": {"rt_async_dcp", "rg_whole"},
    }
    lines = [
        "| seed | replica / Ray goodput | rg whole-group / Ray goodput | survivor max gap s "
        "| replica / Ray work rate | rg whole-group / Ray work rate | every failure met |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    rep, whole, gaps = [], [], []
    for s in seeds:
        ray_g = by[(s, "rt_async_dcp")]["ledger"]["goodput"] if (s, "rt_async_dcp") in by else None
        row = [str(s)]
        for system, acc in (("rg_replicas", rep), ("rg_whole", whole)):
            if ray_g and (s, system) in by:
                acc.append(by[(s, system)]["ledger"]["goodput"] / ray_g)
                row.append(f"{acc[-1]:.2f}×")
            else:
                row.append("-")
        gap = by.get((s, "rg_replicas"), {}).get("survivor_max_gap_s")
        if gap is not None:
            gaps.append(gap)
        row.append("-" if gap is None else f"{gap:.2f}")
        for system in ("rg_replicas", "rg_whole"):
            rates = [_work_rate(by.get((s, name))) for name in (system, "rt_async_dcp")]
            row.append(f"{rates[0] / rates[1]:.2f}×" if None not in rates and rates[1] > 0 else "-")
        row.append(f"no: {'; '.join(void[s])}" if s in void else "yes")
        lines.append("| " + " | ".join(row) + " |")

    def verdict(name: str, value: float) -> str:
        seeds_void = sorted({seed for seed, system in short if system in compares[name]})
        if not seeds_void:
            return targets[name].verdict(value)
        return (
            f"target {targets[name].bound}: MISSED (not measured: on seed {', '.join(map(str, seeds_void))} "
            "a run met fewer failures than scheduled; space them further apart than a replacement takes, "
            "--min-gap)"
        )

    if rep:
        lines.append(
            f"\nreplica mode / Ray whole-group goodput, worst seed {min(rep):.2f}× (mean "
            f"{statistics.mean(rep):.2f}×) → {verdict('replica_goodput', min(rep))}"
        )
    if gaps:
        lines.append(f"survivors' largest step gap {max(gaps):.2f} s → {verdict('survivor_step_gap_s', max(gaps))}")
    if whole:
        lines.append(
            f"ray_goodput whole-group / Ray whole-group goodput, worst seed {min(whole):.2f}× → "
            f"{verdict('whole_group_goodput', min(whole))}"
        )
    return "\n".join(lines)


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@contextlib.contextmanager
def local_s3_and_ray(num_cpus: int, storage_server_nice: int, prefix: str) -> Iterator[tuple[str, Path]]:
    """A moto S3 server (at ``storage_server_nice``) and a local Ray of ``num_cpus`` CPUs
    whose workers get its credentials; yields ``(endpoint, scratch dir)``, all torn down at
    the end."""
    import ray

    from ray_goodput.testing._s3 import start_moto_server

    for k, v in S3_ENV.items():
        os.environ.setdefault(k, v)
    moto, endpoint = start_moto_server()
    psutil.Process(moto.pid).nice(storage_server_nice)
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            log_to_driver=False,
            include_dashboard=False,
            runtime_env={"env_vars": {**S3_ENV, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1"}},
        )
        yield endpoint, root
    finally:
        ray.shutdown()
        moto.terminate()
        moto.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)


def main(args, meta: dict) -> int:
    out = args.out
    results = []
    # A CPU per worker, the rest for the node's uploader and Ray.
    with local_s3_and_ray(2 * args.workers, args.storage_server_nice, "goodput-steps-") as (endpoint, root):
        for seed in args.seeds:
            fail_at = failure_steps(seed, args.steps, args.failures, args.min_gap)
            order = list(args.systems) if seed % 2 == 0 else list(reversed(args.systems))  # interleaved
            for system in order:
                results.append(run_one(system, seed, fail_at, root, endpoint, args))
                sys.stdout.write(
                    f"[seed {seed} {system}] {results[-1]['wall_s']:.0f} s, goodput "
                    f"{results[-1]['ledger']['goodput']:.1%}\n"
                )
                sys.stdout.flush()
                _results.write(
                    out,
                    meta,
                    {
                        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                        "load_avg": os.getloadavg(),
                        "runs": results,
                    },
                )
    sys.stdout.write("\n" + table(results, args))
    sys.stdout.write(f"\nresults written to {out}\n")
    return 0
