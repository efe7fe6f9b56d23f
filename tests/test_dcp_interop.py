"""Interop with stock PyTorch: a committed ray_goodput checkpoint is a DCP checkpoint that
stock DCP reads; the pyarrow.fs DCP storage plugins over S3 (HTTP, 2 ranks, sync and
async save); export to a single torch.save file (function and CLI handler)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ray_goodput import CheckpointCorruptError, Checkpointer, ConfigError, list_checkpoints
from ray_goodput.checkpoint.protocol._dcp_storage import PyArrowStorageReader, PyArrowStorageWriter
from ray_goodput.checkpoint.restore._export import export_torch_save
from ray_goodput.cli import main as cli_main
from ray_goodput.storage import resolve
from ray_goodput.testing import run_world
from tests._models import full_state, make_model, train_steps, wrap


def _checkpointer_saves(rank: int, world: int, local: str, s3: str) -> dict:
    """FSDP2 state saved by ray_goodput: steps 1 and 2 on ``local``, step 2 on ``s3``.
    Returns the full state of step 2."""
    model = wrap(make_model(0), "fsdp")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim, "note": "plain value"}
    with Checkpointer(local, staging_dir=f"{local}-stage") as ckpt:
        for step in (1, 2):
            train_steps(model, optim, 1, rank, start=step)
            ckpt.save(step, state)
            ckpt.wait()  # step 1 is exported: step 2 must not supersede it in the lane
    with Checkpointer(s3, staging_dir=f"{local}-stage") as ckpt:
        ckpt.save(2, state)
    return full_state(model, optim)


def _plugin_round_trip(rank: int, world: int, sync_uri: str, async_uri: str, ours_uri: str) -> dict:
    """dcp.save / dcp.async_save through PyArrowStorageWriter, dcp.load through the reader."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = wrap(make_model(0), "fsdp")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, optim, 2, rank)
    dcp.save({"model": get_model_state_dict(model)}, storage_writer=PyArrowStorageWriter(sync_uri))
    # Its own process group, as DCP advises: the save's collectives run in a background
    # thread while training's run on the default group, and two threads sharing one gloo
    # group can interleave their collectives differently on each rank (this hung).
    async_group = dist.new_group(backend="gloo")
    future = dcp.async_save(
        {"model": get_model_state_dict(model)},
        storage_writer=PyArrowStorageWriter(async_uri),
        process_group=async_group,
    )
    train_steps(model, optim, 1, rank, start=2)  # mutating after async_save returned must not leak in
    future.result(timeout=120)
    loaded = {}
    for name, uri in (("sync", sync_uri), ("async", async_uri), ("ours", ours_uri)):
        fresh = wrap(make_model(7), "fsdp")
        sd = {"model": get_model_state_dict(fresh)}
        dcp.load(sd, storage_reader=PyArrowStorageReader(uri))
        loaded[name] = {k: v.full_tensor().clone() for k, v in sd["model"].items()}
    return loaded


@pytest.fixture(scope="module")
def saved(tmp_path_factory, s3_server):
    local = str(tmp_path_factory.mktemp("interop") / "run")
    s3 = s3_server.bucket_uri("run")
    return {"local": local, "s3": s3, "state": run_world(_checkpointer_saves, 2, local, s3)[0]}


def _step_dir(root: str, step: int) -> str:
    (info,) = [i for i in list_checkpoints(root) if i.step == step and i.committed]
    return info.uri


def _assert_model_equal(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    for k in expected:
        assert torch.equal(expected[k], got[k]), k


def test_stock_dcp_load_reads_committed_checkpoint(saved):
    model = make_model(5)  # other weights: the load must overwrite every tensor
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=_step_dir(saved["local"], 2))
    _assert_model_equal(saved["state"]["model"], state["model"])


def test_stock_dcp_to_torch_save_converts_committed_checkpoint(saved, tmp_path):
    dcp_to_torch_save(_step_dir(saved["local"], 2), tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    _assert_model_equal(saved["state"]["model"], out["model"])
    assert set(out["optim"]["state"]) == set(saved["state"]["optim"])


def test_stock_fsspec_reader_reads_committed_checkpoint(saved):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    state = {"model": make_model(5).state_dict()}
    dcp.load(state, storage_reader=FsspecReader(f"file://{_step_dir(saved['local'], 2)}"))
    _assert_model_equal(saved["state"]["model"], state["model"])


def test_plugins_save_async_save_and_load_on_s3_with_two_ranks(saved, s3_server):
    sync_uri, async_uri = s3_server.bucket_uri("sync"), s3_server.bucket_uri("async")
    ours = resolve(saved["s3"]).child("checkpoints", "step-000000002").uri
    loaded = run_world(_plugin_round_trip, 2, sync_uri, async_uri, ours)
    for rank_view in loaded:
        _assert_model_equal(rank_view["sync"], rank_view["async"])  # async saved the pre-mutation state
        _assert_model_equal(saved["state"]["model"], rank_view["ours"])
    assert not torch.equal(loaded[0]["sync"]["0.weight"], saved["state"]["model"]["0.weight"])
    loc = resolve(sync_uri)
    assert loc.fs.get_file_info(loc.join(".metadata")).size > 0


def test_export_writes_model_only_by_default(saved, tmp_path):
    for root in (saved["local"], saved["s3"]):
        out = export_torch_save(root, None, tmp_path / "model.pt")
        state = torch.load(out, weights_only=True)
        assert set(state) == {"model"}
        _assert_model_equal(saved["state"]["model"], state["model"])


def test_export_optim_includes_fqn_keyed_optimizer(saved, tmp_path):
    out = export_torch_save(saved["s3"], 2, tmp_path / "full.pt", optim=True)
    state = torch.load(out, weights_only=True)
    assert set(state) == {"model", "optim"} and state["optim"]["param_groups"]
    for fqn, expected in saved["state"]["optim"].items():
        assert torch.equal(state["optim"]["state"][fqn]["exp_avg"], expected["exp_avg"]), fqn


def test_export_older_step_differs_from_newest(saved, tmp_path):
    old = torch.load(export_torch_save(saved["local"], 1, tmp_path / "s1.pt"), weights_only=True)
    assert not torch.equal(old["model"]["0.weight"], saved["state"]["model"]["0.weight"])


def test_export_missing_step_names_ls_command(saved, tmp_path):
    with pytest.raises(ConfigError, match="ray-goodput ls"):
        export_torch_save(saved["local"], 99, tmp_path / "x.pt")
    with pytest.raises(ConfigError, match="no committed checkpoint"):
        export_torch_save(str(tmp_path / "empty"), None, tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()


def test_export_command(saved, tmp_path, capsys):
    assert cli_main(["export", saved["s3"], str(tmp_path / "m.pt"), "--step", "2", "--optim"]) == 0
    assert "keys ['model', 'optim']" in capsys.readouterr().out
    _assert_model_equal(saved["state"]["model"], torch.load(tmp_path / "m.pt", weights_only=True)["model"])


def test_plugin_rejects_empty_uri():
    with pytest.raises(ConfigError, match="storage_path"):
        PyArrowStorageWriter("")
    with pytest.raises(ConfigError):
        PyArrowStorageReader("   ")


def test_export_of_a_save_before_the_first_step_has_no_made_up_optimizer_state(tmp_path):
    """The library's own keys leaked into the export, and with --optim it held the state DCP
    makes up to save a never-stepped optimizer (step 1, zero moments)."""
    root = str(tmp_path / "root")
    model = make_model(0)
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.save(0, {"model": model, "optim": torch.optim.AdamW(model.parameters())})
    assert set(torch.load(export_torch_save(root, 0, tmp_path / "m.pt"), weights_only=True)) == {"model"}
    full = torch.load(export_torch_save(root, 0, tmp_path / "f.pt", optim=True), weights_only=True)
    assert set(full) == {"model", "optim"} and full["optim"]["state"] == {} and full["optim"]["param_groups"]


def test_a_writer_with_more_threads_is_refused_since_dcp_drops_their_errors(tmp_path):
    """DCP's extra writer threads drop their exceptions: dcp.save returned and wrote
    .metadata naming a file whose upload had failed."""
    with pytest.raises(ConfigError, match="thread_count=1"):
        PyArrowStorageWriter(str(tmp_path / "ckpt"), thread_count=2)


def _filled(value: float) -> torch.nn.Module:
    m = torch.nn.Linear(2, 2)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(value)
    return m


def test_export_of_the_newest_takes_the_lineages_newest_not_a_dead_attempts_late_higher_step(tmp_path):
    """Attempt 1 (generation 1) committed step 10; attempt 2 (generation 2) resumed and
    committed step 15; attempt 1's uploader then committed step 30 late. A restore takes
    step 15; the export of "the newest" wrote the dead attempt's step 30."""
    root = str(tmp_path / "root")
    dead = Checkpointer(root, staging_dir=str(tmp_path / "s1"), uploader="thread", keep_last=5)
    dead.save(10, {"model": _filled(10.0)})
    dead.wait()
    live = Checkpointer(root, staging_dir=str(tmp_path / "s2"), uploader="thread", keep_last=5)
    live.save(15, {"model": _filled(15.0)})
    live.wait()
    dead.save(30, {"model": _filled(30.0)})  # late: its generation was claimed past
    with contextlib.suppress(Exception):
        dead.wait()
    dead._release()
    live._release()
    state = torch.load(export_torch_save(root, None, tmp_path / "newest.pt"), weights_only=True)
    assert torch.equal(state["model"]["weight"], torch.full((2, 2), 15.0))


def test_export_refuses_a_checkpoint_whose_bytes_do_not_match_their_checksums(tmp_path):
    """Data files carry no checksum of their own: a flipped byte of the same size was
    exported silently, where a restore quarantines the checkpoint."""
    root = str(tmp_path / "root")
    with Checkpointer(root, staging_dir=str(tmp_path / "s"), uploader="thread") as ckpt:
        ckpt.save(3, {"model": _filled(1.0)})
    (shard,) = (tmp_path / "root/checkpoints/step-000000003").glob("__0_*.distcp")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        export_torch_save(root, 3, tmp_path / "x.pt")
    with pytest.raises(ConfigError, match="no intact committed checkpoint"):  # the newest: none is intact
        export_torch_save(root, None, tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()
