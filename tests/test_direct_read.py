"""Restore reads whole tensors straight into the live state (``checkpoint/restore/_direct_read.py``),
and leaves everything else to DCP's own read, with the same result."""

from __future__ import annotations

import io
import os
from typing import Any

import pytest
import torch
from torch import nn

from ray_goodput import Checkpointer
from ray_goodput.checkpoint.restore import _direct_read


class _Mixed(nn.Module):
    """fp32 and bf16 parameters, an int64 buffer and a 0-dim buffer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(16, 8)
        self.low = nn.Parameter(torch.randn(5, 3).to(torch.bfloat16))
        self.register_buffer("ids", torch.randint(0, 1000, (7,)))
        self.register_buffer("scale", torch.tensor(float(seed)))


def _state(seed: int) -> dict:
    model = _Mixed(seed)
    optim = torch.optim.AdamW([model.lin.weight, model.lin.bias], lr=0.1)
    model.lin(torch.randn(4, 16)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim}


def _tensors(state: dict) -> dict:
    out = {f"model.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, s in enumerate(state["optim"].state.values()):
        out.update({f"optim.{i}.{k}": v.clone() for k, v in s.items()})
    return out


def test_restore_reads_whole_tensors_straight_into_the_live_state_from_storage_and_the_local_copy(tmp_path):
    root, saved = str(tmp_path / "root"), _state(1)
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.save(3, saved)
    expected = _tensors(saved)
    for staging, local in ((tmp_path / "cold", False), (tmp_path / "s", True)):
        fresh = _state(2)
        with Checkpointer(root, staging_dir=str(staging), uploader="thread") as ckpt:
            assert ckpt.restore(fresh) == 3
            info = ckpt.last_restore
        assert (info.local_files > 0) == local and (info.remote_files > 0) != local
        got = _tensors(fresh)
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
        # Every model tensor and optimizer state tensor was read directly; only DCP's
        # byte items (param groups) are left to it.
        assert info.direct_tensors == len(expected), (info, len(expected))


def test_a_non_contiguous_live_tensor_is_left_to_dcp_and_still_restored(tmp_path):
    root, saved = str(tmp_path / "root"), _state(1)
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.save(1, saved)
    fresh = _state(2)
    fresh["model"].low = nn.Parameter(torch.zeros(3, 5, dtype=torch.bfloat16).t())  # a transposed view
    assert not fresh["model"].low.is_contiguous()
    with Checkpointer(root, staging_dir=str(tmp_path / "cold"), uploader="thread") as ckpt:
        assert ckpt.restore(fresh) == 1
        direct = ckpt.last_restore.direct_tensors
    assert torch.equal(fresh["model"].low, saved["model"].low)
    with Checkpointer(root, staging_dir=str(tmp_path / "cold2"), uploader="thread") as ckpt:
        assert ckpt.restore(_state(3)) == 1
        assert ckpt.last_restore.direct_tensors == direct + 1  # the one DCP took above


def _record(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.float64).reshape(3, 4),
        torch.randn(4, 2).to(torch.bfloat16),
        torch.tensor(7),
        torch.empty(0, 3),
    ],
    ids=["f64", "bf16", "0-dim", "empty"],
)
def test_a_whole_contiguous_record_is_located_byte_for_byte(tensor):
    pad = b"x" * 100  # records sit at offsets inside a DCP data file
    data = pad + _record(tensor) + pad
    record = _direct_read.parse_record(lambda at, n: data[at : at + n], len(pad), len(data) - 2 * len(pad))
    assert (record.dtype, record.size, record.nbytes) == (tensor.dtype, tuple(tensor.shape), tensor.nbytes)
    target = torch.empty_like(tensor)
    _direct_read.fill_from_buffer(target, data, record.data_offset, record.nbytes)
    assert torch.equal(target, tensor)


@pytest.mark.parametrize(
    "tensor",
    [torch.arange(12.0).reshape(3, 4).t(), torch.arange(12.0).reshape(3, 4)[:, 1:], torch.arange(12.0)[4:]],
    ids=["transposed", "column-slice", "offset"],
)
def test_a_record_that_is_not_a_whole_contiguous_storage_is_left_to_dcp(tensor):
    data = _record(tensor)
    with pytest.raises(_direct_read.Unparsable):
        _direct_read.parse_record(lambda at, n: data[at : at + n], 0, len(data))


@pytest.mark.parametrize(
    "make",
    [lambda: torch.tensor([1 + 2j, 3 + 4j]).conj(), lambda: torch._neg_view(torch.arange(4.0))],
    ids=["conj", "neg"],
)
def test_a_record_whose_bytes_need_a_conj_or_neg_bit_to_read_right_is_left_to_dcp(make):
    """torch.save stores such a tensor as its raw storage plus the bit in the rebuild's
    metadata: copying the raw bytes would write the wrong values."""
    data = _record(make())
    with pytest.raises(_direct_read.Unparsable):
        _direct_read.parse_record(lambda at, n: data[at : at + n], 0, len(data))


def test_restore_into_a_view_inside_a_larger_tensor_writes_only_the_view(tmp_path):
    class Window:
        """A Stateful whose tensor is a view at an offset into a larger buffer."""

        def __init__(self, base: torch.Tensor) -> None:
            self.base = base

        def state_dict(self) -> dict:
            return {"w": self.base[4:16].view(3, 4)}

        def load_state_dict(self, sd: dict) -> None:
            assert sd["w"].data_ptr() == self.base[4:16].data_ptr()  # loaded in place

    root = str(tmp_path / "root")
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.save(1, {"window": Window(torch.arange(20.0))})
    base = torch.full((20,), -1.0)
    with Checkpointer(root, staging_dir=str(tmp_path / "cold"), uploader="thread") as ckpt:
        assert ckpt.restore({"window": Window(base)}) == 1
        assert ckpt.last_restore.direct_tensors == 1
    assert torch.equal(base[4:16], torch.arange(4.0, 16.0))
    assert torch.equal(base[:4], torch.full((4,), -1.0)) and torch.equal(base[16:], torch.full((4,), -1.0))


def test_a_record_that_is_not_a_zip_is_left_to_dcp():
    data = b"\0" * 64
    with pytest.raises(_direct_read.Unparsable):
        _direct_read.parse_record(lambda at, n: data[at : at + n], 0, len(data))


# ---- another rank's data file: streamed past its checksum, only the needed ranges kept ----


def _fsdp_state(world: int, seed: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(3)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters())
    for _ in range(seed + 1):  # the step counters differ too
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.1)
        optim.step()
    return {"model": model, "optim": optim}


def _full(state: dict) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(state["model"], state["optim"], options=StateDictOptions(full_state_dict=True))
    return {"model": msd, "optim": osd["state"]}


def _save_fsdp(world: int, root: str, staging: str) -> tuple[dict, Any]:
    """Save the seed-0 FSDP2 state at step 1; returns its full state and the step directory."""
    from pathlib import Path

    import torch.distributed as dist

    from ray_goodput.checkpoint.protocol import _layout

    saved = _fsdp_state(world, 0)
    with Checkpointer(root, staging_dir=f"{staging}/saved", uploader="thread") as ckpt:
        ckpt.save(1, saved)
    dist.barrier()
    return _full(saved), Path(root) / "checkpoints" / _layout.step_dir(1)


def _equal_full(state: dict, expected: dict) -> bool:
    got = _full(state)
    same = all(torch.equal(got["model"][k], v) for k, v in expected["model"].items())
    return same and all(torch.equal(got["optim"][k][s], v) for k, d in expected["optim"].items() for s, v in d.items())


def _restore_from_parts(rank: int, world: int, root: str, staging: str, damage: str | None) -> dict:
    from pathlib import Path

    import torch.distributed as dist

    from ray_goodput.checkpoint.restore import _storage_fetch
    from ray_goodput.checkpoint.restore._reader import wait_for_node_local_copies

    expected, step_dir = _save_fsdp(world, root, staging)
    mine = next(p.name for p in step_dir.iterdir() if p.name.startswith(f"__{rank}_"))
    other = next(p.name for p in step_dir.iterdir() if p.name.startswith(f"__{1 - rank}_"))
    if damage is not None and rank == 0:  # one byte of rank 1's file that nobody loads
        path = step_dir / other
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    dist.barrier()
    _storage_fetch.SPARSE_MIN_BYTES = 0  # this test's files are small; the rule is the same
    fresh = _fsdp_state(world, 1)
    cold = Path(staging) / f"cold-{rank}"
    with Checkpointer(root, staging_dir=str(cold), uploader="thread") as ckpt:
        restored = ckpt.restore(fresh)
    assert wait_for_node_local_copies(30)
    kept = {p.name for p in cold.rglob("*.distcp")}
    return {
        "restored": restored,
        "same": _equal_full(fresh, expected),
        "kept_mine": mine in kept,
        "kept_other": other in kept,
    }


def test_another_ranks_file_is_checked_whole_but_only_its_needed_ranges_are_kept(tmp_path):
    """Each FSDP2 rank needs a few replicated records (the optimizer steps) from the other
    rank's data file: that file is checked whole (on local storage: mapped, checked in the
    page cache), and it is neither held whole nor written to this rank's staging disk.
    (Object storage: the next test but one.)"""
    from ray_goodput.testing import run_world

    for rank_result in run_world(_restore_from_parts, 2, str(tmp_path / "root"), str(tmp_path / "st"), None):
        assert rank_result == {"restored": 1, "same": True, "kept_mine": True, "kept_other": False}, rank_result


def test_a_damaged_byte_outside_the_needed_ranges_still_rejects_the_checkpoint(tmp_path):
    """The kept ranges are not all that is checked: the whole file is. Damage where no
    rank loads anything still makes the checkpoint damaged (quarantined; with no older
    one, every rank starts fresh with its state untouched)."""
    from ray_goodput.testing import run_world

    results = run_world(_restore_from_parts, 2, str(tmp_path / "root"), str(tmp_path / "st"), "flip")
    assert [(r["restored"], r["same"]) for r in results] == [(None, False), (None, False)], results
    assert (tmp_path / "root" / "checkpoints" / "step-000000001" / "QUARANTINED").exists()


def test_a_file_without_block_checksums_streams_past_its_check_keeping_only_the_needed_ranges(
    tmp_path, s3_server, monkeypatch
):
    """A manifest written before block checksums: another rank's file on object storage
    is streamed past its whole-file checksum and only the needed ranges are kept; damage
    outside them still rejects it."""
    from ray_goodput.checkpoint.restore import _storage_fetch
    from ray_goodput.checkpoint.restore._reader import _TieredFs
    from ray_goodput.errors import CheckpointCorruptError
    from ray_goodput.storage import CRC32C, FileEntry, RetryPolicy, checksum, resolve, write_bytes

    monkeypatch.setattr(_storage_fetch, "SPARSE_MIN_BYTES", 0)  # small files; the rule is the same
    store = resolve(s3_server.bucket_uri("sparse"))
    data = os.urandom(10 * 4096)
    entry = FileEntry("f.distcp", len(data), checksum(data, CRC32C), CRC32C)  # no blocks
    write_bytes(store, "f.distcp", data)
    fs = _TieredFs(store, tmp_path / "local", set(), {"f.distcp": entry}, RetryPolicy())
    fs.prepare("f.distcp", [(4096 + 10, 100)])
    assert fs.sparse["f.distcp"].kept_bytes == 100 and "f.distcp" not in fs.held and fs.remote_bytes == len(data)
    assert bytes(fs.sparse["f.distcp"].read_at(4096 + 10, 100)) == data[4096 + 10 : 4096 + 110]
    fs.release()
    write_bytes(store, "f.distcp", data[:9000] + bytes([data[9000] ^ 1]) + data[9001:])  # not in the range
    with pytest.raises(CheckpointCorruptError, match="manifest says"):
        _TieredFs(store, tmp_path / "local2", set(), {"f.distcp": entry}, RetryPolicy()).prepare(
            "f.distcp", [(4096 + 10, 100)]
        )


def _restore_reading_blocks(rank: int, world: int, root: str, staging: str) -> dict:
    from ray_goodput.checkpoint.protocol import _layout
    from ray_goodput.storage import _checksum

    _checksum.BLOCK_BYTES = 16 << 10  # this test's files are small; the rule is the same
    expected, step_dir = _save_fsdp(world, root, staging)
    sizes = {p.name: p.stat().st_size for p in step_dir.iterdir()}
    mine = next(n for n in sizes if n.startswith(f"__{rank}_"))
    other = next(n for n in sizes if n.startswith(f"__{1 - rank}_"))
    fresh = _fsdp_state(world, 1)
    with Checkpointer(root, staging_dir=f"{staging}/cold-{rank}", uploader="thread") as ckpt:
        restored = ckpt.restore(fresh)
        read = ckpt.last_restore.remote_bytes
    return {
        "restored": restored,
        "same": _equal_full(fresh, expected),
        "read": read,
        "mine": sizes[mine],
        "other": sizes[other],
        "metadata": sizes[_layout.DCP_METADATA],
    }


def test_another_ranks_file_is_read_only_in_the_blocks_that_hold_what_this_rank_needs(tmp_path):
    """O(own shard) per rank: the other rank's data file is read (and checked) only in the
    blocks of its manifest entry that hold this rank's few replicated records, not whole:
    at world size W every rank used to read every file, W x the checkpoint in all."""
    from ray_goodput.testing import run_world

    for r in run_world(_restore_reading_blocks, 2, str(tmp_path / "root"), str(tmp_path / "st")):
        assert r["restored"] == 1 and r["same"], r
        assert r["other"] > 8 * (16 << 10), r  # many blocks, of which a few are needed
        assert r["mine"] + r["metadata"] <= r["read"] <= r["mine"] + r["metadata"] + r["other"] // 2, r


def _entry_with_blocks(path, block):
    from ray_goodput.storage import CRC32C, FileEntry, file_crc32

    blocks: list[int] = []
    size, crc = file_crc32(path, CRC32C, blocks=blocks, block_bytes=block)
    return FileEntry(path.name, size, crc, CRC32C, block_bytes=block, blocks=tuple(blocks))


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """Where the checkpoint files are: a local directory (files mapped) or S3 (read)."""
    from ray_goodput.storage import resolve

    if request.param == "local":
        (tmp_path / "store").mkdir()
        return resolve(str(tmp_path / "store"))
    return resolve(request.getfixturevalue("s3_server").bucket_uri(f"blocks-{request.node.originalname}"))


def _put_with_entry(store, tmp_path, data: bytes, block: int, damaged: bytes | None = None):
    """Store ``damaged`` (or ``data``) as f.distcp under the manifest entry of ``data``."""
    from ray_goodput.storage import write_bytes

    (tmp_path / "f.distcp").write_bytes(data)
    entry = _entry_with_blocks(tmp_path / "f.distcp", block)
    write_bytes(store, "f.distcp", damaged if damaged is not None else data)
    return entry


def _kept(fs, name: str):
    """What the reader keeps of ``name`` to read ranges from: its mapping or its blocks."""
    return fs.mapped.get(name) or fs.sparse[name]


def test_a_damaged_block_fails_the_read_of_a_range_in_it_and_other_blocks_still_read(tmp_path, store):
    from ray_goodput.checkpoint.restore._reader import _TieredFs
    from ray_goodput.errors import CheckpointCorruptError
    from ray_goodput.storage import RetryPolicy

    data = bytearray(os.urandom(10 * 4096))
    damaged = bytearray(data)
    damaged[5 * 4096 + 7] ^= 0x01  # block 5 damaged after the manifest was written
    entry = _put_with_entry(store, tmp_path, bytes(data), 4096, bytes(damaged))

    def fs() -> _TieredFs:
        return _TieredFs(store, tmp_path / "local", set(), {"f.distcp": entry}, RetryPolicy())

    good = fs()
    good.prepare("f.distcp", [(4096 + 10, 100), (8 * 4096, 4096)])  # blocks 1 and 8
    assert good.remote_bytes == 2 * 4096
    assert ("f.distcp" in good.mapped) is store.is_local
    assert bytes(_kept(good, "f.distcp").read_at(4096 + 10, 100)) == bytes(data[4096 + 10 : 4096 + 110])
    with pytest.raises(CheckpointCorruptError, match="block 5"):
        fs().prepare("f.distcp", [(5 * 4096 + 100, 10)])
    good.release()


def test_another_ranks_node_local_file_is_checked_only_in_the_needed_blocks(tmp_path):
    """The node-local copy of another rank's file is checked only in the blocks this rank
    reads (a rank on an 8-GPU node used to checksum all 8 files); a needed block that is
    damaged there comes from storage instead."""
    from ray_goodput.checkpoint.restore._reader import _TieredFs
    from ray_goodput.storage import RetryPolicy, resolve

    store, local = tmp_path / "store", tmp_path / "local"
    store.mkdir()
    local.mkdir()
    data = bytearray(os.urandom(10 * 4096))
    (store / "f.distcp").write_bytes(data)
    entry = _entry_with_blocks(store / "f.distcp", 4096)
    data[5 * 4096 + 7] ^= 0x01  # the node-local copy is damaged in block 5 only
    (local / "f.distcp").write_bytes(data)

    def fs() -> _TieredFs:
        return _TieredFs(resolve(str(store)), local, {"f.distcp"}, {"f.distcp": entry}, RetryPolicy(), verified=False)

    fine = fs()
    fine.prepare("f.distcp", [(4096 + 10, 100)])
    assert (fine.local_reads, fine.remote_reads, fine.checked_blocks["f.distcp"]) == (1, 0, {1})
    damaged = fs()
    damaged.prepare("f.distcp", [(5 * 4096 + 100, 10)])
    assert (damaged.local_reads, damaged.remote_reads, damaged.remote_bytes) == (0, 1, 4096)
    assert (
        bytes(_kept(damaged, "f.distcp").read_at(5 * 4096 + 100, 10))
        == (store / "f.distcp").read_bytes()[5 * 4096 + 100 : 5 * 4096 + 110]
    )
    fine.release()
    damaged.release()


def test_a_file_cut_short_inside_a_needed_block_is_a_damaged_checkpoint_not_a_read_error(tmp_path, store):
    """Found in review: a ranged read past the end of a truncated file raised pyarrow's
    ArrowIndexError (or, on S3, a retried IOError), which restore took for a failure of
    its own instead of a damaged checkpoint to fall back from."""
    from ray_goodput.checkpoint.restore._reader import _TieredFs
    from ray_goodput.errors import CheckpointCorruptError
    from ray_goodput.storage import RetryPolicy

    data = os.urandom(10 * 4096)
    entry = _put_with_entry(store, tmp_path, data, 4096, data[: 8 * 4096 + 100])  # cut inside block 8
    for ranges in ([(8 * 4096, 200)], [(9 * 4096 + 1, 10)]):  # into block 8; wholly past the end
        fs = _TieredFs(store, tmp_path / "local", set(), {"f.distcp": entry}, RetryPolicy(attempts=1))
        with pytest.raises(CheckpointCorruptError, match="bytes"):
            fs.prepare("f.distcp", ranges)


def test_block_reads_count_against_the_hold_budget_and_give_it_back(tmp_path, s3_server):
    """Found in review: the blocks kept for DCP were not charged to ``hold_bytes``, so a
    reshard of large shards could hold far more than the budget in memory. (Object
    storage: a file of local storage is mapped, and holds no memory of the budget.)"""
    from ray_goodput.checkpoint.restore._reader import _TieredFs
    from ray_goodput.storage import RetryPolicy, resolve

    store = resolve(s3_server.bucket_uri("budget-blocks"))
    entry = _put_with_entry(store, tmp_path, os.urandom(10 * 4096), 4096)
    fs = _TieredFs(store, tmp_path / "local", set(), {"f.distcp": entry}, RetryPolicy(), hold_bytes=3 * 4096)
    fs.prepare("f.distcp", [(0, 10), (2 * 4096, 10)])  # blocks 0 and 2: within the budget
    assert fs.hold_left == 4096 and "f.distcp" in fs.sparse
    fs.release()
    assert fs.hold_left == 3 * 4096
    fs.prepare("f.distcp", [(0, 10), (2 * 4096, 10), (4 * 4096, 10), (6 * 4096, 10)])  # over it
    assert fs.hold_left == 3 * 4096 and "f.distcp" not in fs.sparse  # another path took it
