"""One replica's steps and its end: leaving the quorum, the all-reduce layout, steps that do
not commit, the job's last step saved once and never over a newer generation, and the data
position of a step that did not commit. Stand-ins of torchft's Manager; real Checkpointers
on local storage."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ray_goodput.errors import ConfigError
from ray_goodput.replica import ReplicaGroups
from tests._replica_parts import AloneInQuorum, durable_copy


class _Calls:
    """Stand-ins that record, in order, what closing a ``Replica`` does to its parts."""

    def __init__(self, close_raises: bool = False) -> None:
        self.calls: list[str] = []
        self.close_raises = close_raises

    def shutdown(self, wait: bool) -> None:  # torchft's Manager
        self.calls.append(f"manager.shutdown(wait={wait})")

    def close(self) -> None:  # the Checkpointer: waits for the last save
        self.calls.append("checkpointer.close")
        if self.close_raises:
            from ray_goodput import CheckpointError

            raise CheckpointError("the last save did not commit")

    def __exit__(self, *exc: object) -> None:  # the Checkpointer unwinding an error
        self.calls.append("checkpointer.release")

    def end(self) -> None:  # the goodput recorder
        self.calls.append("recorder.end")


def _closing_replica(parts: _Calls):
    from ray_goodput.replica._replica import Replica

    rep = Replica.__new__(Replica)
    rep.slot, rep.manager, rep._recorder, rep._total_steps = 0, parts, parts, None
    rep._durable = durable_copy(rep, slot=0, save_every=5)
    rep._durable.ckpt = parts
    return rep


def test_an_error_in_the_loop_leaves_the_quorum_at_once_and_is_raised_as_it_was():
    """Replica 0's loop raised: it used to wait for its uploads (up to the Checkpointer's
    wait_timeout_s) while its Manager heartbeated without joining, stalling the survivors'
    quorums, and a failed last save replaced the loop's error (Recovery decides on its
    type), and the ledger recorded a clean end."""
    parts = _Calls(close_raises=True)
    with pytest.raises(ValueError, match="the user's loop"):
        with _closing_replica(parts):
            raise ValueError("the user's loop")
    assert parts.calls == ["manager.shutdown(wait=False)", "checkpointer.release"]


def test_a_clean_end_leaves_the_quorum_before_it_waits_for_the_last_save():
    parts = _Calls()
    with _closing_replica(parts):
        pass
    assert parts.calls == ["manager.shutdown(wait=False)", "checkpointer.close", "recorder.end"]


class _Collective:
    """torchft's Manager for one step: an all-reduce that records what it was sent (and
    leaves it: a mean over one participant), and a commit vote."""

    def __init__(self, commits: bool = True) -> None:
        self.sent: list[int] = []
        self.commits = commits

    def allreduce(self, tensor: torch.Tensor):
        self.sent.append(tensor.numel())
        return SimpleNamespace(wait=lambda: None)

    def should_commit(self) -> bool:
        return self.commits

    def current_step(self) -> int:
        return 4


def _stepping_replica(model: torch.nn.Module, manager: _Collective):
    from ray_goodput.replica._replica import Replica

    rep = Replica.__new__(Replica)
    rep.slot, rep._model, rep.manager = 1, model, manager
    rep._in_step, rep._drop_step, rep._retrying, rep._uncommitted = True, False, False, 0
    rep._recorder = SimpleNamespace(uncommitted=lambda: None)
    return rep


def test_a_parameter_the_batch_left_without_a_gradient_keeps_the_all_reduce_layout_of_every_replica():
    """A branch taken by one replica's batch and not another's (a conditional head, MoE):
    the flat all-reduce held only the parameters with a gradient, so the replicas sent
    different sizes (the step never committed) or, when the sizes matched, added unrelated
    gradients together. Now every parameter is sent (zeros where unused here); one that a
    peer used gets the mean, one that no participant used keeps no gradient."""
    model = torch.nn.ModuleDict(
        {"used": torch.nn.Linear(3, 2), "peers": torch.nn.Linear(3, 4), "nobody": torch.nn.Linear(3, 1)}
    )
    model["used"](torch.ones(1, 3)).sum().backward()
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    peers = [i for i, name in enumerate(n for n, _ in model.named_parameters()) if name.startswith("peers")]

    class _WithAPeer(_Collective):
        """The mean with one peer whose batch took the ``peers`` branch (gradient 1.0)."""

        def allreduce(self, tensor: torch.Tensor):
            super().allreduce(tensor)
            grads, flags = tensor[: sum(sizes)], tensor[sum(sizes) :]
            for i in peers:
                start = sum(sizes[:i])
                grads[start : start + sizes[i]] = (grads[start : start + sizes[i]] + 1.0) / 2
                flags[i] = (flags[i] + 1.0) / 2
            return SimpleNamespace(wait=lambda: None)

    manager = _WithAPeer()
    _stepping_replica(model, manager)._average_gradients()
    assert manager.sent == [sum(sizes) + len(params)]  # the same on every replica
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model["peers"].parameters())
    assert all(p.grad is None for p in model["nobody"].parameters())  # the optimizer leaves it


def test_steps_that_never_commit_end_in_an_error_that_says_so_instead_of_retrying_for_ever():
    from ray_goodput.replica._replica import MAX_UNCOMMITTED_STEPS, ReplicaStepError

    rep = _stepping_replica(torch.nn.Linear(2, 1), _Collective(commits=False))
    for _ in range(MAX_UNCOMMITTED_STEPS - 1):
        assert rep.step() is False
        rep._in_step = True  # the next try of the same step
    with pytest.raises(ReplicaStepError, match=rf"step 5 did not commit {MAX_UNCOMMITTED_STEPS} times in a row"):
        rep.step()


class _LastSteps(_Collective, AloneInQuorum):
    """torchft's Manager over a job's last steps: every step commits, with this replica the
    step's only participant (its peers, replica 0 among them, were being replaced)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def participating_rank(self) -> int:
        return 0

    def current_step(self) -> int:
        return self.step

    def should_commit(self) -> bool:
        self.step += 1
        return True

    def batches_committed(self) -> int:
        return self.step

    def shutdown(self, wait: bool) -> None:
        pass


def _end_job_as_survivor(root: str, model: torch.nn.Module, *, last: int = 9) -> None:
    """Replica 1 steps from 7 to the job's ``last`` step as the only participant, and ends."""
    from ray_goodput.replica import Position
    from ray_goodput.replica._replica import Replica

    rep = Replica.__new__(Replica)
    rep.slot, rep.configured, rep.replacement, rep.peers_finished = 1, 2, False, False
    rep.settings = ReplicaGroups(timeout_s=10.0)
    rep.manager, rep._durable = _LastSteps(step=7), durable_copy(rep, slot=1, save_every=5, root=root, timeout_s=10.0)
    rep._model, rep.model, rep._optim, rep._extra = model, model, torch.optim.SGD(model.parameters(), lr=0.1), {}
    rep._dataset, rep._batch_size, rep._seed, rep._shuffle = torch.arange(64.0), 4, 0, False
    rep._collate, rep._order, rep._position = torch.stack, None, Position()
    rep._rank_in_step, rep._participants = -1, 0
    rep._in_step, rep._first_quorum, rep._drop_step, rep._retrying, rep._uncommitted = False, False, False, False, 0
    rep._recorder = SimpleNamespace(step=lambda *a, **k: None, uncommitted=lambda: None, end=lambda: None)
    with rep:
        for batch in rep.batches(total_steps=last):
            model(batch[:, None]).sum().backward()
            assert rep.step()
    assert rep.current_step == last


def _restored(root: str) -> tuple[int | None, torch.Tensor]:
    from ray_goodput import Checkpointer

    fresh = torch.nn.Linear(1, 1)
    with Checkpointer(root, uploader="thread") as ckpt:
        return ckpt.restore({"model": fresh}), fresh.weight.detach().clone()


def test_a_survivor_that_ends_the_job_while_replica_0_is_replaced_saves_the_last_step(tmp_path):
    """Only replica 0 saved, every ``save_every`` steps: the steps after its last save, and
    all of the job's end when replica 0 was being replaced then, lived only in the
    survivors' processes, and the run ended with no checkpoint of its final state."""
    model = torch.nn.Linear(1, 1)
    _end_job_as_survivor(str(tmp_path / "ckpt"), model)
    step, weight = _restored(str(tmp_path / "ckpt"))
    assert step == 9 and torch.equal(weight, model.weight)


def test_a_survivor_does_not_save_again_a_last_step_replica_0_committed(tmp_path):
    """Replica 0 committed the last step, saved it and ended, while the survivor's vote on
    that step failed, so it computed the step again alone: its save, a newer generation,
    would have replaced replica 0's (the step both replicas committed together)."""
    from ray_goodput import Checkpointer

    root = str(tmp_path / "ckpt")
    replica_0 = torch.nn.Linear(1, 1)
    with Checkpointer(root, uploader="thread") as ckpt:
        ckpt.save(9, {"model": replica_0})
    _end_job_as_survivor(root, torch.nn.Linear(1, 1))
    step, weight = _restored(root)
    assert step == 9 and torch.equal(weight, replica_0.weight)


def test_replica_0s_replacement_that_restored_the_last_step_ends_without_saving_it_again(tmp_path):
    """The survivor ended the job while replica 0 was being replaced and saved the last
    step; the replacement, with no peer left to heal from, restored that very step, and its
    final save of it raised ConfigError ("not after the last saved step"): not retryable,
    so a run that had finished and committed its last step failed."""
    from ray_goodput.replica import Position
    from ray_goodput.replica._replica import Replica

    class _Restores(_LastSteps):
        def load_state_dict(self, state: dict) -> None:
            self.step = state["step"]

    root = str(tmp_path / "ckpt")
    survivor = torch.nn.Linear(1, 1)
    _end_job_as_survivor(root, survivor)
    rep = Replica.__new__(Replica)
    rep.slot, rep.replacement, rep.settings, rep._extra = 0, True, ReplicaGroups(timeout_s=30.0), {}
    rep.manager, rep._position, rep._batches_restored = _Restores(step=0), Position(), 0
    rep._model = rep.model = model = torch.nn.Linear(1, 1)
    rep._optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rep._rank_in_step, rep._participants, rep.configured = 0, 1, 2
    rep._durable = durable_copy(rep, slot=0, save_every=5, root=root)
    rep._durable.open()
    try:
        assert rep._restore_if_no_peer_had_state() is True and rep.current_step == 9
        rep._save_final()
    finally:
        rep._durable.close()
    step, weight = _restored(root)
    assert step == 9 and torch.equal(weight, survivor.weight)


def test_replica_0_late_to_the_last_step_does_not_save_it_over_a_survivors_newer_generation(tmp_path):
    """With 3 replicas, replica 0 reached the last quorum after its peers had committed the
    last step without it and ended (the survivor that led it saved it, a new generation);
    replica 0 computed the step alone and saved it in its own, older generation: fenced,
    and a run that had finished and committed its last step failed with FencedError."""
    from ray_goodput.replica import Position
    from ray_goodput.replica._replica import Replica

    root = str(tmp_path / "ckpt")
    rep = Replica.__new__(Replica)
    rep.slot, rep.configured, rep.replacement, rep._extra = 0, 3, False, {}
    rep.settings = ReplicaGroups(timeout_s=30.0)
    rep.manager, rep._position, rep._batches_restored = _LastSteps(step=5), Position(), 0
    rep._model = rep.model = model = torch.nn.Linear(1, 1)
    rep._optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rep._durable = durable_copy(rep, slot=0, save_every=5, root=root)
    rep._durable.open()  # replica 0's, from the job's start
    try:
        rep._durable.save_if_due(5)
        rep._durable.ckpt.wait()
        survivor = torch.nn.Linear(1, 1)
        _end_job_as_survivor(root, survivor)  # steps 8 and 9 without replica 0; saves 9
        rep.manager.step, rep._rank_in_step, rep._participants = 9, 0, 1
        rep._save_final()  # step 9, computed alone after the others ended
    finally:
        rep._durable.close()
    step, weight = _restored(root)
    assert step == 9 and torch.equal(weight, survivor.weight)


def test_replica_0_late_to_a_last_step_due_for_its_periodic_save_does_not_save_it_over_a_newer_generation(
    tmp_path,
):
    """As above, with the last step a multiple of save_every: replica 0's periodic save,
    made inside step(), skipped the check that the final save makes, saved the step in its
    older generation, and close() raised FencedError for a run that had finished."""
    from ray_goodput.replica import Position
    from ray_goodput.replica._replica import Replica

    root = str(tmp_path / "ckpt")
    rep = Replica.__new__(Replica)
    rep.slot, rep.configured, rep.replacement, rep.peers_finished, rep._extra = 0, 3, False, False, {}
    rep.settings = ReplicaGroups(timeout_s=30.0)
    rep.manager, rep._position, rep._batches_restored = _LastSteps(step=5), Position(), 0
    rep._model = rep.model = model = torch.nn.Linear(1, 1)
    rep._optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rep._dataset, rep._batch_size, rep._seed, rep._shuffle = torch.arange(64.0), 4, 0, False
    rep._collate, rep._order, rep._rank_in_step, rep._participants = torch.stack, None, -1, 0
    rep._in_step, rep._first_quorum, rep._drop_step, rep._retrying, rep._uncommitted = False, False, False, False, 0
    rep._recorder = SimpleNamespace(step=lambda *a, **k: None, uncommitted=lambda: None, end=lambda: None)
    rep._durable = durable_copy(rep, slot=0, save_every=5, root=root)
    rep._durable.open()  # replica 0's, from the job's start
    rep._durable.save_if_due(5)
    rep._durable.ckpt.wait()
    survivor = torch.nn.Linear(1, 1)
    _end_job_as_survivor(root, survivor, last=10)  # steps 8 to 10 without replica 0; saves 10
    rep.manager.step = 9
    with rep:  # step 10, computed alone after the others ended (a FencedError at close before)
        for batch in rep.batches(total_steps=10):
            model(batch[:, None]).sum().backward()
            assert rep.step()
    step, weight = _restored(root)
    assert step == 10 and torch.equal(weight, survivor.weight)


def test_a_step_that_rolled_into_the_next_epoch_and_did_not_commit_leaves_the_epoch_where_it_was():
    """10 samples, batch 2: with 3 replicas the second step needs 6 of the 4 left, so it
    rolled over into epoch 1. The step did not commit (a peer died in it) and was retried
    with 1 replica, which fit in epoch 0's remainder; the position had already moved on,
    and those 4 samples of epoch 0 were never read (more than the tail of fewer than P*B
    that the rule drops)."""
    from ray_goodput.replica import Position
    from ray_goodput.replica._replica import Replica

    class _Scripted(_Collective):
        """Each try of a step: (participants, whether it commits)."""

        def __init__(self, tries: list[tuple[int, bool]]) -> None:
            super().__init__()
            self.tries, self.step, self.now = list(tries), 0, (0, False)

        def start_quorum(self, timeout=None) -> None:
            self.now = self.tries.pop(0)

        def num_participants(self) -> int:
            return self.now[0]

        def participating_rank(self) -> int:
            return 0

        def current_step(self) -> int:
            return self.step

        def should_commit(self) -> bool:
            self.step += self.now[1]
            return self.now[1]

    model = torch.nn.Linear(1, 1)
    rep = Replica.__new__(Replica)
    rep.slot, rep.configured, rep.replacement, rep.peers_finished = 1, 3, False, False
    rep.manager = _Scripted([(3, True), (3, False), (1, True)])
    rep._model, rep._optim = model, torch.optim.SGD(model.parameters(), lr=0.1)
    rep._durable = durable_copy(rep, slot=1, save_every=None)
    rep._dataset, rep._batch_size, rep._position, rep._participants = torch.arange(10.0), 2, Position(), 0
    rep._in_step, rep._first_quorum, rep._retrying, rep._uncommitted, rep._drop_step = False, False, False, 0, False
    rep._order, rep._seed, rep._shuffle, rep._collate = None, 0, False, torch.stack
    rep._recorder = SimpleNamespace(step=lambda *a, **k: None, uncommitted=lambda: None)
    read = []
    for batch in rep.batches(total_steps=2):
        read.append(batch.tolist())
        model(batch[:, None]).sum().backward()
        rep.step()
    assert read == [[0.0, 1.0], [0.0, 1.0], [6.0, 7.0]], read  # the retry reads epoch 0's samples 6-7
    assert rep.position.epoch == 0


def test_a_dataset_smaller_than_one_step_is_refused_naming_the_fix_not_read_as_a_short_batch():
    from ray_goodput.replica import Position
    from ray_goodput.replica._replica import Replica

    class _Two(_LastSteps):
        def num_participants(self) -> int:
            return 2

    rep = Replica.__new__(Replica)
    rep.slot, rep.configured, rep.replacement, rep.peers_finished = 0, 2, False, False
    rep.manager, rep._optim = _Two(step=0), torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    rep._dataset, rep._batch_size, rep._position, rep._participants = torch.arange(6.0), 4, Position(), 0
    rep._in_step, rep._first_quorum, rep._retrying = False, False, False
    rep._order, rep._seed, rep._shuffle, rep._collate = None, 0, False, torch.stack
    rep._durable = durable_copy(rep, slot=0, save_every=None)
    with pytest.raises(ConfigError, match=r"6 samples, fewer than one step of 2 replicas × batch_size 4"):
        next(rep.batches(total_steps=3))


def test_a_survivor_saves_the_last_step_when_only_an_older_lineage_has_it(tmp_path):
    """Storage holds step 9 from a dead attempt (an older generation) and step 5 from the
    newer one that resumed before it: a restore takes step 5. The survivor looked for a
    committed step 9 by number alone, skipped its save, and the job's last steps were lost."""
    from ray_goodput import Checkpointer

    root = str(tmp_path / "ckpt")
    with Checkpointer(root, uploader="thread") as dead_attempt:
        dead_attempt.save(9, {"model": torch.nn.Linear(1, 1)})
    with Checkpointer(root, uploader="thread") as resumed:  # the next generation
        resumed.save(5, {"model": torch.nn.Linear(1, 1)})
    assert _restored(root)[0] == 5
    model = torch.nn.Linear(1, 1)
    _end_job_as_survivor(root, model)
    step, weight = _restored(root)
    assert step == 9 and torch.equal(weight, model.weight)


def test_replica_0s_restore_inside_a_quorum_bounds_its_upload_wait_for_that_restore_only(tmp_path, monkeypatch):
    """Its peers wait for it in the step's all-reduce, so its wait for a dead replica 0's
    uploads is capped below ``timeout_s``; the cap stayed on the process, so any later
    restore there (the user's own) was capped too."""
    from ray_goodput.checkpoint import _checkpointer
    from ray_goodput.replica._replica import Replica
    from ray_goodput.runtime._resume import restore_upload_wait_s

    waits = []
    monkeypatch.setattr(_checkpointer, "ray_initialized", lambda: True)  # as under Ray
    monkeypatch.setattr(
        _checkpointer, "wait_for_uploads", lambda root, *, above, timeout_s: waits.append(timeout_s) or {}
    )
    rep = Replica.__new__(Replica)
    rep.replacement, rep.settings, rep._extra = True, ReplicaGroups(timeout_s=30.0), {}
    rep.manager = SimpleNamespace(current_step=lambda: 0)
    rep._model = model = torch.nn.Linear(1, 1)
    rep._optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rep._durable = durable_copy(rep, slot=0, save_every=5, root=str(tmp_path / "ckpt"))
    rep._durable.open()
    try:
        assert rep._restore_if_no_peer_had_state() is False  # nothing committed yet
    finally:
        rep._durable.close()
    assert waits == [10.0]
    assert restore_upload_wait_s(str(tmp_path / "ckpt"), 120.0) == 120.0


def test_replica_0_left_out_of_the_last_steps_ends_cleanly_when_its_save_is_fenced_by_the_final_one(tmp_path):
    """Replica 0 fell behind, left out of the job's last quorums; a survivor saved the last
    step in a newer generation, which fences the saves replica 0 still had in flight. Its
    close raised that FencedError (not retryable), and a finished job whose last step is
    committed ended as failed. A fence of an older save is no error once the job's last
    step is committed; a fence with the last step not committed still is."""
    from ray_goodput import Checkpointer, FencedError
    from ray_goodput.replica import Position

    model = torch.nn.Linear(1, 1)

    def replica_0(root: str, total_steps: int):
        rep = _closing_replica(_Calls())
        rep._model, rep._optim, rep._extra = model, torch.optim.SGD(model.parameters(), lr=0.1), {}
        rep._position, rep._batches_restored, rep._total_steps = Position(), 0, total_steps
        rep.manager = None
        rep._durable = durable_copy(rep, slot=0, save_every=5, root=root)
        rep._durable.open()
        rep._durable.save_if_due(5)
        rep._durable.ckpt.wait()  # committed in replica 0's generation
        return rep

    for total_steps, fenced in ((9, False), (12, True)):
        root = str(tmp_path / f"ckpt-{total_steps}")
        rep = replica_0(root, total_steps)
        _end_job_as_survivor(root, model, last=9)  # a newer generation: step 9, the job's last
        rep._durable.save_if_due(10)  # still in flight at the survivor's claim: fenced
        if fenced:  # a job of 12 steps: its last step is not committed
            with pytest.raises(FencedError):
                rep.close()
        else:
            rep.close()
        with Checkpointer(root, uploader="thread") as ckpt:
            assert ckpt.restore({"model": torch.nn.Linear(1, 1)}) == 9
