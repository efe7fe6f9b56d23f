"""First save of a run: how long ``save()`` blocks the first time, against later saves.

The first save into a fresh shared-memory snapshot arena faults in every page of it.
``restore()`` sizes the arena and touches its pages in the background when the
optimizers have state (a resumed attempt); a fresh start's optimizers get theirs at their
first step, when a one-shot post-step hook does the same. Side by side, one process per
trial (the first save is once per process), in one run:

  * ``fresh start``: unstepped AdamW at ``restore()``, sized after its first step (default)
  * ``fresh start, not prepared``: the same with the hook removed (as before it existed)
  * ``resumed``: AdamW stepped before ``restore()`` (sized in ``restore()``)

and the copy floor of the same bytes: a fresh ``torch.empty_like(t).copy_(t)``. Each
trial makes ``--saves`` saves, ``--gap-s`` seconds of idle "steps" before each; the
thread uploader (no Ray), local storage in a temporary directory. Prints a markdown table
and the verdict on ``benchmarks/targets.toml``'s ``first_save`` target; writes the results to
``benchmarks/results/first_save_cpu.json`` (``--out``).

    python benchmarks/first_save.py                  # 81 MiB snapshot, 5 trials
    python benchmarks/first_save.py --width 3072 --trials 3
    python benchmarks/first_save.py --width 256 --trials 1 --saves 2 --out /tmp/first_save.json   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import _results
import _targets

MODES = ("fresh start", "fresh start, not prepared", "resumed")

_TRIAL = r"""
import json, sys, tempfile, time
import torch
from ray_goodput import Checkpointer

mode, width, saves, gap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(3)])
optim = torch.optim.AdamW(model.parameters(), foreach=False)
state = {"model": model, "optim": optim}


def step():
    model(torch.randn(8, width)).sum().backward()
    optim.step()
    optim.zero_grad()


if mode == "resumed":
    step()
tensors = list(model.state_dict().values())
work = tempfile.mkdtemp(prefix="rg-first-save-")
with Checkpointer(work + "/run", staging_dir=work + "/staging", uploader="thread") as ckpt:
    ckpt.restore(state)
    if mode == "fresh start, not prepared":
        ckpt._arenas.stop_watching_steps()  # noqa: SLF001 - as before the hook existed
    blocked = []
    for i in range(1, saves + 1):
        step()
        time.sleep(gap)
        t0 = time.perf_counter()
        ckpt.save(i, state)
        blocked.append(time.perf_counter() - t0)
        ckpt.wait()
    snapshot = ckpt._arenas.arenas[0].size  # noqa: SLF001 - the arena the saves used
# The floor: a fresh copy of the same bytes (model + AdamW state), faulting its pages in.
flat = tensors + [v for s in optim.state.values() for v in s.values() if torch.is_tensor(v)]
t0 = time.perf_counter()
copies = [torch.empty_like(t).copy_(t) for t in flat]
floor = time.perf_counter() - t0
print(json.dumps({"blocked": blocked, "floor": floor, "bytes": snapshot}))
"""


def _report(runs: dict[str, list[dict]], args: argparse.Namespace) -> str:
    """The table, and the target's verdict for the starts the library has now."""
    target = _targets.load("first_save")["first_save_blocked"]
    mib = runs[MODES[0]][0]["bytes"] / 2**20
    lines = [
        f"First save, {mib:.0f} MiB snapshot, {args.trials} trials (median; min-max), "
        f"{args.saves} saves each, {args.gap_s:g} s before each save",
        "",
        "| start | first save (s) | later saves (s) | first / later | first / copy floor |",
        "|---|---|---|---|---|",
    ]
    verdicts = []
    for mode in MODES:
        first = [r["blocked"][0] for r in runs[mode]]
        later = [b for r in runs[mode] for b in r["blocked"][1:]]
        floor = statistics.median(r["floor"] for r in runs[mode])
        f, lt = statistics.median(first), statistics.median(later) if later else float("nan")
        lines.append(
            f"| {mode} | {f:.4f} ({min(first):.4f}-{max(first):.4f}) | {lt:.4f} | {f / lt:.2f}x | "
            f"{f / floor:.2f}x (floor {floor:.4f}) |"
        )
        if mode != "fresh start, not prepared":  # (the code before the hook: a reference, not a target)
            verdicts.append(
                f"- {mode}: first save {f:.4f} s = {f / floor:.2f}× a fresh copy ({floor:.4f} s) "
                f"→ {target.verdict(f / floor)}"
            )
    return "\n".join(lines + [""] + verdicts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=1536, help="3 Linear(width, width): 1536 -> 81 MiB with AdamW")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--gap-s", type=float, default=0.3, help="idle seconds between a step and its save")
    p.add_argument("--out", default=str(_results.default_path("first_save")), help="where the results go")
    args = p.parse_args(argv)
    meta = _results.start_run("first_save", argv)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.trials):
        for mode in MODES:  # interleaved: the machine's drift hits every mode alike
            done = subprocess.run(
                [sys.executable, "-c", _TRIAL, mode, str(args.width), str(args.saves), str(args.gap_s)],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if done.returncode != 0:
                raise RuntimeError(f"trial {mode!r} failed:\n{done.stderr[-3000:]}")
            runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    table = _report(runs, args)
    print("\n" + table)
    _results.write(args.out, meta, {"args": vars(args), "trials": runs, "markdown": table})
    print(f"\nresults written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
