"""The generation claim (``checkpoint/protocol/_lineage.py``): rank 0 claims it when the
Checkpointer is made, its read goes out beside the storage probe and its write only once
the probe passed, and the first save uses it (or raises the claim's error, once)."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from ray_goodput import Checkpointer, list_checkpoints
from ray_goodput.checkpoint.protocol import _catalog, _layout
from ray_goodput.checkpoint.protocol._manifest import read_manifest
from ray_goodput.errors import StorageError
from ray_goodput.storage import RetryPolicy, resolve
from ray_goodput.testing import FlakyProxy, wait_for


def test_rank0_claims_the_generation_when_the_checkpointer_is_made_and_the_first_save_uses_it(tmp_path):
    root = tmp_path / "root"
    claimed_file = root / _layout.CHECKPOINTS_DIR / _layout.GENERATION
    with Checkpointer(str(root), staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        wait_for(claimed_file.exists, timeout_s=30, what="the generation claim started by the constructor")
        claimed = json.loads(claimed_file.read_text())["generation"]
        assert ckpt.generation is None  # not agreed across ranks yet: that is the first save's
        ckpt.save(1, {"model": torch.nn.Linear(4, 4)})
        assert ckpt.generation == claimed
        ckpt.wait()
    assert json.loads(claimed_file.read_text())["generation"] == claimed  # claimed once, not again
    manifest = read_manifest(_catalog.step_location(resolve(str(root)), 1))
    assert _layout.generation_of(manifest.save_id) == claimed


def test_a_generation_claim_that_failed_in_the_background_fails_the_first_save_with_its_error(tmp_path):
    root = tmp_path / "root"
    (root / _layout.CHECKPOINTS_DIR / _layout.GENERATION).mkdir(parents=True)  # unreadable as a file
    ckpt = Checkpointer(str(root), staging_dir=str(tmp_path / "s"), uploader="thread", retry=RetryPolicy(attempts=1))
    with pytest.raises(StorageError, match="GENERATION"):
        ckpt.save(1, {"model": torch.nn.Linear(4, 4)})
    assert ckpt.stats.saves == 0 and ckpt.generation is None
    # Found in review: the failed background claim was raised again at every save.
    (root / _layout.CHECKPOINTS_DIR / _layout.GENERATION).rmdir()  # storage fixed
    ckpt.save(1, {"model": torch.nn.Linear(4, 4)})
    ckpt.close()
    assert ckpt.generation == 1 and [i.step for i in list_checkpoints(str(root)) if i.committed] == [1]


def test_the_generation_claim_reads_beside_the_storage_probe_and_writes_only_once_it_passed(s3_server, tmp_path):
    """The claim started after the constructor's probe (four requests), so a restore right
    after the constructor waited for the claim's two: its read now goes out with the probe."""
    proxy = FlakyProxy(s3_server.endpoint)
    try:
        uri = s3_server.bucket_uri("run").replace(s3_server.endpoint, proxy.endpoint)
        proxy.stall(".ray_goodput_probe-")  # the probe's read back, held half-way
        made: list = []
        making = threading.Thread(
            target=lambda: made.append(Checkpointer(uri, staging_dir=str(tmp_path / "s"), uploader="thread"))
        )
        making.start()
        wait_for(lambda: proxy.holding("") > 0, timeout_s=30, what="the probe's read back, held")
        wait_for(
            lambda: proxy.count(_layout.GENERATION, ("HEAD", "GET")),
            timeout_s=30,
            what="the claim's read of GENERATION while the probe is held",
        )
        proxy.release()
        making.join(60)
        assert made, "the Checkpointer was not made"
        with made[0] as ckpt:
            ckpt.save(1, {"model": torch.nn.Linear(4, 4)})
            assert ckpt.generation == 1
        arrivals = list(proxy.arrivals)
        probe_deleted = [t for t, m, p in arrivals if m == "DELETE" and ".ray_goodput_probe-" in p]
        claimed = [t for t, m, p in arrivals if m == "PUT" and p.endswith(_layout.GENERATION)]
        assert probe_deleted and claimed and min(claimed) > max(probe_deleted)  # written once the probe passed
    finally:
        proxy.close()


def test_an_early_claim_abandoned_because_the_probe_failed_writes_nothing(tmp_path):
    from ray_goodput.checkpoint.protocol._lineage import EarlyClaim

    root = resolve(str(tmp_path / "root"))
    claim = EarlyClaim(root, RetryPolicy(attempts=1))
    claim.abandon()
    with pytest.raises(StorageError, match="was not made"):
        claim.result()
    assert not (tmp_path / "root" / _layout.CHECKPOINTS_DIR / _layout.GENERATION).exists()


def test_a_lost_or_damaged_generation_record_still_counts_the_generations_that_saved(tmp_path):
    """The fence counts every generation that saved (its SAVING- marker), but a claim
    without a readable GENERATION counted only the commits' generations: with those pruned
    or never made, the next run claimed a generation below one that had saved, and every
    save it made was fenced."""
    from ray_goodput.checkpoint.protocol import _lineage

    root = resolve(str(tmp_path / "root"))
    checkpoints = tmp_path / "root" / _layout.CHECKPOINTS_DIR
    checkpoints.mkdir(parents=True)
    (checkpoints / _layout.saving_marker(3)).touch()
    (checkpoints / _layout.claim_record(4)).write_text("{}")  # a claim that never saved
    assert _lineage.claimed_generation(root) == 4  # GENERATION lost
    (checkpoints / _layout.GENERATION).write_text("not json")
    assert _lineage.claimed_generation(root) == 4  # GENERATION damaged
    assert _lineage.next_generation(root, None) == 5
