"""A module that reads the environment when it is imported (as ``import ray`` does: Ray's
C++ config reads ``RAY_AUTH_MODE`` then), for the ``run_world`` environment test."""

from __future__ import annotations

import os

SEEN_AT_IMPORT = os.environ.get("RAY_GOODPUT_TEST_MARKER")


def seen_at_import(rank: int, world: int) -> str | None:
    return SEEN_AT_IMPORT


def nothing(rank: int, world: int) -> None:
    return None
