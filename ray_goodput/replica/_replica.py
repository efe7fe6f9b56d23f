"""One replica group's side of replica mode, inside the training function.

A :class:`Replica` wraps what torchft needs around the user's model, optimizer and dataset:
a torchft ``Manager`` (synchronous quorum, so a replica knows the step's participants
before it reads a batch, and a heal is applied before the step starts), a gloo process
group that heals over the same group (``PGTransport``), one all-reduce of the step's
gradients through the Manager (torchft 0.2.0's DDP wrapper asserts on a failed all-reduce,
which kills the survivor it should keep), the step's batch taken from the global data
position (``_position``), and the durable fallback (``_durable``: replica 0 saves through
a ``Checkpointer`` of a world of one). The loop it gives the user::

    with Replica(model, optim, dataset, batch_size=32, save_every=50) as rep:
        for batch in rep.batches(total_steps=1000):
            loss_fn(model(batch[0]), batch[1]).backward()
            rep.step()

At a whole-group start replica 0 restores the newest committed checkpoint (model,
optimizer, data position, step) and the others heal from it at the first quorum; a
replacement restores nothing and heals from a live peer. When a replacement's first quorum
shows that no peer has any progress (every replica failed, but Ray saw the failures one at
a time and replaced them one by one), no replacement steps from scratch: each waits (up to
``timeout_s``, at each quorum until it has healed) for a peer to heal from, or for every
replica when none has any. Then replica 0 restores the checkpoint, every replica drops that
step (votes not to commit it), and the others heal from replica 0 at the next quorum.
Replica 0's replacement waits so only at its first quorum, and only with peers in it: alone
there, it restores at once, and the replacements after it heal from it. At
a whole-group start the first step waits for every replica, so none steps ahead of the
restored checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import default_collate

from ray_goodput.data import _order
from ray_goodput.errors import ConfigError, PeerFailedError
from ray_goodput.goodput import get_recorder
from ray_goodput.replica import _position as pos
from ray_goodput.replica._config import ReplicaGroups, require_torchft
from ray_goodput.replica._durable import DurableCopy, Progress
from ray_goodput.runtime import WorkerContext
from ray_goodput.runtime._join import worker_join

logger = logging.getLogger(__name__)


#: Steps in a row that did not commit before the replica gives up (each failed step is
#: bounded by ``ReplicaGroups.timeout_s``); a replacement costs one or two.
MAX_UNCOMMITTED_STEPS = 20


class ReplicaJoinError(PeerFailedError):
    """A replacement found no live peer to heal from in time (retryable: Ray replaces it)."""


class ReplicaStepError(PeerFailedError):
    """Steps stopped committing: ``MAX_UNCOMMITTED_STEPS`` in a row did not (retryable)."""


class _RestoredMidQuorum(RuntimeError):
    """This replica's step is not to commit: it restored its state inside the step."""


class Replica:
    """This worker's replica group (see the module docstring). A context manager.

    ``dataset``: a map-style dataset (``len`` and ``[i]``; ``ray_goodput.data.FileDataset``
    reads through the node cache); each step's batch is ``collate_fn`` of its samples.
    ``state``: more ``Stateful`` values to heal and save with the model and optimizer.
    ``save_every``: replica 0 saves a durable checkpoint every that many committed steps,
    and the first participant of the job's last step saves that step (None: never);
    ``storage_path`` and ``checkpoint`` (Checkpointer keyword arguments) say where and how.
    Raises ConfigError when torchft is missing or an argument is wrong.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Any,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        state: dict[str, Stateful] | None = None,
        save_every: int | None = None,
        storage_path: str | None = None,
        checkpoint: dict[str, Any] | None = None,
    ) -> None:
        require_torchft()
        _check(model, batch_size, save_every, state)
        self._read_join()
        ctx = WorkerContext.detect()
        self.slot, self.configured = ctx.rank, ctx.world_size
        self._model, self._optim, self._dataset = model, optimizer, dataset
        self._batch_size, self._seed, self._shuffle, self._collate = batch_size, seed, shuffle, collate_fn
        self._extra = dict(state or {})
        self._position = pos.Position()
        self._step_at = self._position  # where the step in progress reads (the position moves at its commit)
        self._order: tuple[int, np.ndarray] | None = None
        self._participants = 0
        self._quorum_wait_s = 0.0  # the step's wait in a quorum whose replicas changed (the ledger's)
        self._retrying = False  # the step before did not commit
        self._uncommitted = 0  # steps in a row that did not commit
        self._in_step = False
        self._first_quorum = True
        self._healed = False  # the quorum under way loaded a peer's state
        self._healed_in_join = False  # the step's join healed: its time is the restore's, not a wait
        self._heal_from = 0.0  # where the timeline's restore of a heal in this join begins
        self._drop_step = False
        self._batches_restored = 0  # torchft's counter, from a durable checkpoint
        self._fetch_s = 0.0  # the step's wait for its samples (the ledger's data stall)
        self._recorder = get_recorder()  # before the world of one: the timeline keeps the real rank
        self.model = model  # its gradients are averaged across the step's participants by step()
        self._durable = DurableCopy(
            self.slot, save_every, storage_path, checkpoint or {}, self._durable_state, self.settings.timeout_s
        )
        self._rank_in_step = -1  # this replica's place among the step's participants
        self._total_steps: int | None = None  # the job's, from batches()
        self.manager: Any = None
        if self.peers_finished:  # replaced after its peers finished: nothing left to train
            logger.info("replica %d replaced after every peer finished: nothing to do", self.slot)
            return
        if self.slot == 0 and save_every:
            self._durable.open()
        try:
            # Replica 0 at a whole-group start restores the newest committed checkpoint; a
            # replacement restores nothing: it heals from a live peer at its first quorum.
            self.manager = self._torchft(None if self.replacement else self._durable.restore())
        except BaseException as exc:  # no with-block to release the Checkpointer: released here
            self._durable.release(type(exc), exc, exc.__traceback__)
            raise

    # ---- set-up ---------------------------------------------------------------------

    def _read_join(self) -> None:
        """How this worker joined (the driver's word): its settings, whether it replaces a
        failed replica, and whether its peers had finished by then."""
        join = worker_join()
        self.settings = ReplicaGroups(**join.settings) if join is not None and join.settings else ReplicaGroups()
        self.replacement = join is not None and join.kind in ("replacement", "done")
        self.peers_finished = join is not None and join.kind == "done"

    def _durable_state(self) -> dict[str, Any]:
        progress = Progress(self._progress, self._load_progress)
        return {"model": self._model, "optim": self._optim, "replica": progress, **self._extra}

    def _torchft(self, restored: int | None) -> Any:
        """The Manager, built last: a Manager that heartbeats but does not join a quorum
        stalls its peers' quorums."""
        from torchft import Manager, ProcessGroupGloo  # noqa: PLC0415 - optional extra
        from torchft.checkpointing.pg_transport import PGTransport  # noqa: PLC0415 - optional extra

        timeout = timedelta(seconds=self.settings.timeout_s)
        pg = ProcessGroupGloo(timeout=timeout)
        manager = Manager(
            pg=pg,
            min_replica_size=self.settings.min_replicas,
            load_state_dict=self._load_heal_state,
            state_dict=self._heal_state,
            replica_id=f"rg_{self.slot}",
            rank=0,  # one worker per replica group (Ray 2.60); Ray's RANK is the global one
            world_size=1,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
        )
        if restored is not None:
            manager.load_state_dict({"step": restored, "batches_committed": self._batches_restored})
        return manager

    # ---- the state a peer sends, the state a checkpoint keeps --------------------------

    def _progress(self) -> dict[str, int]:
        batches = self.manager.batches_committed() if self.manager is not None else self._batches_restored
        return {**self._position.to_dict(), "batches_committed": batches}

    def _load_progress(self, d: dict[str, int]) -> None:
        self._position = pos.Position.from_dict(d)
        self._batches_restored = int(d.get("batches_committed", 0))

    def _heal_state(self) -> dict[str, Any]:
        return {
            "model": self._model.state_dict(),
            "optim": self._optim.state_dict(),
            "position": self._position.to_dict(),
            "extra": {k: v.state_dict() for k, v in self._extra.items()},
        }

    def _load_heal_state(self, sd: dict[str, Any]) -> None:
        self._healed = True
        self._model.load_state_dict(sd["model"])
        self._optim.load_state_dict(sd["optim"])
        self._position = pos.Position.from_dict(sd["position"])
        for k, v in sd["extra"].items():
            self._extra[k].load_state_dict(v)
        logger.info("replica %d healed from a peer, position %s", self.slot, self._position)

    def _quorum(self, *, until: float | None = None) -> None:
        """One try of torchft's synchronous quorum. ``until`` (a ``time.monotonic()``): the
        first quorum of a whole-group start, bounded by then instead of ``timeout_s``; its
        timeout is raised as ReplicaJoinError naming ``start_timeout_s`` (torchft raises a
        failed quorum's error again at every later one: it cannot be tried again). A heal
        from a peer in it is this replica's restore for the goodput timeline, from the start
        of the step's join: it resumed at the peer's step (a replacement of replica 0, the
        timeline's rank, would otherwise claim every step before it as its own, and the
        replaced process's steps as lost)."""
        self._healed = False
        try:
            if until is None:
                self.manager.start_quorum()
            else:
                self.manager.start_quorum(timeout=timedelta(seconds=max(0.0, until - time.monotonic())))
        except Exception as exc:
            # Every peer finished meanwhile (this replica is a replacement, or the last
            # quorums left it out): with min_replicas >= 2 no quorum can form, and torchft's
            # wait ran out. Nothing is left to train.
            if self._told_peers_finished():
                return
            if until is not None and isinstance(exc, TimeoutError):
                raise ReplicaJoinError(
                    f"replica {self.slot} found no quorum of every replica at the whole-group start within "
                    f"{self.settings.start_timeout_s:.0f} s (replica 0 restores the checkpoint first; "
                    "ReplicaGroups(start_timeout_s=...))"
                ) from exc
            raise
        if self._healed:
            now = time.time()
            self._recorder.restored(self.current_step, self._heal_from, now)
            self._heal_from, self._healed_in_join = now, True

    def _join_quorum(self) -> None:
        """The step's quorum (blocking; heals this replica when a participant is ahead). The
        first quorum of a whole-group start, and its wait for every replica, are bounded by
        ``start_timeout_s`` (replica 0 restores the checkpoint before it joins); any other
        wait for peers by ``timeout_s``."""
        self._heal_from, self._healed_in_join = time.time(), False
        first, self._first_quorum = self._first_quorum, False
        starting = first and not self.replacement
        until = time.monotonic() + self.settings.start_timeout_s if starting else None
        self._quorum(until=until)
        if self.peers_finished:
            return
        if not (first or self._unhealed()):
            return
        bound, setting = (
            (self.settings.start_timeout_s, "start_timeout_s") if starting else (self.settings.timeout_s, "timeout_s")
        )
        deadline = until if until is not None else time.monotonic() + bound
        while self._waiting_for_peers():
            if self._told_peers_finished():
                return
            if time.monotonic() > deadline:
                raise ReplicaJoinError(
                    f"replica {self.slot} found {self.manager.num_participants()} of {self.configured} "
                    f"replicas in its quorum after {bound:.0f} s, and none to heal from (ReplicaGroups({setting}=...))"
                )
            time.sleep(self.settings.heartbeat_timeout_s / 4)
            self._quorum(until=until)
            if self.peers_finished:
                return
        if self._unhealed():
            # Every replica is here and none had progress: each was replaced after all of
            # them failed. Replica 0 restores the durable checkpoint in this step (or steps
            # from scratch); this one votes not to commit the step and heals from replica 0
            # at the next quorum, so no replica keeps a step computed from fresh weights.
            self._drop_step = True
        elif first:
            self._drop_step = self._restore_if_no_peer_had_state()

    def _no_progress_yet(self) -> bool:
        """A replacement that has had no progress yet (no peer it met had any) in a job
        that saves and has peers: it waits for a peer to heal from, or for every replica."""
        return (
            bool(self._durable.save_every)  # no checkpoint to lose otherwise
            and self.replacement
            and self.configured > 1
            and self.current_step == 0
        )

    def _unhealed(self) -> bool:
        """Such a replacement other than replica 0: it must not step from scratch, which
        would throw the durable checkpoint that replica 0 restores away."""
        return self.slot != 0 and self._no_progress_yet()

    def _told_peers_finished(self) -> bool:
        """Whether the driver said, since this replica started, that every peer has
        finished (it ends instead of waiting out ``timeout_s`` for a quorum or a peer)."""
        join = worker_join()
        if join is not None and join.kind == "done" and not self.peers_finished:
            logger.info("replica %d: every peer finished while it waited for one; it ends", self.slot)
            self.peers_finished = True
        return self.peers_finished

    def _waiting_for_peers(self) -> bool:
        """Whether this quorum must wait for more replicas. At a whole-group start: for all
        of them (a replica stepping alone from scratch while replica 0 still restores would
        get ahead of the restored step, and replica 0 would heal from it). A replacement
        that has had no progress: for a peer to heal from, or for every replica when none has
        any (its peers died too and are being replaced; two fresh replacements stepping
        together would be such a from-scratch lineage). Replica 0's replacement waits too
        when it has such peers in its quorum, and restores the checkpoint once every
        replica is there: a peer still waiting for the others would be back in the next
        quorum, not in this step's all-reduce. Alone, it restores at once (the replacements
        after it heal from it)."""
        n = self.manager.num_participants()
        if not self.replacement:
            return n < self.configured
        return self._no_progress_yet() and n < self.configured and (self.slot != 0 or n > 1)

    def _restore_if_no_peer_had_state(self) -> bool:
        """After a replacement's first quorum: whether replica 0 restored the durable
        checkpoint because no participant had any progress to heal from."""
        if not self.replacement or self.current_step > 0:
            return False
        step = self._durable.restore_in_quorum()
        if step is None:
            return False
        self.manager.load_state_dict({"step": step, "batches_committed": self._batches_restored})
        logger.warning(
            "replica %d replaced while no peer had progress: restored the checkpoint of step %d; "
            "this step is dropped and the others heal from it",
            self.slot,
            step,
        )
        return True

    # ---- the loop ---------------------------------------------------------------------

    @property
    def current_step(self) -> int:
        """Committed steps of the job (the same on every replica once healed); 0 for a
        replacement whose peers had finished."""
        return self.manager.current_step() if self.manager is not None else 0

    @property
    def position(self) -> pos.Position:
        return self._position

    @property
    def participants(self) -> int:
        """Replicas in the current step's quorum."""
        return self._participants

    def batches(self, total_steps: int) -> Iterator[Any]:
        """This replica's batch of each step until the job committed ``total_steps``.

        Each iteration first joins the step's quorum (blocking; a lagging or new replica is
        healed there). Call :meth:`step` after the backward pass of every batch. Yields
        nothing in a replacement whose peers had finished, and no more once every peer
        finished while this replica waited for a quorum or a peer to heal from (a replica
        the job's last quorums left out): :attr:`peers_finished` then says so."""
        self._total_steps = total_steps
        # The first quorum is joined even at the job's end: a finished job started again
        # restored its last step in replica 0, and the others heal to it there.
        while self.manager is not None and (self.current_step < total_steps or self._first_quorum):
            if self._in_step:
                raise ConfigError("call Replica.step() after the backward pass of each batch")
            self._optim.zero_grad()
            began = time.perf_counter()
            self._join_quorum()
            waited = time.perf_counter() - began
            if self._told_peers_finished():
                return
            if self.current_step >= total_steps and not self._drop_step:  # restored or healed to the end
                # No step left, nor the last step's save: that step's first participant made it.
                # (A dropped step is taken: its peers wait for this replica in its all-reduce.)
                self._rank_in_step = -1
                break
            n, rank = self.manager.num_participants(), self.manager.participating_rank()
            # A quorum of other replicas than the step before (a dead peer timed out, a
            # replacement joined and healed), or a retry: its wait is the failure's cost, not
            # work. Otherwise it is the step's own few milliseconds of coordination.
            changed = (n != self._participants or self._retrying) and not self._healed_in_join
            self._quorum_wait_s = waited if changed else 0.0
            if rank is None:
                raise RuntimeError(f"replica {self.slot} is in no quorum position after a synchronous quorum")
            # Where this step reads: the next epoch when the rest of this one is too short
            # for n replicas. The position itself moves only when the step commits: a retry
            # with fewer replicas may still fit in this epoch.
            at = self._position
            if not pos.epoch_has_step(at, len(self._dataset), n, self._batch_size):
                at = pos.next_epoch(at)
                if not pos.epoch_has_step(at, len(self._dataset), n, self._batch_size):
                    raise ConfigError(
                        f"the dataset has {len(self._dataset)} samples, fewer than one step of {n} replicas "
                        f"× batch_size {self._batch_size}: use a smaller batch_size or a larger dataset"
                    )
            self._participants, self._rank_in_step, self._in_step, self._step_at = n, rank, True, at
            yield self._batch(at, rank, n)
        if self.manager is not None and self.current_step >= total_steps:
            self._save_final()

    def _save_final(self) -> None:
        """At the job's end, the first participant of the last step saves that step when no
        periodic save did: the steps after the last ``save_every`` are kept too. Replica 0,
        unless it was being replaced then: a survivor that ends the job saves in its place.
        A last step that some replicas missed may have been saved already by another
        quorum's first participant; then nothing is saved (``DurableCopy.save_final``)."""
        if self._rank_in_step == 0:
            self._durable.save_final(self.current_step, peers_missed_it=self._participants < self.configured)

    def _batch(self, at: pos.Position, rank: int, n: int) -> Any:
        began = time.perf_counter()
        start, stop = pos.step_span(at, rank, n, self._batch_size)
        order = self._epoch_order(at.epoch)
        batch = self._collate([self._dataset[int(i)] for i in order[start:stop]])
        self._fetch_s = time.perf_counter() - began
        return batch

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, _order.permutation(len(self._dataset), self._seed, epoch, self._shuffle))
        return self._order[1]

    def step(self) -> bool:
        """End the step: the optimizer steps when the quorum commits (every participant has
        its gradients averaged), the data position advances, and replica 0 saves when due.
        Returns whether the step committed (a failed one is retried at the same position)."""
        if not self._in_step:
            raise ConfigError("Replica.step() ends a step that Replica.batches() started")
        self._in_step = False
        began = time.perf_counter()
        self._average_gradients()
        if self._drop_step:
            self._drop_step = False
            self.manager.report_error(_RestoredMidQuorum("replica 0 restored the durable checkpoint in this step"))
        if not self.manager.should_commit():
            self._uncommitted += 1
            logger.warning("step %d did not commit on replica %d; it is retried", self.current_step + 1, self.slot)
            self._recorder.uncommitted()
            self._retrying = True
            if self._uncommitted >= MAX_UNCOMMITTED_STEPS:
                raise ReplicaStepError(
                    f"replica {self.slot}: step {self.current_step + 1} did not commit {self._uncommitted} times in "
                    "a row (its all-reduce or a peer keeps failing; see the warnings before this one)"
                )
            return False
        self._retrying, self._uncommitted = False, 0
        self._optim.step()
        self._position = pos.after_commit(self._step_at, self._participants, self._batch_size)
        if self.slot == 0 and not self._last_step_missed_by_peers():
            self._durable.save_if_due(self.current_step)
        self._recorder.step(
            self.current_step,
            fetch_seconds=self._fetch_s,
            explicit=True,
            capacity=self._participants / self.configured,
            wait_seconds=self._quorum_wait_s,
        )
        logger.debug(
            "step %d committed with %d participants in %.3f s",
            self.current_step,
            self._participants,
            time.perf_counter() - began,
        )
        return True

    def _last_step_missed_by_peers(self) -> bool:
        """The job's last step, committed without every replica: the final save
        (:meth:`_save_final`) saves it, after checking that no peer saved it already in a
        newer generation (replica 0's periodic save would be fenced by it)."""
        total = self._total_steps
        return total is not None and self.current_step >= total and self._participants < self.configured

    def _average_gradients(self) -> None:
        """One all-reduce (mean over the step's participants) of the gradients of every
        parameter that requires one, in the model's order, and of a flag per parameter
        saying whether this replica's batch used it: a parameter without a gradient here is
        sent as zeros, so every participant sends the same layout; one no participant used
        keeps no gradient (as DDP leaves a globally unused parameter), so the optimizer does
        not move it. A failed all-reduce is not raised: torchft records it and the step does
        not commit."""
        params = [p for p in self._model.parameters() if p.requires_grad]
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        used = torch.tensor([p.grad is not None for p in params], dtype=grads[0].dtype)
        flat = torch.cat([g.reshape(-1) for g in grads] + [used])
        self.manager.allreduce(flat).wait()
        offset = 0
        for i, (p, g) in enumerate(zip(params, grads)):
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
            if p.grad is None and flat[-len(params) + i] > 0:
                p.grad = g

    # ---- end ----------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the quorums, then wait for replica 0's last save to commit (a Manager that
        heartbeats but no longer joins would stall its peers' quorums meanwhile). A save of
        replica 0 fenced by the checkpoint of the job's last step is no error (see
        ``DurableCopy.close``)."""
        stepped = self.manager is not None
        try:
            if self.manager is not None:
                self.manager.shutdown(wait=False)
        finally:
            self._durable.close(job_end=self._total_steps)
        if stepped:
            self._recorder.end()  # the ledger's "finished" (only rank 0's recorder writes)

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        # Unwinding an error: leave the quorums at once, release the checkpointer without
        # waiting for its uploads (its handed-over saves commit in the node uploader), record
        # no end of the run, and let the error through as it was (Recovery decides on its
        # type whether a retry can help).
        try:
            if self.manager is not None:
                self.manager.shutdown(wait=False)
        except Exception:
            logger.warning("replica %d: torchft's Manager did not shut down cleanly", self.slot, exc_info=True)
        finally:
            self._durable.release(exc_type, exc, tb)


def _check(model: Any, batch_size: int, save_every: int | None, state: dict[str, Any] | None) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"Replica(model=...) must be a torch.nn.Module, got {type(model).__name__}")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ConfigError("replica mode runs on gloo over CPU tensors in this release; keep the model on the CPU")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"Replica(batch_size=...) must be an int >= 1, got {batch_size!r}")
    if save_every is not None and (isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1):
        raise ConfigError(f"Replica(save_every=...) must be None or an int >= 1, got {save_every!r}")
    for key, value in (state or {}).items():
        if not isinstance(value, Stateful):
            raise ConfigError(f"Replica(state={{{key!r}: ...}}) must hold Stateful values (state_dict/load_state_dict)")
