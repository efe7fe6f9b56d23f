"""The ``ray-goodput`` command: inspect checkpoints and node services, run the demo."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

from ray_goodput.checkpoint import _catalog
from ray_goodput.checkpoint._manifest import read_manifest
from ray_goodput.errors import GoodputError
from ray_goodput.storage import resolve


def _out(line: str = "") -> None:
    sys.stdout.write(line + "\n")


def _human(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return str(num)


def _age(created: float | None) -> str:
    if created is None:
        return "-"
    seconds = max(0.0, time.time() - created)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def cmd_ls(args: argparse.Namespace) -> int:
    infos = _catalog.list_checkpoints(args.uri)
    if not infos:
        _out(f"no checkpoints under {args.uri}")
        return 0
    _out(f"{'STEP':>10}  {'STATE':<11}  {'WORLD':>5}  {'SIZE':>10}  {'AGE':>6}")
    for info in infos:
        state = "committed" if info.committed else "uncommitted"
        world = str(info.world_size) if info.world_size else "-"
        _out(f"{info.step:>10}  {state:<11}  {world:>5}  {_human(info.num_bytes):>10}  {_age(info.created):>6}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    infos = [i for i in _catalog.list_checkpoints(args.uri) if i.committed]
    if args.step is not None:
        infos = [i for i in infos if i.step == args.step]
        if not infos:
            _out(f"no committed checkpoint at step {args.step} under {args.uri}")
            return 2
    damaged = 0
    for info in infos:
        loc = _catalog.step_location(resolve(args.uri), info.step)
        manifest = read_manifest(loc)
        problems = _catalog.verify(loc, manifest, checksums=True) if manifest else ["COMMITTED vanished"]
        status = "ok" if not problems else "DAMAGED"
        _out(f"step {info.step}: {status} ({len(manifest.files) if manifest else 0} files, {_human(info.num_bytes)})")
        for problem in problems:
            _out(f"  {problem}")
        damaged += bool(problems)
    if not infos:
        _out(f"no committed checkpoints under {args.uri}")
    return 1 if damaged else 0


def cmd_status(args: argparse.Namespace) -> int:
    from ray_goodput.node._status import status_lines  # noqa: PLC0415 - needs Ray

    for line in status_lines(args.address):
        _out(line)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    import mlflow  # noqa: PLC0415

    from ray_goodput.goodput._ledger import BUCKETS  # noqa: PLC0415

    client = mlflow.MlflowClient(tracking_uri=args.tracking_uri)
    exp = client.get_experiment_by_name(args.experiment)
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.runName = '{args.run}'",
                              order_by=["attributes.start_time DESC"]) if exp else []
    if not runs:
        _out(f"no MLflow run named {args.run!r} in experiment {args.experiment!r} at {args.tracking_uri}")
        return 2
    m = runs[0].data.metrics
    total = m.get("goodput/total_s", 0.0) or 1.0
    _out(f"run {args.run} ({runs[0].info.status}): goodput {m.get('goodput/goodput', 0):.1%} "
         f"of {m.get('goodput/total_s', 0):.1f}s, {m.get('goodput/failures', 0):.0f} failure(s), "
         f"{m.get('goodput/steps_lost', 0):.0f} steps lost")
    _out(f"{'BUCKET':<18}{'SECONDS':>10}{'SHARE':>9}")
    for bucket in BUCKETS:
        value = m.get(f"goodput/{bucket}_s", 0.0)
        _out(f"{bucket:<18}{value:>10.1f}{value / total:>9.1%}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ray_goodput.demo import main as demo_main  # noqa: PLC0415

    return demo_main(args.extra)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ray-goodput", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list checkpoints (committed or not) with sizes and ages")
    p.add_argument("uri", help="run storage root (the Checkpointer's storage_path)")
    p.set_defaults(fn=cmd_ls)
    p = sub.add_parser("verify", help="check every file of committed checkpoints against the manifest")
    p.add_argument("uri")
    p.add_argument("--step", type=int, default=None, help="only this step")
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("status", help="per-node uploader and cache actors of a running cluster")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    p.set_defaults(fn=cmd_status)
    p = sub.add_parser("report", help="goodput breakdown of a run, from MLflow")
    p.add_argument("run", help="the Ray Train run name (RunConfig.name)")
    p.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    p.add_argument("--experiment", default="ray_goodput")
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser("demo", help="run the quickstart: train, inject a failure, resume")
    p.add_argument("extra", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except GoodputError as exc:
        sys.stderr.write(f"ray-goodput: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
