"""The ``ray-goodput plan`` and ``ray-goodput simulate`` subcommands.

``register(subparsers)`` adds both to the CLI's subparsers; each handler writes to stdout
and returns an exit code. Bad flags raise :class:`ConfigError` naming the flag.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ray_goodput.errors import ConfigError
from ray_goodput.plan import _formulas as f
from ray_goodput.plan import _simulate as sim


def _out(line: str = "") -> None:
    sys.stdout.write(line + "\n")


def _run_hours(args: argparse.Namespace) -> float:
    if args.hours is not None:
        return f.positive("--hours", args.hours)
    return f.positive("--days", args.days) * 24.0


def _plan_column(args: argparse.Namespace, save_s: float, durable_s: float | None, mtbf_s: float) -> dict[str, Any]:
    interval = f.optimal_interval_s(save_s, mtbf_s, args.restart_seconds, durable_s=durable_s)
    costs = (args.step_seconds, save_s, interval, mtbf_s, args.restart_seconds, args.restore_seconds)
    buckets = f.expected_buckets(*costs, durable_s=durable_s)
    return {
        "save_s": save_s,
        "durable_s": save_s if durable_s is None else durable_s,
        "optimal_interval_s": interval,
        "young_interval_s": f.young_interval_s(save_s, mtbf_s),
        "interval_steps": f.interval_steps(
            interval, args.step_seconds, at_least_s=0.0 if durable_s is None else durable_s - save_s
        ),
        "expected_lost_s": f.expected_lost_s(*costs[:4], durable_s=durable_s),
        "expected_goodput": buckets["productive"],
        "buckets": buckets,
    }


def _check_plan_flags(args: argparse.Namespace) -> None:
    if isinstance(args.gpus, bool) or not isinstance(args.gpus, int) or args.gpus < 1:
        raise ConfigError(f"--gpus must be an int >= 1, got {args.gpus!r}")
    f.positive("--save-seconds", args.save_seconds)
    f.positive("--restart-seconds", args.restart_seconds, zero_ok=True)
    f.positive("--restore-seconds", args.restore_seconds, zero_ok=True)
    f.positive("--step-seconds", args.step_seconds)
    for flag, save, durable in (
        ("--durable-seconds", args.save_seconds, args.durable_seconds),
        ("--compare-durable-seconds", args.compare_save_seconds, args.compare_durable_seconds),
    ):
        if durable is not None and (save is None or f.positive(flag, durable) < save):
            raise ConfigError(
                f"{flag} ({durable}) needs its save seconds and must be >= them: a save "
                "is durable after it stops blocking"
            )
    if args.compare_save_seconds is not None:
        f.positive("--compare-save-seconds", args.compare_save_seconds)


def plan_report(args: argparse.Namespace) -> dict[str, Any]:
    """The numbers ``plan`` prints, as one JSON-able dict."""
    _check_plan_flags(args)
    hours = _run_hours(args)
    if args.mtbf_hours is not None:
        afr = f.afr_from_mtbf(args.gpus, f.positive("--mtbf-hours", args.mtbf_hours))
    else:
        afr = f.positive("--afr", args.afr)
    mtbf_h = f.mtbf_hours(args.gpus, afr)
    report = {
        "gpus": args.gpus,
        "hours": hours,
        "afr": afr,
        "mtbf_hours": mtbf_h,
        "failure_probability": f.failure_probability(args.gpus, hours, afr),
        "expected_failures": hours / mtbf_h,
        **_plan_column(args, args.save_seconds, args.durable_seconds, mtbf_h * 3600.0),
        "compare": None,
    }
    if args.compare_save_seconds is not None:
        report["compare"] = _plan_column(args, args.compare_save_seconds, args.compare_durable_seconds, mtbf_h * 3600.0)
    return report


def _plan_text(r: dict[str, Any]) -> None:
    cols = [r] + ([r["compare"]] if r["compare"] else [])
    _out(f"{r['gpus']} GPUs for {r['hours']:g} h at an AFR of {r['afr']:.2%} per GPU-year")
    _out(
        f"{'failure probability over the run':<36}{r['failure_probability']:.1%} "
        f"({r['expected_failures']:.2f} failures expected)"
    )
    _out(f"{'job MTBF':<36}{r['mtbf_hours']:.2f} h")
    rows = [
        (
            "",
            lambda c: (
                f"save {c['save_s']:g} s" + (f", durable {c['durable_s']:g} s" if c["durable_s"] != c["save_s"] else "")
            ),
        ),
        ("optimal interval (Daly)", lambda c: f"{c['optimal_interval_s']:.0f} s"),
        ("  Young sqrt(2*save*MTBF)", lambda c: f"{c['young_interval_s']:.0f} s"),
        ("  in steps", lambda c: f"{c['interval_steps']}"),
        ("expected lost work per failure", lambda c: f"{c['expected_lost_s']:.0f} s"),
        ("checkpoint stall share", lambda c: f"{c['buckets']['checkpoint_stall']:.2%}"),
        ("expected goodput", lambda c: f"{c['expected_goodput']:.2%}"),
    ]
    for label, cell in rows:
        _out(f"{label:<36}" + "".join(f"{cell(c):<32}" for c in cols).rstrip())


def cmd_plan(args: argparse.Namespace) -> int:
    report = plan_report(args)
    if args.json:
        _out(json.dumps(report, sort_keys=True))
    else:
        _plan_text(report)
    return 0


def _gpu_list(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--gpus must be comma-separated ints such as 256,1024, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--gpus must be comma-separated ints >= 1, got {text!r}")
    return sizes


def _load_systems(path: str | None) -> tuple[list[sim.System], str]:
    if path is None:
        return list(sim.DEFAULT_SYSTEMS), sim.DEFAULT_SOURCE
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--costs {path}: cannot read a JSON document ({exc})") from None
    return sim.systems_from_json(doc), str(doc.get("source", path))


def simulate_rows(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    """One row per (size, system): mean bucket shares over the runs and the analytic goodput."""
    systems, source = _load_systems(args.costs)
    afr, days = f.positive("--afr", args.afr), f.positive("--days", args.days)
    rows = []
    for gpus in _gpu_list(args.gpus):
        mtbf_s = f.mtbf_hours(gpus, afr) * 3600.0
        results = sim.simulate(systems, gpus=gpus, days=days, afr=afr, seed=args.seed, runs=args.runs)
        for s in systems:
            outs = results[s.name]
            expected = f.expected_goodput(
                s.step_s, s.save_blocking_s, outs[0].interval_s, mtbf_s, s.restart_s, s.restore_s, durable_s=s.durable_s
            )
            rows.append(
                {
                    "gpus": gpus,
                    "system": s.name,
                    "mtbf_hours": mtbf_s / 3600.0,
                    "interval_s": outs[0].interval_s,
                    "expected_goodput": expected,
                    "failures_per_run": sum(o.failures for o in outs) / len(outs),
                    "superseded_per_run": sum(o.superseded for o in outs) / len(outs),
                    **sim.mean_buckets(outs),
                }
            )
    return rows, source


def _simulate_table(rows: list[dict[str, Any]], args: argparse.Namespace, source: str) -> None:
    _out(
        f"{args.days:g} days, AFR {args.afr:.2%} per GPU-year, seed {args.seed}, {args.runs} runs per "
        f"size (same failures for every system); costs: {source}"
    )
    _out()
    _out(
        "| GPUs | MTBF h | system | interval s | failures/run | superseded/run | goodput | expected | lost | "
        "checkpoint_stall | restore | restart_downtime |"
    )
    _out("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        _out(
            f"| {r['gpus']} | {r['mtbf_hours']:.1f} | {r['system']} | {r['interval_s']:.0f} | "
            f"{r['failures_per_run']:.1f} | {r['superseded_per_run']:.0f} | {r['goodput']:.2%} | "
            f"{r['expected_goodput']:.2%} | "
            f"{r['lost']:.2%} | {r['checkpoint_stall']:.2%} | {r['restore']:.2%} | "
            f"{r['restart_downtime']:.2%} |"
        )


def write_png(rows: list[dict[str, Any]], path: str) -> None:
    """Goodput vs GPUs, one line per system (matplotlib, Agg backend)."""
    try:
        import matplotlib  # noqa: PLC0415 - optional, only for --png

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 - after the backend is chosen
    except ImportError:
        raise ConfigError("--png needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == name]
        ax.plot([r["gpus"] for r in mine], [100 * r["goodput"] for r in mine], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("goodput %")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_simulate(args: argparse.Namespace) -> int:
    rows, source = simulate_rows(args)
    if args.png:
        write_png(rows, args.png)
    if args.json:
        _out(
            json.dumps(
                {
                    "source": source,
                    "days": args.days,
                    "afr": args.afr,
                    "seed": args.seed,
                    "runs": args.runs,
                    "rows": rows,
                },
                sort_keys=True,
            )
        )
    else:
        _simulate_table(rows, args, source)
        if args.png:
            _out(f"\nwrote {args.png}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``plan`` and ``simulate`` to the ``ray-goodput`` subparsers."""
    p = subparsers.add_parser("plan", help="failure odds, MTBF, optimal checkpoint interval, expected goodput")
    p.add_argument("--gpus", type=int, required=True)
    run = p.add_mutually_exclusive_group(required=True)
    run.add_argument("--days", type=float)
    run.add_argument("--hours", type=float)
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--afr", type=float, default=0.01, help="failures per GPU-year (default 0.01)")
    rate.add_argument("--mtbf-hours", type=float, help="measured job MTBF instead of --afr")
    p.add_argument("--save-seconds", type=float, required=True, help="how long a save blocks the loop")
    p.add_argument("--durable-seconds", type=float, help="save start to recovery point (default: = save)")
    p.add_argument("--restart-seconds", type=float, required=True)
    p.add_argument("--restore-seconds", type=float, default=0.0)
    p.add_argument("--step-seconds", type=float, default=1.0)
    p.add_argument("--compare-save-seconds", type=float, help="a second save cost, e.g. rank-0 torch.save")
    p.add_argument("--compare-durable-seconds", type=float)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_plan)
    p = subparsers.add_parser("simulate", help="seeded failure simulation: goodput per system and size")
    p.add_argument("--costs", help="costs JSON ({'systems': [...]}, e.g. benchmarks/results/*.json)")
    p.add_argument("--gpus", default="256,1024,4096,16384")
    p.add_argument("--days", type=float, default=30.0)
    p.add_argument("--afr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=20, help="runs per size (pooled)")
    p.add_argument("--png", help="write goodput vs GPUs here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_simulate)
