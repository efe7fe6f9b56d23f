"""How one replica enters a quorum: a whole-group start, a replacement that heals or is told
to end, a quorum that cannot form. The replica runs its first-quorum wait against
stand-ins of torchft's Manager; no torchft process and no Ray."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ray_goodput.replica import ReplicaGroups
from ray_goodput.runtime._join import WorkerJoin, set_join
from tests._replica_parts import AloneInQuorum, durable_copy


@contextlib.contextmanager
def _joined(kind: str):
    """This process's join for the block, as the driver sets it in a worker."""
    set_join(WorkerJoin(kind))
    try:
        yield
    finally:
        set_join(None)


class _FreshQuorum(AloneInQuorum):
    """A quorum of ``n`` replicas at step 0: none has progress to heal from."""

    def __init__(self, n: int) -> None:
        self.n = n

    def num_participants(self) -> int:
        return self.n


def _waiting_replacement(timeout_s: float, *, configured: int = 2, manager=None):
    from ray_goodput.replica._replica import Replica

    rep = Replica.__new__(Replica)  # the first-quorum wait alone: no torchft, no Ray
    rep.settings = ReplicaGroups(heartbeat_timeout_s=0.2, timeout_s=timeout_s)
    rep.slot, rep.configured, rep.replacement, rep.peers_finished = 1, configured, True, False
    rep.manager, rep._first_quorum, rep._drop_step = manager or AloneInQuorum(), True, False
    rep._durable = durable_copy(rep, slot=1, save_every=10)
    return rep


def test_two_fresh_replacements_of_three_do_not_step_from_scratch_without_replica_0():
    """Every replica of 3 failed and Ray replaced them one by one: replacements 1 and 2
    met at step 0 before replica 0's. They stepped from scratch together, replica 0's
    replacement then healed from them instead of restoring, and the durable checkpoint was
    thrown away. Now they wait for replica 0 (here it never comes: the wait ends at its
    bound)."""
    from ray_goodput.replica._replica import ReplicaJoinError

    rep = _waiting_replacement(timeout_s=0.5, configured=3, manager=_FreshQuorum(2))
    with _joined("replacement"):
        with pytest.raises(ReplicaJoinError, match=r"2 of 3 replicas"):
            rep._join_quorum()


class _QuorumAtTheEnd(_FreshQuorum):
    """A whole-group start's first quorum of ``n`` replicas whose newest checkpoint is the
    job's last step: replica 0 restored it before the quorum, the others heal to it there."""

    def __init__(self, n: int, step: int, *, restored: bool) -> None:
        super().__init__(n)
        self.step, self.quorums = (step if restored else 0), 0
        self.end = step

    def start_quorum(self, timeout=None) -> None:
        self.quorums += 1
        self.step = self.end  # replica 0 sends its state; a healing replica loads it

    def current_step(self) -> int:
        return self.step


@pytest.mark.parametrize("slot", [0, 1])
def test_a_finished_job_started_again_ends_every_replica_at_the_first_quorum(slot):
    """Started again on the storage of a finished job, replica 0 restored its last step
    and ended without a quorum; the others waited for it at their first quorum until
    timeout_s and failed (and with 3 replicas were replaced again and again, until the
    failure budget ended the finished run as failed). Replica 0 now meets the others once,
    they heal to the last step there, and every replica ends without a step or a save."""
    rep = _waiting_replacement(timeout_s=5.0, configured=3, manager=_QuorumAtTheEnd(3, 50, restored=slot == 0))
    rep.replacement, rep.slot = False, slot
    rep._in_step, rep._optim = False, torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    rep._rank_in_step = -1
    with _joined("start"):
        assert list(rep.batches(total_steps=50)) == []
        assert rep.manager.quorums == 1 and rep.current_step == 50


class _WhileReplica0Restores(_FreshQuorum):
    """A whole-group start's first quorum while replica 0 restores a large checkpoint for
    ``restore_s``: with min_replicas = configured, torchft's quorum forms only when its
    timeout outlasts the restore, else it raises (and torchft 0.2.0 raises that error again
    at every later start_quorum: a failed quorum cannot be tried again)."""

    def __init__(self, n: int, restore_s: float) -> None:
        super().__init__(n)
        self.restore_s, self.timeouts = restore_s, []

    def start_quorum(self, timeout=None) -> None:
        self.timeouts.append(timeout)
        if timeout is None or timeout.total_seconds() < self.restore_s:
            raise TimeoutError("quorum timed out")  # as torchft's client raises it


def _starting_replica(manager, **settings):
    rep = _waiting_replacement(timeout_s=settings.get("timeout_s", 0.5), configured=2, manager=manager)
    rep.replacement = False  # a whole-group start: replica 0 restores before its first quorum
    rep.settings = ReplicaGroups(min_replicas=2, heartbeat_timeout_s=0.1, **settings)
    return rep


def test_a_whole_group_start_waits_past_timeout_s_for_replica_0_restoring_a_large_checkpoint():
    """Replica 0 restores the checkpoint before it joins a quorum. The other replicas' first
    quorum failed after timeout_s (30 s by default), less than a multi-GB restore from
    object storage takes: each raised and was replaced, a failure charged to it and to its
    healthy node (two such restarts isolate it). Their first quorum is now bounded by
    start_timeout_s: one quorum call, as torchft cannot try a failed one again."""
    manager = _WhileReplica0Restores(2, restore_s=100.0)
    rep = _starting_replica(manager, timeout_s=30.0, start_timeout_s=600.0)
    with _joined("start"):
        rep._join_quorum()
        assert len(manager.timeouts) == 1 and manager.timeouts[0].total_seconds() > 599.0


def test_a_whole_group_start_whose_replica_0_never_comes_fails_naming_start_timeout_s():
    from ray_goodput.replica._replica import ReplicaJoinError

    rep = _starting_replica(_WhileReplica0Restores(2, restore_s=10**6), timeout_s=30.0, start_timeout_s=60.0)
    with _joined("start"):
        with pytest.raises(ReplicaJoinError, match=r"start_timeout_s"):
            rep._join_quorum()


class _QuorumNeverFormed(AloneInQuorum):
    """torchft's quorum with ``min_replicas`` 2 when every peer has finished: it waits out
    its timeout and raises; meanwhile the driver tells the replacement its peers are done."""

    def start_quorum(self, timeout=None) -> None:
        set_join(WorkerJoin("done"))
        raise TimeoutError("quorum timed out")  # as torchft's client raises it

    def num_participants(self) -> int:
        raise AssertionError("no quorum formed: nothing to ask")


def test_a_replacement_whose_peers_finished_while_its_quorum_could_not_form_ends_cleanly():
    """With min_replicas >= 2, a replacement whose peers all finished while it started
    waited in a quorum that could never form, and its timeout was a failure of the run:
    charged to max_failures, the replica replaced again, and a run that had finished
    could end failed. It ends with nothing to train, as when told before its quorum."""
    rep = _waiting_replacement(timeout_s=5.0, configured=2, manager=_QuorumNeverFormed())
    rep.settings = ReplicaGroups(min_replicas=2, heartbeat_timeout_s=0.2, timeout_s=5.0)
    rep._in_step, rep._optim = False, torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    with _joined("replacement"):
        assert list(rep.batches(total_steps=10)) == []
        assert rep.peers_finished


def test_a_replacement_whose_quorum_fails_while_its_peers_still_train_raises():
    rep = _waiting_replacement(timeout_s=5.0, configured=2, manager=_QuorumNeverFormed())
    rep.manager.start_quorum = lambda timeout=None: (_ for _ in ()).throw(TimeoutError("quorum timed out"))
    rep._in_step, rep._optim = False, torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    with _joined("replacement"):
        with pytest.raises(TimeoutError, match="quorum timed out"):
            list(rep.batches(total_steps=10))


def test_a_fresh_replacement_that_meets_every_replica_at_step_0_does_not_commit_that_step():
    """Replica 0's replacement restores the checkpoint inside this quorum and drops the
    step; another fresh replacement that committed it kept a step computed from fresh
    weights (with a checkpoint of step 1, the two then stood at step 1 with different
    weights and never healed). It drops the step and heals from replica 0 at the next
    quorum; so it does at every quorum until it has progress."""
    rep = _waiting_replacement(timeout_s=5.0, configured=2, manager=_FreshQuorum(2))
    with _joined("replacement"):
        rep._join_quorum()
        assert rep._drop_step
        rep._drop_step = False  # the step did not commit (no peer was ahead): still no progress
        rep._join_quorum()
        assert rep._drop_step


class _HealingQuorum(AloneInQuorum):
    """torchft's synchronous quorum healing this replica from a peer at ``step``: it loads
    the peer's state through the replica's callback, then stands at the peer's step."""

    def __init__(self, rep, peer_state: dict, step: int) -> None:
        self.rep, self.peer_state, self.step, self.healed_to = rep, peer_state, 0, step

    def start_quorum(self, timeout=None) -> None:
        self.rep._load_heal_state(self.peer_state)
        self.step = self.healed_to

    def num_participants(self) -> int:
        return 2

    def current_step(self) -> int:
        return self.step


def test_a_replacement_of_replica_0_records_its_heal_as_a_restore_of_the_peers_step():
    """Replica 0 writes the goodput timeline. Its replacement healed from a peer at step 12
    and recorded no restore: the ledger counted the replaced process's 12 steps as lost and
    the replacement's first step as 13 steps of its own."""
    import torch

    from ray_goodput.goodput._recorder import StepRecorder
    from ray_goodput.replica import _position as pos

    class _Log:  # the recorder's sink: the events it would write
        def __init__(self) -> None:
            self.events: list[tuple[str, dict]] = []

        def emit(self, name: str, **fields) -> None:
            self.events.append((name, fields))

    model = torch.nn.Linear(2, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    peer = {"model": model.state_dict(), "optim": optim.state_dict(), "position": pos.Position().to_dict(), "extra": {}}
    rep = _waiting_replacement(timeout_s=5.0, configured=2)
    rep.slot, rep._model, rep._optim, rep._extra, rep._healed = 0, model, optim, {}, False
    rep._recorder = StepRecorder(_Log())
    rep.manager = _HealingQuorum(rep, peer, 12)
    with _joined("replacement"):
        rep._join_quorum()
    restores = [f for name, f in rep._recorder.log.events if name == "restore"]
    assert [r["step"] for r in restores] == [12]
    rep._recorder.step(13)
    assert rep._recorder.log.events[-1][1]["n"] == 1  # one step of its own, not 13


def test_a_waiting_replacement_ends_when_told_its_peers_finished_instead_of_timing_out():
    import threading

    rep = _waiting_replacement(timeout_s=30.0)
    set_join(WorkerJoin("replacement"))
    told = threading.Timer(0.3, set_join, [WorkerJoin("done")])
    told.start()
    try:
        rep._join_quorum()  # returns once told (the old loop raised ReplicaJoinError after 30 s)
        assert rep.peers_finished
    finally:
        told.cancel()
        set_join(None)


def test_a_replacement_alone_and_never_told_fails_naming_the_timeout():
    from ray_goodput.replica._replica import ReplicaJoinError

    rep = _waiting_replacement(timeout_s=0.5)
    with _joined("replacement"):
        with pytest.raises(ReplicaJoinError, match=r"timeout_s"):
            rep._join_quorum()
        assert not rep.peers_finished


def test_a_replica_of_the_start_whose_quorum_fails_after_its_peers_finished_ends_cleanly():
    rep = _waiting_replacement(timeout_s=5.0, configured=3, manager=_QuorumNeverFormed())
    rep.replacement, rep.slot = False, 1  # started with the group; the last quorums left it out
    rep.settings = ReplicaGroups(min_replicas=2, heartbeat_timeout_s=0.2, timeout_s=5.0)
    rep._in_step, rep._optim = False, torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    rep._first_quorum = False  # it has stepped with its peers
    with _joined("start"):
        assert list(rep.batches(total_steps=10)) == []
        assert rep.peers_finished


class _ReplacementsArriving(_FreshQuorum):
    """Replacements of every replica meeting at step 0: each quorum has one more of them,
    up to ``configured``."""

    def __init__(self, n: int, configured: int) -> None:
        super().__init__(n)
        self.configured, self.quorums, self.loaded = configured, 0, None

    def start_quorum(self, timeout=None) -> None:
        self.quorums += 1
        if self.quorums > 1:
            self.n = min(self.n + 1, self.configured)

    def load_state_dict(self, sd: dict) -> None:
        self.loaded = sd


def _replica_0s_replacement_joins(*, timeout_s: float, configured: int, arriving: int, up_to: int):
    """Replica 0's replacement joins a quorum of replacements that grows from ``arriving``
    to ``up_to``; returns it and the participants at its restore (step 40)."""
    rep = _waiting_replacement(
        timeout_s=timeout_s, configured=configured, manager=_ReplacementsArriving(arriving, configured=up_to)
    )
    rep.slot, rep._batches_restored = 0, 0
    restored_with: list[int] = []
    rep._durable.restore_in_quorum = lambda: restored_with.append(rep.manager.num_participants()) or 40
    with _joined("replacement"):
        rep._join_quorum()
    return rep, restored_with


def test_replica_0s_replacement_with_no_peer_ahead_waits_for_every_replica_before_it_restores():
    """Every replica of 3 failed and Ray replaced them one by one. Replica 0's replacement
    met one unhealed replacement at step 0, restored the checkpoint inside that quorum and
    went on to the step's all-reduce, while the other, still waiting for every replica,
    went back to the quorum: both stalled until timeout_s and failed. Replica 0's
    replacement now waits for every replica as the others do, and restores when they are
    all there (each drops that step and heals from it at the next quorum)."""
    rep, restored_with = _replica_0s_replacement_joins(timeout_s=5.0, configured=3, arriving=2, up_to=3)
    assert restored_with == [3] and rep._drop_step
    assert rep.manager.loaded == {"step": 40, "batches_committed": 0}


def test_replica_0s_replacement_alone_in_its_quorum_restores_at_once_instead_of_waiting():
    """Alone in its first quorum (min_replicas 1: its peers are still being replaced),
    replica 0's replacement has no peer that could be waiting for the others: it restores
    there and the replacements after it heal from it. Waiting for every replica instead
    failed it after timeout_s when a peer's replacement came later than that."""
    rep, restored_with = _replica_0s_replacement_joins(timeout_s=0.5, configured=2, arriving=1, up_to=1)
    assert restored_with == [1] and rep._drop_step and rep.manager.quorums == 1
