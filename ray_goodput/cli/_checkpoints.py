"""``ray-goodput ls`` and ``verify``: what is in a checkpoint storage, and is it intact.
Neither imports torch nor Ray (``export``, which needs torch, is ``_export``)."""

from __future__ import annotations

import argparse
import sys
import time

from ray_goodput.checkpoint import Manifest, list_checkpoints, quarantine, read_manifest, step_location, verify
from ray_goodput.errors import CheckpointCorruptError, StorageError
from ray_goodput.storage import StorageLocation, resolve


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
    infos = list_checkpoints(args.uri)
    if not infos:
        _out(f"no checkpoints under {args.uri}")
        return 0
    # By step; GEN is the commit's generation: a restore takes the highest (GEN, STEP).
    _out(f"{'STEP':>10}  {'STATE':<11}  {'GEN':>4}  {'WORLD':>5}  {'SIZE':>10}  {'AGE':>6}")
    for info in infos:
        state = info.state
        world = str(info.world_size) if info.world_size else "-"
        gen = str(info.generation) if info.generation is not None else "-"
        _out(
            f"{info.step:>10}  {state:<11}  {gen:>4}  {world:>5}  {_human(info.num_bytes):>10}  {_age(info.created):>6}"
        )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    infos = [i for i in list_checkpoints(args.uri) if i.committed or i.damaged]
    if args.step is not None:
        infos = [i for i in infos if i.step == args.step]
        if not infos:
            _out(f"no committed checkpoint at step {args.step} under {args.uri}")
            return 2
    damaged = unchecked = 0
    for info in infos:
        loc = step_location(resolve(args.uri), info.step)
        manifest = None
        try:
            manifest = read_manifest(loc)
            if manifest is None and info.committed:
                # Retention removed it, or a newer generation is committing it again, since
                # the listing: nothing to judge, and a record made now would condemn that commit.
                _out(f"step {info.step}: removed while verify ran (retention, or a new commit of it); not checked")
                continue
            problems = verify(loc, manifest, checksums=True) if manifest else ["COMMITTED missing"]
        except CheckpointCorruptError as exc:
            problems = [str(exc)]
        except StorageError as exc:  # storage failed, not the checkpoint: say so, check the rest
            _out(f"step {info.step}: could not be checked: {exc}")
            unchecked += 1
            continue
        if problems and info.committed and _replaced(loc, manifest):
            # Checking takes long: retention removed the step, or a newer generation
            # committed it again, meanwhile. Nothing to judge; a record would condemn that commit.
            _out(f"step {info.step}: removed while verify ran (retention, or a new commit of it); not checked")
            continue
        quarantined = bool(problems) and info.committed
        if quarantined:
            quarantine(loc, manifest, "; ".join(problems[:5]))
        status = "ok" if not problems else "DAMAGED (quarantined)" if quarantined else "DAMAGED"
        _out(f"step {info.step}: {status} ({len(manifest.files) if manifest else 0} files, {_human(info.num_bytes)})")
        for problem in problems:
            _out(f"  {problem}")
        damaged += bool(problems)
    if not infos:
        _out(f"no committed checkpoints under {args.uri}")
    return 1 if damaged else 2 if unchecked else 0


def _replaced(loc: StorageLocation, manifest: Manifest | None) -> bool:
    """Whether the step's commit is gone, or is another one, since ``manifest`` was read."""
    try:
        now = read_manifest(loc)
    except (CheckpointCorruptError, StorageError):
        return False  # cannot tell: judge what was read
    return now is None or manifest is None or now.digest != manifest.digest
