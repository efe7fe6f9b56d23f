"""The results files under ``benchmarks/results/`` are current results that say what made
them: each records the commit it ran at and whether the tree was clean (issue 30: a file
without its commit cannot be trusted or re-run)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
FILES = sorted(RESULTS.glob("*.json"))


def test_there_are_results_files_to_check():
    assert FILES, f"no results files under {RESULTS}"


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_each_results_file_records_its_commit_and_whether_its_tree_was_clean(path: Path):
    run = json.loads(path.read_text())["run"]
    assert re.fullmatch(r"[0-9a-f]{40}", run.get("commit") or ""), (
        f"{path.name}: no commit recorded ({run.get('commit')!r})"
    )
    assert isinstance(run.get("dirty"), bool), f"{path.name}: whether the tree was clean is not recorded"
    if run["dirty"]:
        assert run.get("changed"), f"{path.name}: a dirty tree, but not what was changed"
    assert re.fullmatch(r"[a-z0-9_]+_(cpu|cuda_[a-z0-9]+)\.json", path.name), (
        f"{path.name}: not named <benchmark>_<machine kind>.json"
    )
