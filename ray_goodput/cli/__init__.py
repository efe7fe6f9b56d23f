"""The ``ray-goodput`` command: inspect checkpoints and node services, report goodput,
run the demo.

Subcommands import their module when they run, so ``ray-goodput ls`` does not pay for
Ray, torch and MLflow (start-up time, not an import cycle).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from ray_goodput.cli._plan import register as _register_plan
from ray_goodput.errors import GoodputError


def _lazy(module: str, function: str) -> Any:
    """A handler that imports ``ray_goodput.cli.<module>`` only when it runs."""

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(f"ray_goodput.{module}"), function)(args)

    return run


def _demo(args: argparse.Namespace) -> int:
    return importlib.import_module("ray_goodput.demo").main(args.extra)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ray-goodput", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list checkpoints (committed or not) with sizes and ages")
    p.add_argument("uri", help="run storage root (the Checkpointer's storage_path)")
    p.set_defaults(fn=_lazy("cli._checkpoints", "cmd_ls"))
    p = sub.add_parser("verify", help="check every file of committed checkpoints against the manifest")
    p.add_argument("uri")
    p.add_argument("--step", type=int, default=None, help="only this step")
    p.set_defaults(fn=_lazy("cli._checkpoints", "cmd_verify"))
    p = sub.add_parser("export", help="write a committed checkpoint as one torch.save file")
    p.add_argument("uri", help="run storage root (the Checkpointer's storage_path)")
    p.add_argument("out", help="output file, e.g. model.pt")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest committed)")
    p.add_argument("--optim", action="store_true", help="include the optimizer state")
    p.set_defaults(fn=_lazy("cli._export", "cmd_export"))
    p = sub.add_parser("status", help="per-node uploader and cache actors of a running cluster")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    p.add_argument(
        "--run",
        default=None,
        help="run directory URI: also its Recovery's decisions and its recovery point",
    )
    p.set_defaults(fn=_lazy("cli._status", "cmd_status"))
    p = sub.add_parser("report", help="goodput breakdown of a run, from MLflow")
    p.add_argument("run", help="the Ray Train run name (RunConfig.name)")
    p.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    p.add_argument("--experiment", default="ray_goodput")
    p.set_defaults(fn=_lazy("cli._report", "cmd_report"))
    p = sub.add_parser("demo", help="run the quickstart: train, inject a failure, resume")
    p.add_argument("extra", nargs=argparse.REMAINDER)
    p.set_defaults(fn=_demo)
    _register_plan(sub)  # plan, simulate: pure Python, cheap to import
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except GoodputError as exc:
        sys.stderr.write(f"ray-goodput: {exc}\n")
        return 2
