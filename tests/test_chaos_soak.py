"""The chaos soak (``benchmarks/chaos_soak.py``) and its oracle (``ray_goodput.testing``'s
storage scan and invariant checks): each check catches what it claims to catch, the soak
draws reproducible trials, and a CI-sized soak on real processes finds no violation and
fires every fault kind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from ray_goodput.testing import (
    ReferenceRun,
    StorageScan,
    check_data,
    check_kept,
    check_no_rot,
    check_restore,
    judge_run,
    publish_file,
    read_outcome,
    scan_storage,
)
from ray_goodput.testing._soak_oracle import peer_dead
from tests.conftest import kill_tree

ROOT = Path(__file__).resolve().parents[1]
SOAK = "benchmarks/chaos_soak.py"
SOAK_TIMEOUT_S = 540  # under the 600 s pytest-timeout: the test reports, not the plugin
KINDS = 18  # the soak's fault kinds (its --kinds choices): one rotation of the trials
DATA = {"n_samples": 16, "global_batch": 4}  # the soak's dataset: 16 samples, 4 per step
REF = ReferenceRun(
    schedule=(1, 1),
    hashes={0: "fresh", 2: "h2", 4: "h4", 6: "h6"},
    ids={1: [0, 1, 2, 3], 2: [4, 5, 6, 7], 3: [8, 9, 10, 11], 4: [12, 13, 14, 15]},
    final="h8",
)


def _scan(**steps: tuple[str, int]) -> StorageScan:
    """``s4=("intact", 1)``: step 4 intact, generation 1."""
    out = StorageScan()
    for key, (state, generation) in steps.items():
        step = int(key[1:])
        out.steps[step] = state
        if state != "partial":
            out.order[step] = (generation, step)
    return out


def test_restore_of_an_older_checkpoint_than_the_newest_intact_is_a_violation():
    pre = _scan(s2=("intact", 1), s4=("intact", 1))
    assert check_restore(pre, {"step": 4, "hash": "h4"}, REF) == []
    assert check_restore(pre, {"step": 2, "hash": "h2"}, REF)[0].startswith("restore_lost_progress")
    assert check_restore(pre, {"step": None, "hash": "x"}, REF)[0].startswith("restore_lost_progress")


def test_newest_is_by_lineage_so_a_dead_attempts_higher_step_is_older():
    pre = _scan(s6=("intact", 1), s4=("intact", 2))
    assert pre.newest("intact") == 4
    assert check_restore(pre, {"step": 4, "hash": "h4"}, REF) == []
    dead = check_restore(pre, {"step": 6, "hash": "h6"}, REF)  # higher step, older lineage
    assert dead[0].startswith("restore_lost_progress")
    older = _scan(s6=("intact", 2), s4=("intact", 1))
    assert check_restore(older, {"step": 4, "hash": "h4"}, REF)[0].startswith("restore_lost_progress")


def test_restoring_an_uncommitted_step_or_a_wrong_state_is_a_violation():
    pre = _scan(s2=("intact", 1), s4=("partial", 0))
    found = check_restore(pre, {"step": 4, "hash": "h4"}, REF)
    assert "restored_uncommitted" in {v.split(":")[0] for v in found}
    wrong = check_restore(pre, {"step": 2, "hash": "h4"}, REF)
    assert [v.split(":")[0] for v in wrong] == ["restored_wrong_state"]


def test_restore_returning_none_after_changing_the_state_is_a_violation():
    empty = _scan(s4=("damaged", 1))
    assert check_restore(empty, {"step": None, "hash": "fresh"}, REF) == []
    found = check_restore(empty, {"step": None, "hash": "h4"}, REF)
    assert [v.split(":")[0] for v in found] == ["restored_wrong_state"]


def test_silent_damage_counts_toward_keep_last_until_a_reader_finds_it():
    pre = _scan(s2=("intact", 1), s4=("damaged", 1))
    post = _scan(s4=("damaged", 1), s6=("intact", 1), s8=("intact", 1))
    assert check_kept(pre, post, keep_last=3) == []
    assert check_kept(pre, post, keep_last=3, known_bad={4})[0].startswith("committed_lost: step 2")
    post.marked.add(4)
    assert check_kept(pre, post, keep_last=3)[0].startswith("committed_lost: step 2")


def test_losing_an_intact_checkpoint_is_a_violation_unless_keep_last_newer_ones_exist():
    pre = _scan(s2=("intact", 1), s4=("intact", 1))
    kept_one_newer = _scan(s4=("intact", 1), s6=("intact", 1))
    assert check_kept(pre, kept_one_newer, keep_last=2) == []
    lost = check_kept(pre, kept_one_newer, keep_last=3)
    assert len(lost) == 1 and lost[0].startswith("committed_lost: step 2")
    quarantined = _scan(s2=("intact", 1), s4=("quarantined", 1))
    assert check_kept(pre, quarantined, keep_last=1)[0].startswith("committed_lost: step 4")
    assert check_no_rot(quarantined, set())[0].startswith("false_quarantine")
    assert check_no_rot(_scan(s4=("damaged", 1)), {4}) == []
    assert check_no_rot(_scan(s4=("damaged", 1)), set())[0].startswith("committed_damaged")


def test_a_repeated_skipped_or_reordered_sample_is_a_violation():
    good = {s: {"ids": REF.ids[s], "hash": None} for s in range(1, 5)}
    ref = ReferenceRun(schedule=(1, 1), hashes={s: None for s in range(1, 5)}, ids=REF.ids, final="")
    assert check_data(good, ref, steps=4, **DATA) == []
    repeated = {**good, 3: {"ids": [4, 5, 6, 7], "hash": None}}
    kinds = {v.split(":")[0] for v in check_data(repeated, ref, steps=4, **DATA)}
    assert kinds == {"data_order", "sample_not_once"}
    missing = {s: r for s, r in good.items() if s != 2}
    assert check_data(missing, ref, steps=4, **DATA)[0].startswith("step_missing")


def test_a_rank_marker_never_renamed_into_place_is_not_an_orphan_restore_must_take(tmp_path):
    """Found by the 200-trial soak (seed 0, trial 1: a kill 13 ms after a save): the kill
    fell between the fsync of the rank marker's temporary file and its rename. The soak read
    every file under ``.ranks/`` and called the step a completable orphan; the library
    (rightly) reads only markers under their final name, found nothing durable and started
    fresh, which the soak reported as ``restore_lost_progress``."""
    import torch

    from ray_goodput import Checkpointer
    from ray_goodput.checkpoint.protocol import _catalog, _layout
    from ray_goodput.storage import list_dir, resolve

    root = str(tmp_path / "root")
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(4, 4)})
    loc = _catalog.step_location(resolve(root), 1)
    loc.fs.delete_file(loc.join(_layout.COMMITTED))  # killed before the commit...
    (marker,) = [i.path for i in list_dir(loc, _layout.RANKS_DIR)]
    loc.fs.move(marker, f"{marker}.tmp-123-456")  # ...and before its marker's rename
    assert _catalog.newest_valid(root) is None
    assert scan_storage(root).steps == {1: "partial"}


def _outcome(tmp_path: Path, **ranks: dict | str) -> dict[int, str]:
    (tmp_path / "runs").mkdir(parents=True, exist_ok=True)
    for key, value in ranks.items():
        name = "done" if value == "done" else "error"
        text = "" if value == "done" else json.dumps(value)
        (tmp_path / "runs" / f"a0-r{key[1:]}.{name}").write_text(text)
    return read_outcome(tmp_path, 0, len(ranks))


def test_ranks_disagreeing_or_a_run_failing_without_an_injected_cause_is_a_violation(tmp_path):
    storage = {
        "error": "CheckpointError: x",
        "chain": ["CheckpointError", "StorageError"],
        "storage": True,
        "actor": False,
    }
    outcome = _outcome(tmp_path, r0=storage, r1="done")
    status, found = judge_run(tmp_path, 0, outcome, ("storage",), armed=False)
    assert status == "failed" and found[0].startswith("divergent_outcome")
    both = _outcome(tmp_path / "b", r0=storage, r1=storage)
    assert judge_run(tmp_path / "b", 0, both, ("storage",), armed=False) == ("failed", [])
    assert judge_run(tmp_path / "b", 0, both, (), armed=False)[1][0].startswith("run_failed")


def test_a_rank_dying_with_no_fault_armed_is_a_violation(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "a1-r0.done").write_text("{}")
    outcome = read_outcome(tmp_path, 1, 2)
    assert outcome == {0: "done", 1: "killed"}
    assert judge_run(tmp_path, 1, outcome, (), armed=True) == ("killed", [])
    assert judge_run(tmp_path, 1, outcome, (), armed=False)[1][0].startswith("unexpected_death")


def _drawn(*args: str) -> list[dict]:
    """The trials the soak draws for ``args`` (``--draw-only``: nothing runs)."""
    done = subprocess.run(
        [
            sys.executable,
            SOAK,
            "--draw-only",
            "--world",
            "2",
            "--storage",
            "mixed",
            "--s3-share",
            "0.2",
            "--steps",
            "8",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_trials_are_reproducible_and_one_rotation_draws_every_kind():
    first = _drawn("--seed", "3", "--trials", str(2 * KINDS))
    rotation = [t["kind"] for t in first[:KINDS]]
    assert len(set(rotation)) == KINDS
    assert Counter(t["kind"] for t in first) == Counter({kind: 2 for kind in rotation})
    assert _drawn("--seed", "3", "--only", "7") == [first[7]]
    assert _drawn("--seed", "4", "--only", "7") != [first[7]]


def test_the_production_path_kinds_run_through_the_uploader_actor_at_world_two():
    # Drawn at --world 1 (the CI soak's), they still run two ranks on the node's actor.
    drawn = _drawn("--seed", "5", "--trials", str(KINDS), "--world", "1", "--outage-s", "1", "4")
    by_kind = {t["kind"]: t for t in drawn}
    for kind in ("uploader_kill_ray", "worker_kill_actor", "storage_outage", "staging_full"):
        assert by_kind[kind]["uploader"] == "actor" and by_kind[kind]["schedule"] == [2, 2], by_kind[kind]
    outage = by_kind["storage_outage"]
    assert outage["storage"] == "s3" and outage["flaky_rate"] == 0.0 and 1 <= outage["fault"]["seconds"] <= 4
    assert {t["uploader"] for t in drawn if t["kind"].startswith("hook:")} == {"thread"}


def _start_ci_soak(directory: Path) -> subprocess.Popen:
    """20 trials, the issue's CI size: one rotation of the kinds (the first 18, each kind
    once) and 2 more; world size 1 (2 on the world-change draws and on the production-path
    kinds, through the uploader actor), local storage except the S3 ones, outages of 1-4 s.
    It starts when collection ends and runs beside the quick tests."""
    with open(directory / "stdout", "w") as stdout, open(directory / "stderr", "w") as stderr:
        return subprocess.Popen(
            [
                sys.executable,
                SOAK,
                "--trials",
                "20",
                "--seed",
                "11",
                "--world",
                "1",
                "--s3-share",
                "0.1",
                "--run-timeout",
                "90",
                "--outage-s",
                "1",
                "4",
                "--out",
                str(directory / "soak.json"),
            ],
            cwd=ROOT,
            stdout=stdout,
            stderr=stderr,
        )


@pytest.mark.slow
@pytest.mark.early.with_args(_start_ci_soak)  # (a lone function argument would be marked)
def test_ci_soak_has_no_violation_and_fires_every_fault_kind(early):
    proc, directory = early
    try:
        proc.wait(timeout=SOAK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
    stdout = (directory / "stdout").read_text()
    out = directory / "soak.json"
    assert out.exists(), (
        f"no result (killed after {SOAK_TIMEOUT_S} s?): " + stdout[-3000:] + (directory / "stderr").read_text()[-3000:]
    )
    summary = json.loads(out.read_text())["summary"]
    assert summary["violations"] == 0, stdout[-6000:]
    # A soak that raised after its last written trial (in CI once: rc 1, no violation,
    # and nothing to read the cause from) says why here.
    assert proc.returncode == 0, stdout[-3000:] + (directory / "stderr").read_text()[-6000:]
    silent = [k for k, v in summary["kinds"].items() if not v.get("fired")]
    assert len(summary["kinds"]) == KINDS and silent == [], (
        f"fault kinds drawn: {sorted(summary['kinds'])}; never fired: {silent}\n{stdout[-3000:]}"
    )


def test_a_peers_pid_mark_caught_empty_is_not_read_as_its_death(tmp_path):
    # The watchdog polls every 20 ms; a mark written in place can be seen empty (or cut
    # short) between its creation and its last byte. Read as pid 0 ("dead"), the rank
    # killed itself for a peer that was alive, a fault nobody injected.
    empty = tmp_path / "a1-r1.pid"
    empty.write_text("")
    assert not peer_dead(empty)
    assert not peer_dead(tmp_path / "missing.pid")
    mine = tmp_path / "a1-r0.pid"
    publish_file(mine, str(os.getpid()))  # as the soak's ranks publish their marks
    assert mine.read_text() == str(os.getpid()) and not peer_dead(mine)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, timeout=60, check=True
    )
    publish_file(tmp_path / "a1-r2.pid", gone.stdout.strip())
    assert peer_dead(tmp_path / "a1-r2.pid")
