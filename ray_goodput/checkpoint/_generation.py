"""Generations: the lineage order of saves across the attempts of a run.

Every attempt claims, before its first save, a generation higher than any claimed
before (``<root>/checkpoints/GENERATION``) and than the driver's attempt number when a
Recovery decided one. Ray Train starts an attempt only after the previous one's workers
are gone, and the claim is written before any save of the attempt, so a dead attempt's
saves (even ones its uploader commits late) always rank below the live attempt's.
"""

from __future__ import annotations

import json

from ray_goodput.checkpoint import _catalog, _layout, _retention
from ray_goodput.storage import StorageLocation, write_bytes


def next_generation(root: StorageLocation, attempt: int | None) -> int:
    """The generation the next claim gets: above every one claimed under ``root`` (a root
    reused across runs keeps counting), and at least the driver's ``attempt``."""
    return max(_retention.claimed_generation(root) + 1, attempt or 0)


def claim(root: StorageLocation, attempt: int | None) -> int:
    """Claim and return this attempt's generation (rank 0 only)."""
    generation = next_generation(root, attempt)
    write_bytes(_catalog.checkpoints_location(root), _layout.GENERATION,
                json.dumps({"generation": generation}).encode())
    return generation
