"""Where a replica-mode replacement's seconds go, from the SIGKILL to the replacement
stepping with the survivor.

The step-failures job (``_step_failures.py``: 2 replicas of one worker, DDP state of
``--mb-per-rank`` MiB, checkpoints on moto S3) with rank 1 SIGKILLed at each ``--fail-at``
step. The replacement's training function logs its own clocks; each phase is measured from
the kill (the fault marker's write, just before the SIGKILL):

    train fn        Ray noticed the death, started the new worker process (imports of ray,
                    Ray Train's worker module, torch) and called the training function
    imports         the training function's imports done (``ray_goodput.replica``) and
                    its Ray Train context read
    model           the model built (the benchmark's, as the step-failures job builds it)
    optimizer       its AdamW built (a process's first optimizer imports torch._dynamo)
    replica         ``Replica.__enter__`` returned (torchft's manager, the quorum's client)
    both stepping   the survivor's first committed step with both replicas again (the
                    replacement joined the quorum and healed from the survivor)

The survivor steps alone from the kill to "both stepping": with R replicas a replacement
costs 1/R of that time in capacity (the ledger's ``degraded``). Printed: each replacement's
phases, their median, and each phase's share of the total.

    python benchmarks/replacement_anatomy.py --steps 160 --fail-at 30 90
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import _results
import _step_failures

PHASES = ("train_fn", "imports", "model", "optimizer", "replica", "both_stepping")
RESULTS = _results.default_path("replacement_anatomy")


def clocked_replica_loop(cfg: dict) -> None:
    """The step-failures replica loop, its set-up clocks logged (``clocks-<slot>-<pid>.json``)."""
    _step_failures.replica_loop(cfg, clocks={})


def replacements(markers: Path) -> list[dict]:
    """Each kill and its replacement's phases, seconds after the kill (None: not reached
    before the run ended)."""
    kills = sorted((p.stat().st_mtime, p.name) for p in markers.glob("fault-step*-rank1.fired"))
    # Rank 1's processes (the first one and its replacements), by start.
    starts = sorted((json.loads(p.read_text()) for p in markers.glob("clocks-1-*.json")), key=lambda c: c["train_fn"])
    survivor = [json.loads(line) for p in markers.glob("steps-0-*.jsonl") for line in p.read_text().splitlines()]
    out = []
    for kill, name in kills:
        new = next((c for c in starts if c["train_fn"] > kill), None)
        both = next((s["t"] for s in survivor if s["t"] > kill and s.get("n", 1) > 1), None)
        row = {"kill": name, **{k: (None if new is None else round(new[k] - kill, 3)) for k in PHASES[:-1]}}
        row["both_stepping"] = None if both is None else round(both - kill, 3)
        out.append(row)
    return out


def table(rows: list[dict]) -> str:
    done = [r for r in rows if all(r[k] is not None for k in PHASES)]
    lines = [
        "| replacement | train fn s | imports s | model s | optimizer s | replica s | both stepping s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = ["-" if r[k] is None else f"{r[k]:.2f}" for k in PHASES]
        lines.append(f"| {r['kill']} | " + " | ".join(cells) + " |")
    if not done:
        return "\n".join(lines) + "\n\nno replacement reached both stepping before the run ended\n"
    med = {k: statistics.median(r[k] for r in done) for k in PHASES}
    lines.append("| **median** | " + " | ".join(f"**{med[k]:.2f}**" for k in PHASES) + " |")
    total, prev, shares = med["both_stepping"], 0.0, []
    for k in PHASES:  # each phase's own length (from the previous one), as a share of the whole
        shares.append(f"{k} {max(0.0, med[k] - prev):.2f} s ({max(0.0, med[k] - prev) / total:.0%})")
        prev = med[k]
    return "\n".join(lines) + "\n\nmedian phase lengths, share of kill → both stepping: " + ", ".join(shares) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--fail-at", type=int, nargs="+", default=[30, 90], help="steps at which rank 1 dies")
    parser.add_argument("--every", type=int, default=10, help="checkpoint interval, steps")
    parser.add_argument("--compute-s", type=float, default=0.1)
    parser.add_argument("--mb-per-rank", type=int, default=72)
    parser.add_argument("--storage-server-nice", type=int, default=15)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    meta = _results.start_run("replacement_anatomy")

    args.workers, args.systems = 2, ["rg_replicas"]
    with _step_failures.local_s3_and_ray(4, args.storage_server_nice, "replacement-anatomy-") as (endpoint, root):
        job = _step_failures.run_one(
            "rg_replicas", 0, sorted(args.fail_at), root, endpoint, args, loop=clocked_replica_loop
        )
        rows = replacements(root / "rg_replicas-0")
    _results.write(
        args.out,
        meta,
        {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "replacements": rows,
            "job": job,
        },
    )
    sys.stdout.write(table(rows) + f"\nresults written to {args.out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
