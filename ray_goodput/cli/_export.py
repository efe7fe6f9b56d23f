"""``ray-goodput export``: one committed checkpoint as a single ``torch.save`` file."""

from __future__ import annotations

import argparse
import sys

import torch

from ray_goodput.checkpoint import export_torch_save


def cmd_export(args: argparse.Namespace) -> int:
    path = export_torch_save(args.uri, args.step, args.out, optim=args.optim)
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    sys.stdout.write(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB): keys {sorted(state)}\n")
    return 0
