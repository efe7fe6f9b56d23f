"""Replica mode on CPU: 2 replica groups train a small MLP; one is SIGKILLed mid-run.

Ray replaces only the killed replica; the survivor keeps stepping alone (its process is
never restarted) and the replacement heals from it over gloo (model, optimizer, data
position, step). Replica 0 saves a durable checkpoint every ``--save-every`` steps, into
the Ray Train run directory, where the driver's ``Recovery`` picks the step a restart
resumes from.

    python examples/train_ddp_replicas.py --smoke                             # kill replica 1
    python examples/train_ddp_replicas.py --smoke --kill-at 0 --kill-all-at 20  # kill both

The last line printed is one JSON object: ``survivor_max_gap_s`` (the survivor's longest
wait between two committed steps), ``survivor_pid_unchanged``, ``healed_at_step`` (the step
the replacement joined at), ``weights_equal`` (every replica ends with the same weights),
``goodput`` (steps' time over wall time, from the goodput ledger), ``resume_steps`` (the
step the driver chose for each restart) and more.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

import ray_goodput
from ray_goodput.replica import Replica, ReplicaGroups
from ray_goodput.testing import FailAt


class Squares(torch.utils.data.Dataset):
    """y = sum(x^2) over seeded random x: a dataset that needs no files."""

    def __init__(self, n: int, dim: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = (self.x**2).sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train_loop(config: dict) -> None:
    import ray.train

    torch.manual_seed(0)
    torch.set_num_threads(1)
    slot = ray.train.get_context().get_world_rank()
    out = Path(config["out"])
    faults = [FailAt(step=s, rank=r, marker_dir=str(out / "faults")) for s, r in config["kills"]]
    (out / f"pid-{slot}").write_text(str(os.getpid()))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    log = out / f"steps-{slot}-{os.getpid()}.jsonl"
    with Replica(
        model, optim, Squares(4096, 16), batch_size=32, save_every=config["save_every"]
    ) as rep:  # checkpoints go to the Ray Train run directory
        with log.open("a") as f:
            for x, y in rep.batches(total_steps=config["steps"]):
                if config["kill_all_at"] and slot == 0 and rep.current_step + 1 == config["kill_all_at"]:
                    kill_every_replica(out)
                for fault in faults:
                    fault.maybe_fail(rep.current_step + 1, slot)
                torch.nn.functional.mse_loss(rep.model(x), y).backward()
                time.sleep(config["step_sleep_s"])  # stands for a bigger model's step
                if rep.step():
                    f.write(
                        json.dumps(
                            {
                                "step": rep.current_step,
                                "t": time.time(),
                                "n": rep.participants,
                                "replacement": rep.replacement,
                            }
                        )
                        + "\n"
                    )
                    f.flush()
        if rep.peers_finished:
            return  # replaced after the others finished: nothing was trained here
        (out / f"final-{slot}-{os.getpid()}.json").write_text(
            json.dumps({"digest": digest(model), "position": rep.position.to_dict(), "step": rep.current_step})
        )


def kill_every_replica(out: Path) -> None:
    """Replica 0 SIGKILLs the other replicas' processes and then itself, once per run: every
    replica dies in the same instant, so Ray usually sees one failure of the whole group and
    restarts it. (When a poll lands between two deaths, Ray 2.60 replaces the first while the
    second dies, its controller ends, and ``fit`` runs again: docs/guide/replicas.md, limits.)"""
    marker = out / "faults" / "kill-all.fired"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(time.time()))
    # Every pid is read before the first signal, so the kills follow each other with no
    # file access between them: a health check that finds one replica dead and another
    # alive makes Ray replace one replica while the other dies (see above).
    peers = [int(p.read_text()) for p in out.glob("pid-*") if p.name != "pid-0"]
    for pid in peers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def run(
    *, steps: int, kills: list[tuple[int, int]], save_every: int, root: Path, step_sleep_s: float, kill_all_at: int = 0
) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    out = root / "out"
    out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    trainer = ray_goodput.TorchTrainer(
        train_loop,
        train_loop_config={
            "out": str(out),
            "kills": kills,
            "kill_all_at": kill_all_at,
            "steps": steps,
            "save_every": save_every,
            "step_sleep_s": step_sleep_s,
        },
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            storage_path=str(root / "runs"), name="replicas", failure_config=FailureConfig(max_failures=4)
        ),
        fault_tolerance=ReplicaGroups(min_replicas=1),
        # One node takes every kill here, none of them its fault: not isolated for them.
        recovery=ray_goodput.Recovery(max_failures_per_node=len(kills) + 3),
        callbacks=[ray_goodput.GoodputCallback(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")],
    )
    result = trainer.fit()
    return {
        **summarize(out, root, time.time() - began, kills, every_replica_killed=kill_all_at > 0),
        "ray_train_checkpoint": result.checkpoint is not None,
        "fit_reruns": trainer.fit_reruns,  # runs Ray's controller ended on a replacement (resumed)
        "resume_steps": [a["resume_step"] for a in trainer.recovery.attempts[1:]],  # the driver's choices
    }


def summarize(out: Path, root: Path, wall_s: float, kills: list[tuple[int, int]], every_replica_killed: bool) -> dict:
    """The result line; the survivor's fields are None when every replica was killed."""
    runs: dict[tuple[int, int], list[dict]] = {}
    for p in out.glob("steps-*.jsonl"):
        _, slot, pid = p.stem.split("-")
        runs[(int(slot), int(pid))] = [json.loads(line) for line in p.read_text().splitlines()]
    killed = {r for _, r in kills}
    survivors = [] if every_replica_killed else [k for k in runs if k[0] not in killed]
    gaps = [b["t"] - a["t"] for k in survivors for a, b in zip(runs[k], runs[k][1:])]
    survivor_pids = {k[1] for k in survivors}
    replacements = [recs for k, recs in runs.items() if recs and recs[0]["replacement"]]
    finals = [json.loads(p.read_text()) for p in out.glob("final-*.json")]
    run_dir = root / "runs" / "replicas"
    summary_file = run_dir / "goodput" / "summary.json"
    goodput = json.loads(summary_file.read_text()) if summary_file.exists() else None
    return {
        "survivor_max_gap_s": round(max(gaps), 3) if gaps else None,
        "survivor_pid_unchanged": len(survivor_pids) == len({k[0] for k in survivors}) if survivors else None,
        "healed_at_step": replacements[0][0]["step"] - 1 if replacements else None,  # its first step's start
        "weights_equal": len({f["digest"] for f in finals}) == 1 and len(finals) >= 2,
        "final_steps": sorted(f["step"] for f in finals),
        "positions_equal": len({json.dumps(f["position"]) for f in finals}) == 1,
        "checkpoints": sorted(i.step for i in ray_goodput.list_checkpoints(str(run_dir)) if i.committed),
        "goodput": round(goodput["goodput"], 4) if goodput else None,
        "wall_s": round(wall_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, 2 replicas, a short run")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kill-at", type=int, default=20, help="step during which replica 1 is killed (0: never)")
    parser.add_argument(
        "--kill-all-at", type=int, default=0, help="step during which both replicas are killed at once (0: never)"
    )
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--step-sleep-s", type=float, default=0.1, help="stands for a bigger model's compute")
    parser.add_argument("--root", default=None, help="where runs and checkpoints go (default: a temp dir)")
    args = parser.parse_args()
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    root = Path(args.root or tempfile.mkdtemp(prefix="rg-replicas-"))
    kills = [(args.kill_at, 1)] if args.kill_at else []
    steps = min(args.steps, 150) if args.smoke else args.steps
    try:
        result = run(
            steps=steps,
            kills=kills,
            save_every=args.save_every,
            root=root,
            step_sleep_s=args.step_sleep_s,
            kill_all_at=args.kill_all_at,
        )
    finally:
        ray.shutdown()  # before the result line: Ray's own messages go to stdout too
    sys.stdout.flush()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
