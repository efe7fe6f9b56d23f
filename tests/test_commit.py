"""The commit protocol (``checkpoint/protocol/_commit.py``, ``_manifest.py``): O(world)
storage requests per commit (only the committer reads the rank markers, its reads go out
side by side), one committer elected among the jobs that see every marker, a save whose
committer died finished by the next restore, the per-process turn of one save's jobs,
when the commit landed; and the manifest's CRC32C, with old CRC32 manifests still
verifying. Real storage: a local directory, or moto's S3 server behind a ``FlakyProxy``
that counts and holds requests."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from ray_goodput import Checkpointer
from ray_goodput.checkpoint.protocol import _catalog, _dcp_parts, _layout
from ray_goodput.checkpoint.protocol._commit import COMMITTED, PENDING, CommitProtocol
from ray_goodput.checkpoint.protocol._dcp_parts import write_part
from ray_goodput.checkpoint.protocol._manifest import Manifest, read_manifest
from ray_goodput.checkpoint.protocol._shard_plan import REPLICATED, Leaf
from ray_goodput.errors import StorageError
from ray_goodput.storage import CRC32, CRC32C, checksum, resolve, upload_files
from ray_goodput.testing import FlakyProxy, wait_for


def _stage_rank(step_loc, tmp: Path, rank: int, save_id: str) -> list:
    out = tmp / f"r{rank}"
    out.mkdir()
    names = write_part({"w": torch.ones(3)}, {"w": Leaf(REPLICATED, 12, (3,), (0,))}, {}, rank, save_id, out)
    return upload_files([(out / n, n) for n in names], step_loc)


def test_only_the_committer_reads_rank_markers(s3_server, tmp_path):
    world, save_id = 4, _layout.save_id(1, "abcdef0123")
    proxy = FlakyProxy(s3_server.endpoint, 0.0)
    try:
        root = resolve(s3_server.bucket_uri("req").replace(s3_server.endpoint, proxy.endpoint))
        protocol = CommitProtocol(_catalog.step_location(root, 7), 7, world, save_id, 1)
        marker_gets = []
        for rank in range(world):
            entries = _stage_rank(protocol.step_loc, tmp_path, rank, save_id)
            protocol.declare_durable(rank, entries, created=1.0)
            before = sum(n for p, n in proxy.gets("").items() if "/.ranks/" in p)
            done = protocol.finalize()
            marker_gets.append(sum(n for p, n in proxy.gets("").items() if "/.ranks/" in p) - before)
            assert done.state == (COMMITTED if rank == world - 1 else PENDING)
    finally:
        proxy.close()
    assert marker_gets == [0, 0, 0, world], marker_gets  # was O(world) per rank: O(world^2)


def test_the_committer_reads_markers_parts_and_the_listing_side_by_side_not_in_turn(s3_server, tmp_path):
    """The committer read each rank's marker, then listed the step's files, then read each
    metadata part: 2 x world + 1 storage round trips one after another before COMMITTED.
    They now go out at once, and its own marker (written just now) and metadata part
    (staged beside it) are not read back."""
    from ray_goodput.checkpoint.protocol._dcp_parts import part_file

    world, save_id = 3, _layout.save_id(1, "abcdef0123")
    proxy = FlakyProxy(s3_server.endpoint)
    try:
        uri = s3_server.bucket_uri("side").replace(s3_server.endpoint, proxy.endpoint)
        protocol = CommitProtocol(_catalog.step_location(resolve(uri), 7), 7, world, save_id, 1)
        for rank in range(world):
            entries = _stage_rank(protocol.step_loc, tmp_path, rank, save_id)
            own = protocol.declare_durable(rank, entries, created=1.0)
        first = _layout.rank_marker(0, save_id)
        proxy.stall(first, methods=("HEAD",))  # the read of rank 0's marker, held
        done: list = []
        committing = threading.Thread(
            target=lambda: done.append(protocol.finalize(tmp_path / f"r{world - 1}", own=own)), daemon=True
        )
        committing.start()
        try:
            wait_for(lambda: proxy.holding(first), timeout_s=30, what="the read of rank 0's marker, held")
            # While it is held, the other reads the commit needs have gone out.
            others = [_layout.rank_marker(1, save_id), part_file(0, save_id), part_file(1, save_id)]
            wait_for(
                lambda: all(proxy.count(name, ("HEAD", "GET")) for name in others),
                timeout_s=30,
                what=f"the reads of {others} while rank 0's marker is held",
            )
            assert not done  # the commit waits for the held read
        finally:
            proxy.release()
        committing.join(60)
        assert done and done[0].state == COMMITTED and done[0].committed_at is not None, done
        own_files = (_layout.rank_marker(world - 1, save_id), part_file(world - 1, save_id))
        assert [proxy.count(name, ("HEAD", "GET")) for name in own_files] == [0, 0]
    finally:
        proxy.close()


def test_two_jobs_of_one_process_that_both_see_every_marker_commit_once(s3_server, tmp_path):
    """Every job whose listing shows all the markers commits, and each read O(world)
    markers and metadata parts: at world 8 in storage_requests.py nearly every rank did,
    343 requests per checkpoint against 44 at world 2. Jobs of the same save in one
    process (the ranks of a node share its uploader) now commit one at a time; the later
    one finds the commit made and reads nothing else."""
    world, save_id = 3, _layout.save_id(1, "abcdef0123")
    proxy = FlakyProxy(s3_server.endpoint)
    try:
        uri = s3_server.bucket_uri("race").replace(s3_server.endpoint, proxy.endpoint)
        loc = _catalog.step_location(resolve(uri), 7)
        for rank in range(world):
            CommitProtocol(loc, 7, world, save_id, 1).declare_durable(
                rank, _stage_rank(loc, tmp_path, rank, save_id), created=1.0
            )
        proxy.latency_s = 0.2  # both jobs list every marker before either commit lands
        before = sum(n for p, n in proxy.gets("").items() if "/.ranks/" in p)
        done: list = []
        jobs = [
            threading.Thread(
                target=lambda: done.append(CommitProtocol(loc, 7, world, save_id, 1).finalize()), daemon=True
            )
            for _ in range(2)
        ]
        for job in jobs:
            job.start()
        for job in jobs:
            job.join(120)
        marker_gets = sum(n for p, n in proxy.gets("").items() if "/.ranks/" in p) - before
    finally:
        proxy.close()
    assert sorted(d.state for d in done) == [COMMITTED, COMMITTED], done
    assert marker_gets == world, marker_gets  # one committer's reads, not two
    assert sum(d.committed_at is not None for d in done) == 1  # one COMMITTED write


def _finalize_side_by_side(s3_server, tmp_path, world: int) -> tuple[dict[int, Any], list[FlakyProxy]]:
    """Every rank of one save durable, then each rank's job finalizes at once, each through
    a proxy of its own (different URIs share no per-process turn: different processes, as
    with one node per rank). Each proxy holds its job's commit intent until every job has
    sent one (so every job listed every marker and no intent), then rank 0's lands first
    and the others after it: the order in which the election is won, made certain instead
    of timed. Returns each rank's result and the proxies."""
    save_id = _layout.save_id(1, "abcdef0123")
    proxies = [FlakyProxy(s3_server.endpoint) for _ in range(world)]
    uri = s3_server.bucket_uri("elect")
    locs = [_catalog.step_location(resolve(uri.replace(s3_server.endpoint, p.endpoint)), 7) for p in proxies]
    owns = [
        CommitProtocol(locs[r], 7, world, save_id, 1).declare_durable(
            r, _stage_rank(locs[r], tmp_path, r, save_id), created=1.0
        )
        for r in range(world)
    ]
    direct = resolve(uri)  # not through a proxy
    direct.fs.get_file_info(direct.root)  # connected before the jobs start
    intents = "/" + _layout.RANKS_DIR + "/commit-"
    for proxy in proxies:
        proxy.stall(intents, methods=("PUT",))
    done: dict[int, Any] = {}
    together = threading.Barrier(world)

    def job(rank: int) -> None:
        protocol = CommitProtocol(locs[rank], 7, world, save_id, 1)
        together.wait(30)
        done[rank] = protocol.finalize(tmp_path / f"r{rank}", own=owns[rank])

    jobs = [threading.Thread(target=job, args=(r,), daemon=True) for r in range(world)]
    for j in jobs:
        j.start()
    try:
        wait_for(
            lambda: all(p.holding(_layout.commit_intent(r, save_id)) for r, p in enumerate(proxies)),
            timeout_s=60,
            what="every job's commit intent",
        )
        proxies[0].release()
        first = direct.join(_layout.CHECKPOINTS_DIR, _layout.step_dir(7), _layout.commit_intent(0, save_id))
        wait_for(
            lambda: direct.fs.get_file_info(first).type.name == "File",
            timeout_s=60,
            what="rank 0's commit intent in storage",
        )
    finally:
        for p in proxies:
            p.release()
    for j in jobs:
        j.join(120)
    return done, proxies


def test_jobs_of_different_processes_that_all_see_every_marker_elect_one_committer(s3_server, tmp_path):
    """Every job whose listing showed all the markers committed, each reading O(world)
    markers and metadata parts: with a process per rank (storage_requests.py) 343
    requests per checkpoint at world 8 against 44 at world 2. Those jobs now elect one
    committer (the lowest rank among the commit intents written); the others defer and
    read no marker or part."""
    from ray_goodput.checkpoint.protocol import _commit

    world = 4
    done, proxies = _finalize_side_by_side(s3_server, tmp_path, world)
    try:
        marker_gets = sum(n for p in proxies for path, n in p.gets().items() if "/.ranks/rank-" in path)
        part_gets = sum(n for p in proxies for path, n in p.gets().items() if "/parts/" in path)
        commits = sum(p.count(f"/{_layout.COMMITTED}", ("PUT",)) for p in proxies)
    finally:
        for p in proxies:
            p.close()
    assert len(done) == world, done
    # Were 4, 12 and 12 (every job committed); one commit reads the other ranks' markers and parts.
    assert (commits, marker_gets, part_gets) == (1, world - 1, world - 1)
    committed = [r for r, d in done.items() if d.committed_at is not None]
    assert len(committed) == 1 and done[committed[0]].state == COMMITTED, done
    assert all(d.state == _commit.DEFERRED for r, d in done.items() if r != committed[0]), done


def test_a_save_whose_elected_committer_is_killed_before_committed_is_committed_by_the_next_restore(tmp_path):
    """The jobs that defer to the elected committer never commit: when it dies between its
    intent and COMMITTED, the save must not be lost but finished by the next restore's
    pick (as an orphan), and a job that finds an intent already there writes none."""
    import subprocess

    from ray_goodput.checkpoint.protocol import _commit

    root, world, save_id = str(tmp_path / "root"), 2, _layout.save_id(1, "abcdef0123")
    loc = _catalog.step_location(resolve(root), 7)
    owns = [
        CommitProtocol(loc, 7, world, save_id, 1).declare_durable(
            r, _stage_rank(loc, tmp_path, r, save_id), created=1.0
        )
        for r in range(world)
    ]
    code = (
        "import sys\n"
        "from ray_goodput.checkpoint.protocol import _catalog\n"
        "from ray_goodput.checkpoint.protocol._commit import CommitProtocol\n"
        "from ray_goodput.checkpoint.protocol._manifest import read_rank_marker\n"
        "from ray_goodput.storage import resolve\n"
        "root, save_id = sys.argv[1], sys.argv[2]\n"
        "loc = _catalog.step_location(resolve(root), 7)\n"
        "CommitProtocol(loc, 7, 2, save_id, 1).finalize(own=read_rank_marker(loc, 0, save_id))\n"
        "print('finished')\n"
    )
    env = {**os.environ, "RAY_GOODPUT_FAULT": "commit.before_committed:1"}
    killed = subprocess.run(
        [sys.executable, "-c", code, root, save_id], env=env, capture_output=True, text=True, timeout=120
    )
    assert killed.returncode == -9 and "finished" not in killed.stdout, (killed.returncode, killed.stderr[-800:])
    ranks_dir = Path(root) / _layout.CHECKPOINTS_DIR / _layout.step_dir(7) / _layout.RANKS_DIR
    assert (ranks_dir.parent / _layout.commit_intent(0, save_id)).exists()  # it stood, then died
    deferred = CommitProtocol(loc, 7, world, save_id, 1).finalize(tmp_path / "r1", own=owns[1])
    assert deferred.state == _commit.DEFERRED and read_manifest(loc) is None
    assert not (ranks_dir.parent / _layout.commit_intent(1, save_id)).exists()
    picked = _catalog.newest_valid(root)
    assert picked is not None and picked[1].step == 7 and picked[1].save_id == save_id, picked
    assert read_manifest(loc) is not None and read_manifest(loc).save_id == save_id


def test_the_elected_committer_run_again_after_an_outage_commits_rather_than_defer_to_ranks_it_outranks(tmp_path):
    """Ranks 0 and 1 both wrote their intents; rank 1 saw rank 0's and deferred. Rank 0's
    COMMITTED write then failed past its retries, and the uploader ran its job again once
    storage answered: that run saw rank 1's intent and deferred to it, and nobody
    committed a save every rank had made durable. A job whose own intent is there stands
    where it stood: it commits when its rank is the lowest intent."""
    from ray_goodput.checkpoint.protocol import _commit
    from ray_goodput.storage import touch

    world, save_id = 2, _layout.save_id(1, "abcdef0123")
    loc = _catalog.step_location(resolve(str(tmp_path / "root")), 7)
    owns = [
        CommitProtocol(loc, 7, world, save_id, 1).declare_durable(
            r, _stage_rank(loc, tmp_path, r, save_id), created=1.0
        )
        for r in range(world)
    ]
    for rank in range(world):
        touch(loc, _layout.commit_intent(rank, save_id))
    assert CommitProtocol(loc, 7, world, save_id, 1).finalize(own=owns[1]).state == _commit.DEFERRED
    assert CommitProtocol(loc, 7, world, save_id, 1).finalize(own=owns[0]).state == COMMITTED
    assert read_manifest(loc) is not None and read_manifest(loc).save_id == save_id


def _two_generations_of_step_7(tmp_path, root: str):
    """Generation 1's commit of step 7 and generation 2's save of it again, every rank of
    it durable, its committer dead before it replaced the commit; returns (loc, gen 2's id)."""
    from ray_goodput.storage import touch

    loc = _catalog.step_location(resolve(root), 7)
    for generation in (1, 2):
        save_id = _layout.save_id(generation, f"{generation:02d}cdef0123")
        (tmp_path / f"g{generation}").mkdir()
        owns = [
            CommitProtocol(loc, 7, 2, save_id, generation).declare_durable(
                r, _stage_rank(loc, tmp_path / f"g{generation}", r, save_id), created=1.0
            )
            for r in range(2)
        ]
        if generation == 1:
            assert CommitProtocol(loc, 7, 2, save_id, 1).finalize(own=owns[0]).state == COMMITTED
    touch(loc, _layout.commit_intent(0, save_id))
    return loc, save_id


def test_a_complete_resave_over_an_older_generations_commit_is_finished_by_the_next_restore(tmp_path):
    """Generation 2 saved step 7 again over generation 1's commit of it (a late commit of a
    dead attempt); every rank was durable and the elected committer stood, then died before
    it replaced the old COMMITTED. The next restore ranked the folder by the old commit and
    restored generation 1's step 7 (or an older step): the newer save was lost. It is
    finished instead, as an orphan with no commit is."""
    root = str(tmp_path / "root")
    loc, save_id = _two_generations_of_step_7(tmp_path, root)
    assert read_manifest(loc).generation == 1
    picked = _catalog.newest_valid(root)
    assert picked is not None and (picked[1].step, picked[1].generation) == (7, 2), picked
    assert read_manifest(loc).save_id == save_id


def test_a_resave_that_cannot_commit_leaves_the_older_generations_commit_of_the_step_standing(tmp_path):
    """Generation 2's save of step 7 has a damaged metadata part. Finishing it deleted
    generation 1's COMMITTED before the part's check refused it: the step was left with
    no commit (and each later finish deleted it again). Everything that can refuse a save
    is checked before the commit there is touched."""
    root = str(tmp_path / "root")
    loc, save_id = _two_generations_of_step_7(tmp_path, root)
    part = Path(loc.root) / _dcp_parts.part_file(1, save_id)
    part.write_bytes(b"\0" * part.stat().st_size)
    picked = _catalog.newest_valid(root)
    assert picked is not None and (picked[1].step, picked[1].generation) == (7, 1), picked
    assert read_manifest(loc) is not None and read_manifest(loc).generation == 1
    assert _catalog.newest_valid(root)[1].generation == 1  # and again: it stays


def test_a_resave_finished_over_a_quarantined_commit_is_the_one_restored(tmp_path):
    """Step 7 was quarantined, the run fell back and saved step 7 again, and that save's
    committer died. The restore finished it (which removes the quarantine) but still
    judged the folder by the old commit's quarantine, and fell back further."""
    from ray_goodput.checkpoint.protocol._manifest import quarantine

    root = str(tmp_path / "root")
    loc, save_id = _two_generations_of_step_7(tmp_path, root)
    quarantine(loc, read_manifest(loc), "found damaged")
    picked = _catalog.newest_valid(root)
    assert picked is not None and (picked[1].step, picked[1].generation) == (7, 2), picked


def test_an_orphan_with_a_damaged_metadata_part_is_skipped_and_the_restore_falls_back(tmp_path):
    """Step 20's ranks were all durable, its committer died, and one rank's metadata part
    was damaged since (same size). Finishing it raised the unpickling error on every
    restore, with step 10 intact; a part that unpickled anyway went into .metadata, whose
    checksum was then computed from the wrong bytes. The part is checked against what its
    rank declared: the orphan can never commit, and the restore picks step 10."""
    root, world = str(tmp_path / "root"), 2
    for step in (10, 20):
        loc = _catalog.step_location(resolve(root), step)
        save_id = _layout.save_id(1, f"{step:02d}cdef0123")
        (tmp_path / f"s{step}").mkdir()
        owns = [
            CommitProtocol(loc, step, world, save_id, 1).declare_durable(
                r, _stage_rank(loc, tmp_path / f"s{step}", r, save_id), created=1.0
            )
            for r in range(world)
        ]
        if step == 10:
            assert CommitProtocol(loc, step, world, save_id, 1).finalize(own=owns[0]).state == COMMITTED
    part = Path(loc.root) / _dcp_parts.part_file(1, save_id)
    part.write_bytes(b"\0" * part.stat().st_size)
    picked = _catalog.newest_valid(root)
    assert picked is not None and picked[1].step == 10, picked
    assert read_manifest(loc) is None  # step 20 never committed


def test_finishing_an_orphan_never_takes_a_deferral_handed_over_by_a_job_of_the_same_process(tmp_path):
    """Found in review: a job of this process that deferred to another's intent left
    ``deferred`` in the save's turn, and a finalize without a marker of its own (finishing
    an orphan, e.g. the check that a newer generation holds the step) waiting on that
    turn returned it, committing nothing although its committer may be gone."""
    from ray_goodput.checkpoint.protocol import _commit

    world, save_id = 2, _layout.save_id(1, "abcdef0123")
    loc = _catalog.step_location(resolve(str(tmp_path / "root")), 7)
    for rank in range(world):
        CommitProtocol(loc, 7, world, save_id, 1).declare_durable(
            rank, _stage_rank(loc, tmp_path, rank, save_id), created=1.0
        )
    done: list = []
    finishing = threading.Thread(
        target=lambda: done.append(CommitProtocol(loc, 7, world, save_id, 1).finalize()), daemon=True
    )
    with _commit._taking_turn(loc, save_id) as turn:  # a job of this process, deferring meanwhile
        finishing.start()
        wait_for(lambda: turn.users == 2, timeout_s=30, what="the orphan's finalize waiting for the turn")
        turn.found = _commit.Finalized(_commit.DEFERRED)
    finishing.join(60)
    assert done and done[0].state == COMMITTED, done
    assert read_manifest(loc) is not None and read_manifest(loc).save_id == save_id


def test_a_job_waiting_for_another_jobs_commit_of_the_same_save_stops_at_its_bound(tmp_path, monkeypatch):
    from ray_goodput.checkpoint.protocol import _commit

    world, save_id = 1, _layout.save_id(1, "abcdef0123")
    loc = _catalog.step_location(resolve(str(tmp_path / "root")), 7)
    protocol = CommitProtocol(loc, 7, world, save_id, 1)
    protocol.declare_durable(0, _stage_rank(loc, tmp_path, 0, save_id), created=1.0)
    monkeypatch.setattr(_commit, "_TURN_WAIT_S", 0.2)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:  # a job of this process stuck in its commit of the same save
        with _commit._taking_turn(loc, save_id):
            holding.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert holding.wait(30)
        with pytest.raises(StorageError, match=f"committing save {save_id}"):
            protocol.finalize()
    finally:
        release.set()
        holder.join(30)
    assert protocol.finalize().state == COMMITTED and not _commit._turns  # the turn went with its users


def test_the_committing_jobs_result_says_when_its_commit_landed(tmp_path):
    """Time to durable was measured by polling storage for COMMITTED (benchmarks): up to a
    poll period late, and ~40 requests/s against the storage the upload was using. The job
    that writes COMMITTED now reports when the write returned; a job that did not write it
    reports None."""
    root = str(tmp_path / "root")
    model = torch.nn.Linear(8, 8)
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        before = time.time()
        ckpt.save(1, {"model": model})
        result = ckpt._pending[1].handoff.durable.result(timeout=60)
        after = time.time()
    assert result.committed and before <= result.committed_at <= after
    commit = Path(root) / _layout.CHECKPOINTS_DIR / _layout.step_dir(1) / _layout.COMMITTED
    # The write it reports: made during this save, and done when it says (0.1 s: the file
    # system's coarse clock; no bound on how long the write and its fsyncs took).
    assert before - 0.1 <= commit.stat().st_mtime <= result.committed_at + 0.1
    world, save_id = 2, _layout.save_id(1, "abcdef0123")
    protocol = CommitProtocol(_catalog.step_location(resolve(root), 9), 9, world, save_id, 1)
    entries = _stage_rank(protocol.step_loc, tmp_path, 0, save_id)
    protocol.declare_durable(0, entries, created=1.0)
    pending = protocol.finalize()
    assert pending.state == PENDING and pending.committed_at is None


# ---- CRC32C, and old CRC32 manifests --------------------------------------------------------


def test_new_manifests_say_crc32c_and_old_crc32_ones_still_verify_and_restore(tmp_path):
    root = str(tmp_path / "root")
    model = torch.nn.Linear(64, 64)
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.save(1, {"model": model})
    step_loc = _catalog.step_location(resolve(root), 1)
    committed = Path(step_loc.root) / _layout.COMMITTED
    raw = json.loads(committed.read_bytes())
    assert raw["checksum"] == CRC32C
    manifest = Manifest.from_bytes(committed.read_bytes())
    for entry in manifest.files:
        data = (Path(step_loc.root) / entry.name).read_bytes()
        assert entry.algorithm == CRC32C and entry.crc32 == checksum(data, CRC32C)
    # Rewrite it as an old manifest: CRC32 values, no "checksum" anywhere.
    del raw["checksum"]
    for f in raw["files"]:
        f.pop("checksum", None)
        f["crc32"] = zlib.crc32((Path(step_loc.root) / f["name"]).read_bytes())
    committed.write_bytes(json.dumps(raw).encode())
    old = read_manifest(step_loc)
    assert {f.algorithm for f in old.files} == {CRC32}
    assert _catalog.verify(step_loc, old, checksums=True) == []
    with Checkpointer(root, staging_dir=str(tmp_path / "other"), uploader="thread", verify_checksums=True) as ckpt:
        fresh = torch.nn.Linear(64, 64)
        assert ckpt.restore({"model": fresh}) == 1
    assert torch.equal(fresh.weight, model.weight)
    data_file = next(f for f in old.files if f.name.endswith(".distcp"))
    path = Path(step_loc.root) / data_file.name
    path.write_bytes(b"\0" + path.read_bytes()[1:])  # same size, other bytes
    assert any("checksum" in p for p in _catalog.verify(step_loc, old, checksums=True))
