"""Who am I: the one answer to rank, world size, node and run storage for every component.

Inside a Ray Train worker the answers come from ``ray.train.get_context()``; under plain
``torch.distributed`` from the process group; otherwise this is a single process. The
Checkpointer, the DataLoader and the goodput recorder all ask here, so they never
disagree about the world they run in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ray_goodput._lazy import imported
from ray_goodput.errors import ConfigError
from ray_goodput.storage import StorageLocation, resolve

logger = logging.getLogger(__name__)


def ray_initialized() -> bool:
    """Whether this process called ``ray.init``. One that never imported Ray did not, and
    asking does not import it."""
    ray = imported("ray")
    return ray is not None and ray.is_initialized()


def _ray_train_context() -> Any | None:
    """The Ray Train context of this process, or None outside a Ray Train worker.

    A Ray Train worker imported ``ray.train`` to run its training function; a process
    that never did is not one, and does not pay for the import (it pulls in pandas)."""
    if "ray.train" not in sys.modules:
        return None
    import ray.train  # noqa: PLC0415 - already imported (checked above): a lookup

    try:
        ctx = ray.train.get_context()
        ctx.get_world_rank()  # raises outside a worker (e.g. in the driver)
        return ctx
    except (RuntimeError, AttributeError, ValueError):
        return None


@dataclass(frozen=True)
class WorkerContext:
    """Rank and world of this process, its Ray node, and the Ray Train run directory."""

    rank: int
    world_size: int
    node_id: str | None = None  # Ray node id; None when Ray is not initialized
    in_ray_train: bool = False
    run_storage: Any | None = None  # Ray Train StorageContext (DeveloperAPI) or None

    @staticmethod
    def detect(rank: int | None = None, world_size: int | None = None) -> WorkerContext:
        """This process's context. Explicit ``rank``/``world_size`` (both or neither) must
        match a detected distributed world; they exist for loaders used outside one."""
        if (rank is None) != (world_size is None):
            raise ConfigError(
                "pass both rank= and world_size=, or neither (then they come "
                "from the Ray Train context or torch.distributed)"
            )
        found = _detect()
        if rank is None:
            return found
        if found.world_size > 1 and (rank, world_size) != (found.rank, found.world_size):
            raise ConfigError(
                f"got rank={rank}, world_size={world_size} but this process is "
                f"rank {found.rank} of {found.world_size}; drop the explicit "
                "values or make them match"
            )
        return WorkerContext(rank=rank, world_size=world_size, node_id=found.node_id)

    @property
    def run_root(self) -> StorageLocation | None:
        """The Ray Train run directory (``RunConfig.storage_path/name``), or None."""
        return None if self.run_storage is None else run_root(self.run_storage)

    def storage_root(self, storage_path: str | None) -> StorageLocation:
        """``storage_path`` resolved, or the Ray Train run directory when it is None."""
        if storage_path is not None:
            return resolve(storage_path)
        root = self.run_root
        if root is None:
            raise ConfigError(
                "storage_path=None needs a Ray Train run to take the storage from; outside "
                "Ray Train pass storage_path='s3://bucket/prefix' or a directory"
            )
        return root


def run_root(storage_context: Any) -> StorageLocation:
    """The run directory of a Ray Train ``StorageContext`` (a worker's ``get_storage()``, or
    ``RunConfig.storage_context`` on the driver): the default root of every component."""
    fs = storage_context.storage_filesystem
    root = storage_context.experiment_fs_path
    scheme = "" if fs.type_name == "local" else f"{fs.type_name}://"
    return StorageLocation(uri=f"{scheme}{root}", fs=fs, root=root)


_one = threading.local()


@contextlib.contextmanager
def world_of_one() -> Iterator[None]:
    """While inside (this thread): this process is rank 0 of a world of one, outside any
    Ray Train barrier (``in_ray_train`` False), on its own node and run directory.

    For a component made inside that must act alone: replica mode's durable saver, whose
    peers are other replica groups (Ray Train's world), not ranks of its own save; a
    ``ray.train.report`` there would wait for a replica that is being replaced."""
    before = getattr(_one, "active", False)
    _one.active = True
    try:
        yield
    finally:
        _one.active = before


def _detect() -> WorkerContext:
    found = _detect_world()
    if getattr(_one, "active", False):
        return dataclasses.replace(found, rank=0, world_size=1, in_ray_train=False)
    return found


def _detect_world() -> WorkerContext:
    node_id = imported("ray").get_runtime_context().get_node_id() if ray_initialized() else None
    ctx = _ray_train_context()
    if ctx is not None:
        return WorkerContext(
            rank=ctx.get_world_rank(),
            world_size=ctx.get_world_size(),
            node_id=node_id,
            in_ray_train=True,
            run_storage=ctx.get_storage(),
        )
    dist = imported("torch.distributed")  # a process group needs it imported: no import here
    if dist is not None and dist.is_available() and dist.is_initialized():
        return WorkerContext(rank=dist.get_rank(), world_size=dist.get_world_size(), node_id=node_id)
    return WorkerContext(rank=0, world_size=1, node_id=node_id)
