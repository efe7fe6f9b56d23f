"""Collectives that make every rank reach the same outcome: gather, broadcast, and
"raise the same error everywhere" (never one rank raising while another enters a barrier).
Outside a process group (one rank) they are identities.

A tagged collective (:func:`gather_tagged`, :func:`agree`, :func:`on_rank0`) opens with one all-reduce of
three integers: the tag's code, its negation and a flag, reduced by MAX. Every rank then
knows whether all of them are at the same call (the max of the codes and the max of the
negated codes both give back its own code only when every code is equal) and the max of
the flags. :func:`agree` is that one all-reduce when no rank failed (cheaper than pickling
objects through two all-gathers); the errors are gathered only when
some rank has one.
"""

from __future__ import annotations

import logging
import pickle
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ray_goodput.errors import CheckpointCorruptError, CheckpointError

logger = logging.getLogger(__name__)
T = TypeVar("T")


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_gather(obj: Any) -> list[Any]:
    if not distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _tag_code(tag: str) -> int:
    return zlib.crc32(tag.encode()) + 1  # positive: 0 would be read as "some rank at another call"


def _header(tag: str, flag: bool) -> bool:
    """Collective: every rank's ``(tag, flag)`` in one all-reduce; the max of the flags, or
    the same CheckpointError on every rank when the ranks are at different calls."""
    code = _tag_code(tag)
    box = torch.tensor([code, -code, int(flag)], dtype=torch.int64, device=_device())
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    top_code, top_negated, top_flag = box.tolist()
    if top_code != code or top_negated != -code:  # seen alike by every rank
        tags = all_gather(tag)
        raise CheckpointError(
            f"ranks reached different checkpoint collectives ({', '.join(sorted(set(tags)))}): "
            "every rank must call save/wait/restore at the same points with a state of the same "
            "structure (change the model or optimizer on every rank at the same step)"
        )
    return bool(top_flag)


def _device() -> torch.device:
    """Where the default group reduces tensors: the CPU under a CPU backend (gloo, MPI,
    UCC) or a group that names one for the CPU (``cpu:gloo,cuda:nccl``), else this
    process's current accelerator (NCCL takes no CPU tensor)."""
    backend = str(dist.get_backend())
    if backend in ("gloo", "mpi", "ucc") or "cpu:" in backend:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def gather_tagged(tag: str, obj: Any) -> list[Any]:
    """``all_gather`` of ``obj`` once every rank is known to be at this ``tag``'s call;
    raises the same CheckpointError on every rank when the ranks were not at the same call
    (a rank that re-planned alone, say), instead of reading one call's data as another's."""
    if not distributed():
        return [obj]
    _header(tag, True)
    return all_gather(obj)


def broadcast(obj: Any, src: int = 0) -> Any:
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle round trip (our errors do), else a CheckpointError
    (or CheckpointCorruptError) with its type and message."""
    try:
        copy = pickle.loads(pickle.dumps(exc))  # noqa: S301 - our own bytes
        if isinstance(copy, BaseException) and str(copy) == str(exc):
            return copy
    except Exception:  # noqa: BLE001 - anything unpicklable is rewrapped
        pass
    cls = CheckpointCorruptError if isinstance(exc, CheckpointCorruptError) else CheckpointError
    return cls(f"{type(exc).__name__}: {exc}")


def agree(error: BaseException | None) -> None:
    """Collective: raise on every rank when any rank has an ``error``; the same type and
    message everywhere (the first failing rank's; the one that raised it keeps its own
    traceback). A damaged checkpoint anywhere wins, so every rank falls back together.
    One small all-reduce when no rank failed; the errors are gathered only when one did."""
    if not distributed():
        if error is not None:
            raise error
        return
    if not _header("agree", error is not None):
        return
    gathered = all_gather(None if error is None else (type(error).__name__, portable(error)))
    failed = [(rank, g) for rank, g in enumerate(gathered) if g is not None]
    corrupt = [(r, g) for r, g in failed if isinstance(g[1], CheckpointCorruptError)]
    rank, (_, exc) = (corrupt or failed)[0]
    if error is not None and rank == _my_rank():
        raise error
    raise exc from error


def on_rank0(fn: Callable[[], T], what: str) -> T:
    """Collective: run ``fn`` on rank 0 and give every rank its value, or raise its error
    on every rank. Tagged by ``what`` (one header all-reduce first): a rank at another
    call raises the same CheckpointError as rank 0 instead of reading its value."""
    if distributed():
        _header(what, True)
    result: tuple[str, Any] = ("ok", None)
    if not distributed() or dist.get_rank() == 0:
        try:
            result = ("ok", fn())
        except Exception as exc:  # raised on every rank below
            logger.warning("%s failed on rank 0: %s", what, exc)
            if not distributed():
                raise
            result = ("error", portable(exc))
    status, value = broadcast(result)
    if status == "error":
        raise value
    return value


def _my_rank() -> int:
    return dist.get_rank() if distributed() else 0
