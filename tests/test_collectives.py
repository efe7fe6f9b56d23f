"""The checkpoint collectives (``checkpoint/protocol/_collective.py``) between real gloo
ranks: save() makes none while the state's structure is unchanged, a restore makes three
and DCP none, and ranks that reach different collectives raise instead of misreading or
hanging."""

from __future__ import annotations

import torch

from ray_goodput import Checkpointer
from ray_goodput.checkpoint.protocol import _catalog, _collective
from ray_goodput.checkpoint.protocol._manifest import read_manifest
from ray_goodput.errors import CheckpointError
from ray_goodput.storage import resolve
from ray_goodput.testing import run_world


def _count_gathers(rank: int, world_size: int, root: str, staging: str) -> dict:
    calls = {"n": 0}
    real = _collective.all_gather

    def counting(obj):
        calls["n"] += 1
        return real(obj)

    _collective.all_gather = counting  # counts, still the real collective
    model = torch.nn.Linear(16, 16)
    per_save = []
    with Checkpointer(root, staging_dir=f"{staging}/{rank}", uploader="thread", sync_every=100) as ckpt:
        ckpt.save(1, {"model": model})  # first save: generation claim and owner plan
        ckpt.wait()
        for step in (2, 3, 4):
            before = calls["n"]
            ckpt.save(step, {"model": model})
            per_save.append(calls["n"] - before)
        ckpt.wait()
        grown = {"model": model, "extra": torch.nn.Linear(4, 4)}  # every rank, same save
        before = calls["n"]
        ckpt.save(5, grown)
        replanned = calls["n"] - before
        ckpt.wait()
        committed = list(ckpt.stats.committed)
        superseded = list(ckpt.stats.superseded)
    return {"per_save": per_save, "replanned": replanned, "committed": committed, "superseded": superseded}


def test_save_makes_no_collective_while_the_state_structure_is_unchanged(tmp_path):
    out = run_world(_count_gathers, 2, str(tmp_path / "root"), str(tmp_path / "s"), timeout_s=240)
    for rank in out:
        assert rank["per_save"] == [0, 0, 0], rank
        assert rank["replanned"] == 1, rank  # a new structure: one exchange, on every rank
        # Saves 2-4 come back to back: a waiting one may be superseded, never lost.
        assert sorted(rank["committed"] + rank["superseded"]) == [1, 2, 3, 4, 5], rank
        assert rank["committed"][-2:] == [4, 5] and out[0]["committed"] == rank["committed"], rank
    manifests = [read_manifest(_catalog.step_location(resolve(str(tmp_path / "root")), s)) for s in (4, 5)]
    assert manifests[0].save_id != manifests[1].save_id  # derived ids still unique per save


_COLLECTIVES = (
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "all_gather",
    "broadcast",
    "gather",
    "scatter",
    "all_reduce",
    "barrier",
)


def _count_restore_collectives(rank: int, world_size: int, root: str, staging: str) -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)  # replicated (as under DDP): each leaf is written by one rank, read by both
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    optim.step()
    # Replicas are bit-identical under DDP; two processes stepping alone can differ by an
    # ulp (1 restore in ~80 read the owner's weight 7e-8 away from its own).
    for param in model.parameters():
        dist.broadcast(param.data, 0)
    with Checkpointer(root, staging_dir=f"{staging}/{rank}", uploader="thread") as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
    saved = model.weight.detach().clone()
    calls: list[str] = []
    real = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counting(name):
        def call(*args, **kwargs):
            calls.append(name)
            return real[name](*args, **kwargs)

        return call

    fresh = torch.nn.Linear(64, 64)
    fresh_optim = torch.optim.AdamW(fresh.parameters())
    save_calls: list[str] = []
    with Checkpointer(root, staging_dir=f"{staging}/fresh{rank}", uploader="thread") as ckpt:
        for name in _COLLECTIVES:
            setattr(dist, name, counting(name))  # counts, still the real collective
        try:
            step = ckpt.restore({"model": fresh, "optim": fresh_optim})
            equal = torch.equal(fresh.weight, saved)
            restore_calls, calls[:] = list(calls), []
            ckpt.save(2, {"model": fresh, "optim": fresh_optim})
            save_calls = list(calls)
        finally:
            for name, fn in real.items():
                setattr(dist, name, fn)
    return {
        "step": step,
        "calls": restore_calls,
        "save_calls": save_calls,
        "equal": equal,
        "opt_step": float(fresh_optim.state_dict()["state"][0]["step"]),
    }


def test_a_restore_makes_three_collectives_and_none_in_dcp(tmp_path):
    """The choice (a header all-reduce that checks every rank is at it, then one
    broadcast), the agreement once every rank checked its files, and the outcome: DCP
    plans each rank's reads alone (was 9 collectives). Each agreement is
    one all-reduce of three integers when no rank failed (was an all_gather_object: two
    all-gathers and pickling). Getting the first save ready adds none; that save agrees
    on the generation (a header, a broadcast, as at a fresh start: restore no longer waits for the
    claim) and exchanges the owner plan (a header all-reduce, a gather)."""
    out = run_world(_count_restore_collectives, 2, str(tmp_path / "root"), str(tmp_path / "s"), timeout_s=240)
    for rank in out:
        assert rank["step"] == 1 and rank["equal"] and rank["opt_step"] == 1.0, rank
        assert rank["calls"] == ["all_reduce", "broadcast_object_list", "all_reduce", "all_reduce"], rank
        assert rank["save_calls"] == ["all_reduce", "broadcast_object_list", "all_reduce", "all_gather_object"], rank


def _mismatched(rank: int, world_size: int) -> str:
    try:
        _collective.gather_tagged("owner plan" if rank == 0 else "save outcomes", rank)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_ranks_at_different_collectives_all_raise_instead_of_misreading():
    out = run_world(_mismatched, 2, timeout_s=120)
    assert all("different checkpoint collectives" in text for text in out), out


# What rank 0 calls while rank 1 gathers the owner plan: each a collective of its own.
_RANK_0_CALLS = {
    "choice": lambda: _collective.on_rank0(lambda: 5, "the restore's choice"),
    "agree": lambda: _collective.agree(None),
}


def _rank_0_against_a_gather(rank: int, world_size: int, call: str) -> str:
    try:
        if rank == 0:
            _RANK_0_CALLS[call]()
        else:
            _collective.gather_tagged("owner plan", rank)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_a_rank_0_choice_met_by_another_collective_raises_on_both_instead_of_misreading():
    """on_rank0 (the restore's choice, the generation claim) was a bare broadcast: a rank
    at another call read rank 0's value as its own (a Manifest taken for a generation claim:
    a TypeError) or left rank 0 waiting until the process group timed out."""
    out = run_world(_rank_0_against_a_gather, 2, "choice", timeout_s=60)
    assert all("different checkpoint collectives" in text for text in out), out


def test_a_rank_agreeing_while_another_gathers_raises_on_both_instead_of_hanging():
    """The agreement is one all-reduce now, not a tagged gather: both still open with the
    same header, so ranks at different calls raise alike."""
    out = run_world(_rank_0_against_a_gather, 2, "agree", timeout_s=120)
    assert all("different checkpoint collectives (agree, owner plan)" in text for text in out), out


def _capture_fails_on_rank_1_at_the_first_save(rank: int, world_size: int, root: str, staging: str) -> str:
    import torch.distributed as dist
    from torch.distributed.checkpoint.stateful import Stateful

    class Counter(Stateful):
        def state_dict(self) -> dict:
            if rank == 1:
                raise RuntimeError("out of memory on rank 1")
            return {"n": 1}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    with Checkpointer(root, staging_dir=f"{staging}/{rank}", uploader="thread") as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(4, 4), "counter": Counter()})
        dist.all_reduce(torch.ones(1000))  # the next training step's collective
        try:
            ckpt.wait()
        except CheckpointError as exc:
            return str(exc)
    return "no error"


def test_a_capture_that_fails_on_one_rank_at_the_first_save_fails_that_save_on_every_rank(tmp_path):
    """The first save exchanges the owner plan; a rank whose capture raised (an OOM while
    DCP makes up an unstepped optimizer's state, a Stateful failing there) skipped the
    exchange and went on training, so the others' exchange met its next training
    collective: a gloo size mismatch here, a hang or worse under NCCL. It now enters the
    exchange with its error, and the save fails on every rank."""
    out = run_world(
        _capture_fails_on_rank_1_at_the_first_save, 2, str(tmp_path / "r"), str(tmp_path / "s"), timeout_s=120
    )
    assert all("out of memory on rank 1" in text for text in out), out
