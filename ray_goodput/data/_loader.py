"""DataLoader over cached datasets with an exact, tiny, world-size-independent position."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch.utils.data

from ray_goodput.data import _partition as part
from ray_goodput.data._cache_client import CacheClient
from ray_goodput.data._datasets import CachedDataset
from ray_goodput.data._file_readers import CacheReader
from ray_goodput.errors import ConfigError, DataError
from ray_goodput.goodput import get_recorder
from ray_goodput.runtime import WorkerContext, pid_alive

logger = logging.getLogger(__name__)
STATE_KEYS = ("epoch", "consumed", "seed", "fingerprint")
#: Above a dataset's 63-bit fingerprint, a loader state's says whether its epochs were
#: shuffled: ``_ORDERED`` marks a state that records it (one saved before does not), and
#: ``_UNSHUFFLED`` is set for ``shuffle=False``.
_FILES = (1 << 63) - 1
_ORDERED = 1 << 63
_UNSHUFFLED = 1 << 64
#: Set in a state whose seed is outside [0, 2**32): its order used the whole seed. Earlier
#: versions used its low 32 bits (another order), and saved states without this bit.
_WIDE_SEED = 1 << 65
#: How often a loader worker checks that its rank is still alive.
_RANK_POLL_S = 0.1


class _ExitWithRank:
    """``worker_init_fn`` of every loader worker: the worker exits within
    ``_RANK_POLL_S`` of its rank's death, SIGKILL included.

    A forked worker holds the rank's inherited sockets, so Ray sees a killed rank die only
    once its workers are gone too; torch's own workers look for a dead parent only at
    their next 5 s status check, and every failure of a rank cost those seconds of restart.
    """

    def __init__(self) -> None:
        self.rank_pid = os.getpid()  # set again by each ``__iter__``, in the rank that iterates

    def __call__(self, worker_id: int) -> None:
        if os.getppid() != self.rank_pid:
            if not pid_alive(self.rank_pid):  # orphaned before this ran: the rank is gone
                os._exit(0)
            return  # started by a fork server: its parent is not the rank
        threading.Thread(target=self._watch, name="rg-loader-exit-with-rank", daemon=True).start()

    def _watch(self) -> None:
        while os.getppid() == self.rank_pid:
            time.sleep(_RANK_POLL_S)
        os._exit(0)


class _EpochBatchSampler(torch.utils.data.Sampler):
    """This rank's batches of the epoch from position ``consumed`` (see ``_partition``)."""

    def __init__(self, dataset: CachedDataset, batch_size: int, rank: int, world: int) -> None:
        self.dataset, self.batch_size, self.rank, self.world = dataset, batch_size, rank, world
        self.epoch = 0
        self.consumed = 0

    def spans(self) -> list[tuple[int, int]]:
        return part.rank_spans(len(self.dataset), self.consumed, self.rank, self.world, self.batch_size)

    def rank_order(self) -> np.ndarray:
        """This rank's samples for the rest of the epoch, in order. Shape: (steps * B,)."""
        perm = self.dataset.permutation(self.epoch)
        spans = self.spans()
        return np.concatenate([perm[a:b] for a, b in spans]) if spans else perm[:0]

    def __iter__(self) -> Iterator[list[int]]:
        # Eager snapshot: the loader moves ``consumed`` while torch still draws batches.
        order = self.rank_order().reshape(-1, self.batch_size)
        return iter(order.tolist())

    def __len__(self) -> int:
        return part.steps_left(len(self.dataset), self.consumed, self.world, self.batch_size)


class DataLoader(torch.utils.data.DataLoader):
    """A torch DataLoader for :class:`FileDataset` / :class:`ParquetDataset`.

    Each rank gets ``batch_size`` samples per step; the ragged tail of an epoch (fewer
    than ``world_size * batch_size`` samples) is dropped on every rank, so all ranks run
    the same number of steps. ``rank``/``world_size`` default to the Ray Train context
    (else torch.distributed, else 0/1). Iterating runs the rest of the current epoch,
    then moves to the next. ``state_dict()`` at a step boundary resumes exactly, at any
    world size; the object is a DCP ``Stateful``. ``last_fetch_seconds`` is how long the
    last ``next()`` waited for its batch; ``total_fetch_seconds`` sums them.
    """

    def __init__(
        self,
        dataset: CachedDataset,
        batch_size: int,
        *,
        num_workers: int = 2,
        rank: int | None = None,
        world_size: int | None = None,
        collate_fn: Callable[[list], Any] | None = None,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        multiprocessing_context: Any = None,
        timeout: float = 0.0,
    ) -> None:
        if not isinstance(dataset, CachedDataset):
            raise ConfigError(
                f"ray_goodput.data.DataLoader needs a FileDataset or ParquetDataset, got {type(dataset).__name__}"
            )
        ctx = WorkerContext.detect(rank, world_size)
        rank, world = ctx.rank, ctx.world_size
        part.check_world(rank, world, batch_size)
        if len(dataset) < part.global_batch(world, batch_size):
            raise DataError(
                f"the dataset has {len(dataset)} samples, fewer than one step of "
                f"world_size*batch_size = {world}*{batch_size}; lower batch_size"
            )
        self._cache = CacheClient(dataset.cache) if dataset.cache is not None else None
        self._cache_reader: CacheReader | None = None
        if self._cache is not None:
            self._cache_reader = CacheReader(self._cache.layout, self._cache.capacity_bytes, dataset.retry)
            dataset.use_reader(self._cache_reader)
            self._fileset_id = self._cache.register(dataset.files)
        self._rg_sampler = _EpochBatchSampler(dataset, batch_size, rank, world)
        self._window = (dataset.cache.lookahead if dataset.cache else 0) + batch_size * max(1, num_workers) * (
            prefetch_factor or 2
        )
        self.last_fetch_seconds = 0.0
        self.total_fetch_seconds = 0.0
        self.steps = 0
        super().__init__(
            dataset,
            batch_sampler=self._rg_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            timeout=timeout,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            multiprocessing_context=multiprocessing_context,
            worker_init_fn=_ExitWithRank() if num_workers else None,
        )

    @property
    def epoch(self) -> int:
        return self._rg_sampler.epoch

    @property
    def consumed(self) -> int:
        """Samples of the current epoch taken by all ranks together (global position)."""
        return self._rg_sampler.consumed

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; no-op when it is the current epoch (so a
        resumed position is kept by ``for e in range(...): loader.set_epoch(e)``)."""
        if epoch != self._rg_sampler.epoch:
            self._rg_sampler.epoch, self._rg_sampler.consumed = int(epoch), 0

    def __len__(self) -> int:
        """Steps left in the current epoch."""
        return len(self._rg_sampler)

    def __iter__(self) -> Iterator[Any]:
        s = self._rg_sampler
        start, gb = s.consumed, part.global_batch(s.world, s.batch_size)
        hints = (
            _Hints(
                self._cache,
                self._fileset_id,
                self.dataset,
                s.rank_order(),
                window=self._window,
                batch_size=self._rg_sampler.batch_size,
            )
            if self._cache is not None
            else None
        )
        if isinstance(self.worker_init_fn, _ExitWithRank):  # the rank: the process starting the workers
            self.worker_init_fn.rank_pid = os.getpid()
        inner = super().__iter__()
        recorder = get_recorder()
        delivered = 0
        while True:
            began = time.perf_counter()  # the hint below re-creates a dead cache actor: a data stall too
            if hints is not None:
                hints.advance(delivered * s.batch_size)
            try:
                batch = next(inner)
            except StopIteration:
                break
            self.last_fetch_seconds = time.perf_counter() - began
            self.total_fetch_seconds += self.last_fetch_seconds
            recorder.add_fetch(self.last_fetch_seconds)  # data stall, for the goodput ledger
            self.steps += 1
            delivered += 1
            s.consumed = start + delivered * gb  # == part.consumed_after(start, delivered, ...)
            yield batch
        s.epoch, s.consumed = s.epoch + 1, 0
        if self._cache_reader is not None:
            self._cache_reader.journal.flush()  # hits of this process, for stats

    def state_dict(self) -> dict[str, int]:
        """``{epoch, consumed, seed, fingerprint}``; take it at a step boundary."""
        s = self._rg_sampler
        return {"epoch": s.epoch, "consumed": s.consumed, "seed": s.dataset.seed, "fingerprint": _order(s.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``state`` (from any world size). Raises DataError when it was saved
        for another dataset or seed."""
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise DataError(f"loader state lacks {missing}; pass what state_dict() returned")
        s = self._rg_sampler
        saved = int(state["fingerprint"])
        if saved & _FILES != s.dataset.fingerprint:
            raise DataError(
                f"loader state was saved for another dataset (fingerprint "
                f"{saved & _FILES} != {s.dataset.fingerprint}); point "
                "the dataset at the same files, or do not load this state"
            )
        if saved & _ORDERED and bool(saved & _UNSHUFFLED) == s.dataset.shuffle:
            raise DataError(
                f"loader state was saved with shuffle={not s.dataset.shuffle} but the dataset has "
                f"shuffle={s.dataset.shuffle}: a position in one order resumed in the other repeats "
                "samples and skips others; use the same shuffle"
            )
        if int(state["seed"]) != s.dataset.seed:
            raise DataError(
                f"loader state was saved with seed={int(state['seed'])} but the "
                f"dataset has seed={s.dataset.seed}; use the same seed"
            )
        if _wide(s.dataset.seed) and not saved & _WIDE_SEED and s.dataset.shuffle and int(state["consumed"]):
            raise DataError(
                f"loader state was saved by an earlier ray_goodput, which shuffled with the low 32 bits "
                f"of seed={s.dataset.seed} only; this version's order for that seed differs, so resuming "
                "would repeat samples and skip others: finish the epoch with that version, or drop the "
                "loader state (the epoch starts over)"
            )
        part.check_resume(len(s.dataset), int(state["consumed"]))
        s.epoch, s.consumed = int(state["epoch"]), int(state["consumed"])

    def close(self) -> None:
        """Release the link to the node cache (the cache itself keeps running)."""
        if self._cache is not None:
            self._cache.close()


def _order(dataset: CachedDataset) -> int:
    """The fingerprint a loader state carries: the dataset's, and whether its epochs are
    shuffled (the order a position counts in)."""
    return (
        dataset.fingerprint
        | _ORDERED
        | (0 if dataset.shuffle else _UNSHUFFLED)
        | (_WIDE_SEED if _wide(dataset.seed) else 0)
    )


def _wide(seed: int) -> bool:
    """Whether ``seed`` is outside [0, 2**32), where earlier versions' orders differ."""
    return not 0 <= seed < 1 << 32


class _Hints:
    """Announces this rank's next files to the node cache, a window ahead of the loop."""

    def __init__(
        self, cache: CacheClient, fileset_id: int, dataset: Any, order: np.ndarray, *, window: int, batch_size: int
    ) -> None:
        self._cache, self._fileset_id, self._dataset = cache, fileset_id, dataset
        self._order, self._sent, self._window = order, 0, window
        self._chunk = max(batch_size, window // 4)

    def advance(self, position: int) -> None:
        upto = min(len(self._order), position + self._window)
        if upto - self._sent >= self._chunk or (upto == len(self._order) > self._sent):
            files = self._dataset.file_indices(self._order[self._sent : upto])
            self._cache.prefetch(self._fileset_id, files)
            self._sent = upto
