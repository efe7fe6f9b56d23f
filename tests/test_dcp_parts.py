"""A rank's DCP files (``checkpoint/protocol/_dcp_parts.py``): written without torch.save's
zip CRC32 (the manifest's CRC32C covers them; the process-wide setting is put back, also
across concurrent writers and errors), small leaves first."""

from __future__ import annotations

import pytest
import torch

from ray_goodput.checkpoint.protocol._dcp_parts import write_part


def test_the_uploaders_dcp_write_skips_torch_saves_zip_crc32_and_puts_the_setting_back(tmp_path):
    """``torch.save`` (DCP writes each tensor with it) computes a CRC32 of every zip record
    at ~0.25 GB/s: 2.05 s of a 512 MiB write that takes 0.44 s without it, here. The
    manifest's CRC32C already covers every file, so the uploader's write skips it; the
    process-wide setting is put back for the user's own saves."""
    import io
    import pickle
    import zipfile

    from torch.utils.serialization import config

    from ray_goodput.checkpoint.protocol._dcp_parts import data_file, part_file

    assert config.save.compute_crc32
    names = write_part({"w": torch.randn(64, 64), "b": torch.arange(7)}, {}, {}, 0, "n1", tmp_path)
    assert names == [data_file(0, "n1"), part_file(0, "n1")]
    assert config.save.compute_crc32  # put back
    meta = pickle.loads((tmp_path / part_file(0, "n1")).read_bytes())
    data = (tmp_path / data_file(0, "n1")).read_bytes()
    crcs = []
    for info in meta.storage_data.values():
        record = zipfile.ZipFile(io.BytesIO(data[info.offset : info.offset + info.length]))
        crcs += [entry.CRC for entry in record.infolist()]
    assert crcs and set(crcs) == {0}, crcs


def test_small_leaves_are_written_first_so_a_peer_checks_one_block_for_them(tmp_path):
    """Optimizer step counters between large moments used to sit in a block each: a rank
    that read them from a peer's file checked three 8 MiB blocks for three scalars."""
    import pickle

    from ray_goodput.checkpoint.protocol._dcp_parts import part_file
    from ray_goodput.storage import BLOCK_BYTES

    flat = {}
    for i in range(3):
        flat[f"m{i}"] = torch.zeros(BLOCK_BYTES // 4)  # one block each
        flat[f"step{i}"] = torch.tensor(float(i))
    write_part(flat, {}, {}, 0, "n1", tmp_path)
    meta = pickle.loads((tmp_path / part_file(0, "n1")).read_bytes())
    offsets = {index.fqn: info.offset for index, info in meta.storage_data.items()}
    assert {offsets[f"step{i}"] // BLOCK_BYTES for i in range(3)} == {0}, offsets
    assert offsets["m0"] < offsets["m1"] < offsets["m2"], offsets  # large ones keep their order


def test_the_zip_crc32_switch_is_counted_across_concurrent_writers_and_put_back_after_an_error():
    from torch.utils.serialization import config

    from ray_goodput.checkpoint.protocol._dcp_parts import _without_zip_crc32

    first, second = _without_zip_crc32(), _without_zip_crc32()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not config.save.compute_crc32  # the second writer is still writing
    second.__exit__(None, None, None)
    assert config.save.compute_crc32
    with pytest.raises(OSError), _without_zip_crc32():
        raise OSError("disk full")
    assert config.save.compute_crc32


def test_staging_a_job_again_never_rewrites_in_place_a_file_storage_holds_as_a_hard_link(tmp_path):
    """On local storage a staged file becomes the stored one as a hard link (one inode).
    A job run again (taken again after its uploader died) rewrote its metadata part and
    extras in place: a kill mid-write left the committed checkpoint's own files cut short,
    and it was then quarantined. Staged files are now written aside and renamed."""
    import dataclasses
    import os
    import pickle

    from ray_goodput.checkpoint.uploader._shard_job import write_local
    from tests.test_uploader import _job

    job = dataclasses.replace(_job(tmp_path, tmp_path / "none.arena", slots=()), objects={"x": pickle.dumps(7)})
    names = write_local(job)
    stored = tmp_path / "stored"
    stored.mkdir()
    staged = tmp_path / "local"
    for name in names:
        os.link(staged / name, stored / name.replace("/", "_"))  # as _link_up does
    before = {name: (stored / name.replace("/", "_")).read_bytes() for name in names}
    write_local(job)  # the same job again
    for name in names:
        linked = stored / name.replace("/", "_")
        assert os.stat(linked).st_ino != os.stat(staged / name).st_ino, f"{name} rewritten in place"
        assert linked.read_bytes() == before[name]
