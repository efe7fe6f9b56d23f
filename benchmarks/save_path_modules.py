"""How a save reads: the modules one steady-state save passes through, and how often it
comes back to a module it had already left (issue 30's "returns to a module it left").

One process, the thread uploader (the node uploader's jobs, run in a thread of this
process, so the path from ``Checkpointer.save`` to ``COMMITTED`` is traced in one place),
local storage in a temporary directory, a small model with AdamW. Two saves settle the
arenas; the third is traced with ``sys.setprofile`` / ``threading.setprofile`` on every
thread. For each thread that ran library code: the library functions in the order of their
first call, the sequence of modules they belong to (consecutive calls in one module
merged), and the re-entries: entries into a module the sequence had already left. Prints
a table and the verdicts on ``benchmarks/targets.toml``'s ``save_path_modules`` targets
(``save()``, and the rank's lane thread, where the job is written, uploaded and committed);
writes ``benchmarks/results/save_path_modules_cpu.json`` (``--out``).

    python benchmarks/save_path_modules.py
    python benchmarks/save_path_modules.py --out /tmp/save_path_modules.json --show-calls
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from collections import defaultdict
from typing import Any

import _results
import _targets
import torch

PACKAGE = "ray_goodput"


def trace_one_save() -> dict[str, list[tuple[str, str]]]:
    """``{part: [(module, function), ...]}``: the library calls of the traced save, from
    ``save()`` to the end of ``wait()`` (its commit). Parts: ``save()`` and ``wait()`` on the
    training thread, then every other thread by name (the uploader's, the commit's)."""
    from ray_goodput import Checkpointer

    calls: dict[str, list[tuple[str, str]]] = defaultdict(list)
    lock = threading.Lock()
    phase: list[str | None] = [None]  # None: not tracing yet
    training = threading.get_ident()

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event != "call" or phase[0] is None:
            return
        module = frame.f_globals.get("__name__", "")
        if module == PACKAGE or module.startswith(PACKAGE + "."):
            part = phase[0] if threading.get_ident() == training else _thread(threading.current_thread().name)
            with lock:
                calls[part].append((module, frame.f_code.co_name))

    root = tempfile.mkdtemp(prefix="save-path-")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optim.step()
    state = {"model": model, "optim": optim}
    # Threads started from here on carry the profile (the uploader's lanes start with the
    # first save); it records only while phase is set.
    threading.setprofile(profile)
    try:
        with Checkpointer(
            os.path.join(root, "ckpt"), staging_dir=os.path.join(root, "staging"), uploader="thread"
        ) as ckpt:
            ckpt.restore(state)
            for step in (1, 2):
                ckpt.save(step, state)
                ckpt.wait()
            sys.setprofile(profile)
            phase[0] = "save()"
            ckpt.save(3, state)
            phase[0] = "wait()"
            ckpt.wait()
            phase[0] = None
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    if ckpt.stats.committed[-1] != 3:
        raise RuntimeError(f"the traced save did not commit: {ckpt.stats}")
    return dict(calls)


def _thread(name: str) -> str:
    """A thread's name without what differs between runs (a dropped copy's pid and step)."""
    return name.split("-.dropped-")[0]


def reading_order(calls: list[tuple[str, str]]) -> dict[str, Any]:
    """First calls in time order, the module sequence and its re-entries."""
    seen: set[tuple[str, str]] = set()
    firsts = [c for c in calls if not (c in seen or seen.add(c))]
    sequence: list[str] = []
    for module, _ in firsts:
        if not sequence or sequence[-1] != module:
            sequence.append(module)
    left: set[str] = set()
    reentries = []
    for i, module in enumerate(sequence):
        if module in left:
            reentries.append(module)
        if i:
            left.add(sequence[i - 1])
    return {
        "functions": [f"{m}.{f}" for m, f in firsts],
        "sequence": sequence,
        "modules": len(set(sequence)),
        "reentries": len(reentries),
        "reentered": sorted(set(reentries)),
    }


def _short(module: str) -> str:
    return module.removeprefix(PACKAGE + ".")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(_results.default_path("save_path_modules")), help="where the results go")
    p.add_argument("--show-calls", action="store_true", help="also print each thread's functions in order")
    args = p.parse_args(argv)
    meta = _results.start_run("save_path_modules", argv)
    targets = _targets.load("save_path_modules")
    traced = trace_one_save()
    order = ["save()", "wait()"] + sorted(k for k in traced if k not in ("save()", "wait()"))
    threads = {name: reading_order(traced[name]) for name in order if name in traced}
    lines = [
        "| part (training thread's calls, then other threads) | library functions | modules | re-entries "
        "| modules re-entered |",
        "|---|---:|---:|---:|---|",
    ]
    for name, r in threads.items():
        lines.append(
            f"| {name} | {len(r['functions'])} | {r['modules']} | {r['reentries']} | "
            f"{', '.join(_short(m) for m in r['reentered'])} |"
        )
    save = threads["save()"]["reentries"]
    lines += ["", f"- save() on the training thread: {save} re-entries → {targets['reentries_count'].verdict(save)}"]
    lane = next((r["reentries"] for name, r in threads.items() if name.startswith("rg-lane")), None)
    if lane is not None:
        lines.append(f"- the rank's lane: {lane} re-entries → {targets['lane_reentries_count'].verdict(lane)}")
    for name, r in threads.items():
        lines.append(f"\n{name}: " + " > ".join(_short(m) for m in r["sequence"]))
        if args.show_calls:
            lines += [f"    {_short(f)}" for f in r["functions"]]
    table = "\n".join(lines)
    print(table)
    _results.write(args.out, meta, {"args": vars(args), "threads": threads, "markdown": table})
    print(f"\nresults written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
