"""Choosing the checkpoint to restore (``checkpoint/protocol/_catalog.py``): the commit
read beside the listing (and taken only when the listing shows its files), only the
picked commit read, directories ranked by generation, orphans finished by the pick.
Requests counted and held by a ``FlakyProxy`` in front of moto's S3 server."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from ray_goodput import Checkpointer, list_checkpoints
from ray_goodput.checkpoint.protocol import _catalog, _layout
from ray_goodput.checkpoint.protocol._manifest import Manifest
from ray_goodput.storage import FileEntry, resolve
from ray_goodput.testing import FlakyProxy, wait_for


def _restore_holding(
    s3_server,
    tmp_path,
    *,
    hold: str,
    until: str,
    decided_step: int | None = None,
) -> tuple[int, bool]:
    """Save steps 1 and 2 through a proxy, then restore (into a fresh model, the node-local
    copy in place; with the driver's decision of ``decided_step`` when given) while the
    proxy holds the request ``hold`` names: ``"listing"`` (a GET of the bucket itself) or
    ``"commit"`` (the HEAD and GET of the restored step's COMMITTED). Returns the restored
    step and whether ``until`` (the other of the two) arrived while it was held.

    A request that goes out only once the held one is answered never arrives while it is
    held: the watcher's bounded wait ends and the answer is ``False``, however slow or fast
    the machine is (timing the two against a delay failed under CI load)."""
    from ray_goodput.runtime._resume import ResumeDecision, root_key, set_decision

    proxy = FlakyProxy(s3_server.endpoint)
    try:
        uri = s3_server.bucket_uri("run").replace(s3_server.endpoint, proxy.endpoint)
        model, staging = torch.nn.Linear(8, 8), str(tmp_path / "s")
        with Checkpointer(uri, staging_dir=staging, uploader="thread") as ckpt:
            for step in (1, 2):
                ckpt.save(step, {"model": model})
                ckpt.wait()
        bucket = "/" + uri.split("//", 1)[1].split("/", 1)[0]
        expected = decided_step if decided_step is not None else 2
        paths = {
            "listing": bucket,
            "commit": f"{bucket}/run/{_layout.CHECKPOINTS_DIR}/{_layout.step_dir(expected)}/{_layout.COMMITTED}",
        }
        if decided_step is not None:
            set_decision(ResumeDecision(attempt=3, step=decided_step, root_key=root_key(uri)))
        arrived: list[bool] = []
        try:
            with Checkpointer(uri, staging_dir=staging, uploader="thread") as ckpt:
                began = time.monotonic()

                def watch() -> None:
                    # Both: the other request came, and the held one is held (a GET is held
                    # once storage answered it, so it can be held only after the other came).
                    try:
                        arrived.append(
                            bool(
                                wait_for(
                                    lambda: (
                                        proxy.holding(paths[hold])
                                        and any(
                                            t >= began and path == paths[until] for t, _, path in list(proxy.arrivals)
                                        )
                                    ),
                                    timeout_s=60,
                                    what=f"the restore's {until} while its {hold} is held",
                                )
                            )
                        )
                    except TimeoutError:
                        arrived.append(False)
                    finally:
                        proxy.release()

                proxy.stall(paths[hold], methods=("HEAD", "GET"), exact=True)
                watcher = threading.Thread(target=watch, daemon=True)
                watcher.start()
                try:
                    restored = ckpt.restore({"model": torch.nn.Linear(8, 8)})
                finally:
                    watcher.join(timeout=90)
                    proxy.release()
        finally:
            set_decision(None)
        assert not watcher.is_alive()
        assert proxy.holding(paths[hold]) >= 1, f"the restore made no {hold} request"
        return restored, arrived == [True]
    finally:
        proxy.close()


def test_restore_reads_the_commit_of_its_node_local_guess_beside_the_listing(s3_server, tmp_path):
    """Rank 0 listed storage, then read the newest commit: two round trips in sequence
    before any load. The commit of the newest node-local step now goes out with the listing."""
    restored, beside = _restore_holding(s3_server, tmp_path, hold="listing", until="commit")
    assert restored == 2
    assert beside, "the commit was read only once the listing was answered"


def test_a_restore_of_the_step_the_driver_chose_reads_its_commit_beside_the_listing(s3_server, tmp_path):
    """A restart's usual restore (the driver's Recovery decided the step) read that step's
    COMMITTED (a HEAD, then a GET) and only then listed its directory for the size check:
    three round trips in sequence before any load. The listing now goes out beside the read."""
    restored, beside = _restore_holding(s3_server, tmp_path, hold="commit", until="listing", decided_step=1)
    assert restored == 1
    assert beside, "the step directory was listed only once its commit was read"


def test_restore_reads_only_the_commit_it_picks_not_every_one_kept(s3_server, tmp_path):
    """The choice read every kept commit's COMMITTED (a HEAD and a GET each on S3), one
    after another, before picking the newest: keep_last=3 made it six requests in sequence."""
    proxy = FlakyProxy(s3_server.endpoint)
    try:
        uri = s3_server.bucket_uri("run").replace(s3_server.endpoint, proxy.endpoint)
        model = torch.nn.Linear(8, 8)
        with Checkpointer(uri, staging_dir=str(tmp_path / "s"), keep_last=3, uploader="thread") as ckpt:
            for step in (1, 2, 3):
                ckpt.save(step, {"model": model})
                ckpt.wait()
        before = proxy.gets(_layout.COMMITTED)
        with Checkpointer(uri, staging_dir=str(tmp_path / "fresh"), uploader="thread") as ckpt:
            assert ckpt.restore({"model": torch.nn.Linear(8, 8)}) == 3
        after = proxy.gets(_layout.COMMITTED)
        read = {path.split("/")[-2] for path, n in after.items() if n > before.get(path, 0)}
        assert read == {_layout.step_dir(3)}, read
        assert len([i for i in list_checkpoints(uri) if i.committed]) == 3  # all kept
    finally:
        proxy.close()


def test_a_directory_ranked_by_its_newest_files_is_put_back_by_its_commits_generation(tmp_path):
    """A directory ranks by its files' newest generation until its commit is read: a step
    whose commit is of an older generation than its files (a re-save not committed) must
    not outrank a newer generation's commit of a lower step."""
    from ray_goodput.checkpoint.protocol._catalog import newest_valid

    root = str(tmp_path / "root")
    with Checkpointer(root, staging_dir=str(tmp_path / "a"), uploader="thread") as ckpt:
        ckpt.save(20, {"model": torch.nn.Linear(4, 4)})  # generation 1
        ckpt.wait()
    with Checkpointer(root, staging_dir=str(tmp_path / "b"), uploader="thread") as ckpt:
        ckpt.save(10, {"model": torch.nn.Linear(4, 4)})  # generation 2: outranks step 20
        ckpt.wait()
    step20 = Path(_catalog.step_location(resolve(root), 20).root)
    (step20 / "__0_g000003-abcdef0123.distcp").write_bytes(b"x")  # a later save's file, no commit
    loc, manifest = newest_valid(root)
    assert (manifest.step, manifest.generation) == (10, 2)
    assert newest_valid(root, before=manifest.order)[1].step == 20


def test_an_orphan_finished_by_the_pick_and_re_ranked_is_not_quarantined_by_the_older_listing(tmp_path):
    """Found in review: an orphan finished on the way whose complete save is of an older
    generation than the directory's newest files is put back, and on its second pass it
    was checked against the listing made before its .metadata existed: quarantined."""
    from ray_goodput.checkpoint.protocol._catalog import newest_valid

    root = str(tmp_path / "root")
    model = torch.nn.Linear(4, 4)
    with Checkpointer(root, staging_dir=str(tmp_path / "a"), uploader="thread") as ckpt:
        ckpt.save(5, {"model": model})  # generation 1
        ckpt.wait()
    step5 = Path(_catalog.step_location(resolve(root), 5).root)
    (step5 / _layout.COMMITTED).unlink()  # the committer died after every rank's marker
    (step5 / _layout.DCP_METADATA).unlink()
    (step5 / "__0_g000002-abcdef0123.distcp").write_bytes(b"x")  # a newer save, cut short
    found = newest_valid(root)
    assert found is not None and (found[1].step, found[1].generation) == (5, 1)
    assert not (step5 / _layout.QUARANTINED).exists()


def test_a_commit_read_beside_the_listing_is_taken_only_when_the_listing_shows_its_files():
    """The early read can predate the listing: a commit replaced in between (its step saved
    again) must not be taken for the one listed."""
    from concurrent.futures import Future

    from ray_goodput.checkpoint.protocol._catalog import StepDir, _listed_manifest

    def read(manifest: Manifest | None = None, error: BaseException | None = None) -> Future:
        future: Future = Future()
        future.set_exception(error) if error is not None else future.set_result(manifest)
        return future

    manifest = Manifest(
        step=3,
        world_size=1,
        created=1.0,
        files=(FileEntry(name="__0_a.distcp", size=10, crc32=1), FileEntry(name=".metadata", size=4, crc32=2)),
    )
    listed = StepDir(3, resolve("/tmp/unused"), files={"__0_a.distcp": 10, ".metadata": 4, "COMMITTED": 9})
    assert _listed_manifest(listed, read(manifest)) is manifest
    resized = StepDir(3, listed.loc, files={"__0_a.distcp": 11, ".metadata": 4, "COMMITTED": 9})
    missing = StepDir(3, listed.loc, files={".metadata": 4, "COMMITTED": 9})
    assert _listed_manifest(resized, read(manifest)) is None
    assert _listed_manifest(missing, read(manifest)) is None
    assert _listed_manifest(listed, read(None)) is None  # not committed when read
    # Found in review: the step saved and committed again by a newer generation since the
    # early read; the old save's files are still there, and .metadata is as long.
    resaved = StepDir(3, listed.loc, files={**listed.files, "__0_g000002-abcdef0123.distcp": 10})
    assert _listed_manifest(resaved, read(manifest)) is None
    assert _listed_manifest(listed, read(error=OSError("reset"))) is None


def test_a_step_the_driver_chose_that_was_quarantined_since_is_not_restored(tmp_path):
    """The driver's pick read COMMITTED and checked sizes, not QUARANTINED: a commit found
    damaged after the driver chose it (by `ray-goodput verify`, another reader) was loaded
    anyway. The restore falls back to the newest intact one below it."""
    from ray_goodput.checkpoint.protocol._manifest import read_manifest
    from ray_goodput.checkpoint.restore._load import choose

    root = str(tmp_path / "root")
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        for step in (5, 9):
            ckpt.save(step, {"model": torch.nn.Linear(2, 2)})
    loc = _catalog.step_location(resolve(root), 9)
    _catalog.quarantine_damaged(loc, read_manifest(loc), "found damaged by `ray-goodput verify`")
    picked = choose(resolve(root), step=9, before=None, checksums=False)
    assert picked is not None and picked.step == 5, picked


def test_the_step_loaded_when_the_driver_chose_a_damaged_one_is_the_step_pinned_against_retention(tmp_path):
    """The driver pinned the step it chose (9) and every rank fell back from it, damaged, to
    step 5; the pin still named 9, so until this attempt's first commit a dead attempt's
    late retention could prune step 5 while it was being loaded. Rank 0 pins what it loaded."""
    import json

    from ray_goodput.checkpoint.protocol import _lineage
    from ray_goodput.runtime._resume import ResumeDecision, root_key, set_decision

    root = str(tmp_path / "root")
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread", keep_last=5) as ckpt:
        for step in (5, 9):
            ckpt.save(step, {"model": torch.nn.Linear(2, 2)})
    (shard,) = (tmp_path / "root" / _layout.CHECKPOINTS_DIR / _layout.step_dir(9)).glob("__0_*.distcp")
    shard.write_bytes(shard.read_bytes()[:-1])  # damaged: shorter than its manifest says
    _lineage.pin_resume(resolve(root), attempt=2, step=9)  # the driver's pin of its choice
    set_decision(ResumeDecision(attempt=2, step=9, root_key=root_key(root)))
    try:
        with Checkpointer(root, staging_dir=str(tmp_path / "r"), uploader="thread") as ckpt:
            assert ckpt.restore({"model": torch.nn.Linear(2, 2)}) == 5
    finally:
        set_decision(None)
    pin = json.loads((tmp_path / "root" / _layout.CHECKPOINTS_DIR / _layout.RESUME).read_bytes())
    assert pin["step"] == 5, pin
