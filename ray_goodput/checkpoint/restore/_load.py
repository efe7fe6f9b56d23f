"""Loading a committed checkpoint into live objects, local copy first."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from ray_goodput.checkpoint.protocol import _catalog, _collective, _layout
from ray_goodput.checkpoint.protocol._dcp_parts import data_file, keys_digest
from ray_goodput.checkpoint.protocol._manifest import Manifest, is_quarantined, read_manifest, read_quarantine
from ray_goodput.checkpoint.restore._local_precheck import LocalGuess
from ray_goodput.checkpoint.restore._prefetch import Countdown, close_result
from ray_goodput.checkpoint.restore._reader import TieredReader
from ray_goodput.checkpoint.save import _state_dict
from ray_goodput.errors import CheckpointCorruptError, CheckpointError, StateMismatchError
from ray_goodput.storage import RetryPolicy, StorageLocation

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreInfo:
    """What the last restore did. ``seconds`` is wall time of the whole load."""

    step: int
    saved_world_size: int
    world_size: int
    seconds: float
    local_files: int
    remote_files: int
    rng_restored: bool
    #: Tensors read straight into the live state (the rest went through DCP's own read).
    direct_tensors: int = 0
    #: Bytes this rank read from storage (not counting the node-local copy).
    remote_bytes: int = 0


def local_candidates(local_dir: Path, manifest: Manifest) -> set[str]:
    """Names of manifest files present in the node-local copy with the right size (a
    ``stat`` each; their checksums are checked when, and only if, this rank opens them)."""
    found = set()
    for entry in manifest.files:
        try:
            if (local_dir / entry.name).stat().st_size == entry.size:
                found.add(entry.name)
        except OSError:
            continue
    return found


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and, for DCP's CheckpointException, every rank's exception in it."""
    failures = exc.failures.values() if isinstance(exc, CheckpointException) else ()
    return [exc, *(f[0] if isinstance(f, tuple) else f for f in failures)]


def _ranked(exc: CheckpointException, rank: int) -> Exception:
    """DCP's exception as ours, naming this rank (a damaged file stays recognizable)."""
    corrupt = any(isinstance(e, CheckpointCorruptError) for e in _causes(exc))
    cls = CheckpointCorruptError if corrupt else CheckpointError
    ranked = cls(f"rank {rank}: {exc}")
    ranked.__cause__ = exc
    return ranked


def _check_fits(template: dict[str, Any], metadata: Metadata, step: int, uri: str) -> None:
    """Raise StateMismatchError when a leaf of ``template`` is missing from the checkpoint
    or has another global shape (a retry cannot fix that)."""
    flat, _ = flatten_state_dict(template)
    saved = metadata.state_dict_metadata
    for fqn, value in flat.items():
        entry = saved.get(fqn)
        problem = None
        if entry is None:
            problem = f"it has no {fqn!r}"
        elif (
            isinstance(value, torch.Tensor)
            and isinstance(entry, TensorStorageMetadata)
            and tuple(entry.size) != tuple(value.shape)
        ):
            problem = f"{fqn!r} is {tuple(entry.size)} there, {tuple(value.shape)} here"
        if problem is not None:
            raise StateMismatchError(
                f"checkpoint step {step} at {uri} does not match the state passed to restore "
                f"({problem}); a retry cannot fix this: restore into the same model/optimizer "
                "structure, or use another storage_path"
            )


def _loads_everything(template: dict[str, Any], metadata: Metadata) -> bool:
    """Whether ``template`` loads every entry of the checkpoint (not, e.g., the model
    alone from a model + optimizer checkpoint)."""
    return set(flatten_state_dict(template)[0]) == set(metadata.state_dict_metadata)


def _read_rng(reader: TieredReader, rank: int, save_id: str) -> bytes:
    with reader.fs.create_stream(_layout.extras_file(rank, save_id), "rb") as f:
        return f.read()


def load_checkpoint(
    state: dict[str, Any],
    *,
    root: StorageLocation,
    manifest: Manifest,
    staging: Path,
    rank: int,
    world_size: int,
    policy: RetryPolicy,
    guess: LocalGuess | None = None,
) -> RestoreInfo:
    """Load ``manifest``'s checkpoint into ``state`` (in place). Collective across ranks.

    RNG states are per rank and only meaningful for the world size that saved them:
    they are restored when the world size is unchanged, left alone otherwise. No file is
    loaded before every rank checked all of its files: a failure up to then (a damaged or
    missing file, storage down) leaves the live state as it was, and an optimizer that had
    no state gets none (building the state dict to load into gives a never-stepped
    optimizer zero moments and step 1). A failure while copying, after that agreement,
    raises on every rank too but can leave the state partly loaded. The outcome is agreed
    last (a rank's copy can fail while the others' succeed); the load's background work
    (writing fetched files into the node-local copy, unmapping) starts after that.
    ``guess``: the rank's own node-local data file, checked while the checkpoint was
    chosen (taken when it is this one's and read whole).
    """
    readers: list[TieredReader] = []
    error: BaseException | None = None
    info: RestoreInfo | None = None
    try:
        try:
            roles = _state_dict.classify(state)
            with _state_dict.made_up_state(roles, keep=True):  # a failed load leaves them as they were
                info = _load(
                    roles,
                    state,
                    root=root,
                    manifest=manifest,
                    staging=staging,
                    rank=rank,
                    world_size=world_size,
                    policy=policy,
                    readers=readers,
                    guess=guess,
                )
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - agreed below
            error = exc if isinstance(exc, Exception) else CheckpointError(f"{type(exc).__name__}: {exc}")
        _collective.agree(error)
    finally:  # also when interrupted: the node-local copy, the unmapping and the marker's removal
        for reader in readers:
            _let_go(reader)
    if info is None:  # unreachable: a rank without its info had an error, raised by agree
        raise CheckpointError(f"rank {rank}: the load of step {manifest.step} ended without a result")
    return info


def _let_go(reader: TieredReader) -> None:
    """Release ``reader`` and start its background work. Never raises: the outcome was
    agreed, and an error only this rank raised here would leave it alone in the collective
    its caller makes next (``Checkpointer.restore`` checks a failed load on every rank)."""
    if not reader.released:
        try:
            reader.release(defer=True)
        except Exception:  # the agreed outcome stands
            logger.warning("could not release the restore's reader", exc_info=True)
    try:
        reader.start_deferred()
    except Exception:  # e.g. no thread could start: the agreed outcome stands
        logger.warning("could not start the restore's background work (node-local copy, unmapping)", exc_info=True)


@dataclass
class _Opened:
    """What a rank has before DCP reads: the state dict to load into, the reader of the
    checkpoint's files, the rank's RNG blob (None when the world size changed), or the
    error that stopped it (agreed with the other ranks at the load's one agreement)."""

    template: dict[str, Any] | None = None
    reader: TieredReader | None = None
    rng: Any = None
    error: BaseException | None = None


def _open(
    roles: _state_dict.Roles,
    *,
    step_loc: StorageLocation,
    local_dir: Path,
    manifest: Manifest,
    rank: int,
    world_size: int,
    policy: RetryPolicy,
    readers: list[TieredReader],
    guess: LocalGuess | None,
) -> _Opened:
    """Open the checkpoint for this rank's load: its reader (its own files fetched early),
    the metadata read and checked against the state, and the RNG blob read and checked."""
    opened = _Opened()
    try:
        template = opened.template = _state_dict.to_state_dict(roles)
        local = local_candidates(local_dir, manifest) if local_dir.is_dir() else set()
        local_dir.mkdir(parents=True, exist_ok=True)
        unchanged_world = manifest.world_size == world_size
        # At an unchanged world size, a state that loads every entry of the checkpoint reads
        # the rank's own data file whole (one that loads only some of it reads only the
        # blocks it needs; a layout changed at the same world size, e.g. FSDP to TP, also
        # reads it whole). The manifest's digest of the entry names tells before the
        # metadata is read; older manifests have none, and the metadata tells.
        everything = bool(manifest.state_keys) and manifest.state_keys == keys_digest(flatten_state_dict(template)[0])
        reader = opened.reader = _reader(
            step_loc, local_dir, local, manifest, policy, guess, whole=unchanged_world and everything
        )
        readers.append(reader)
        if unchanged_world:  # the RNG blob, and the data file: fetched while the metadata is read
            reader.fs.fetch_early(
                [_layout.extras_file(rank, manifest.save_id)]
                + ([data_file(rank, manifest.save_id)] if everything else [])
            )
        metadata = reader.read_metadata()
        _state_dict.fit_plain_tensors(template, metadata.state_dict_metadata)
        _check_fits(template, metadata, manifest.step, step_loc.uri)
        if unchanged_world and not everything and _loads_everything(template, metadata):
            reader.fs.fetch_early([data_file(rank, manifest.save_id)])  # fetched while DCP plans
        # Read (and check) this rank's RNG blob before any weight is loaded in place: a
        # damaged one must fail the restore while the live state is still untouched.
        opened.rng = _read_rng(reader, rank, manifest.save_id) if unchanged_world else None
    except Exception as exc:  # noqa: BLE001 - agreed in the read's agreement (_load)
        opened.error = exc
    return opened


def _load(
    roles: _state_dict.Roles,
    state: dict[str, Any],
    *,
    root: StorageLocation,
    manifest: Manifest,
    staging: Path,
    rank: int,
    world_size: int,
    policy: RetryPolicy,
    readers: list[TieredReader],
    guess: LocalGuess | None,
) -> RestoreInfo:
    start = time.perf_counter()
    step_loc = _catalog.step_location(root, manifest.step)
    opened = _open(
        roles,
        step_loc=step_loc,
        local_dir=staging / _layout.step_dir(manifest.step),
        manifest=manifest,
        rank=rank,
        world_size=world_size,
        policy=policy,
        readers=readers,
        guess=guess,
    )
    template, reader, rng = opened.template, opened.reader, opened.rng
    _read_agreed(template, reader, opened.error, rank)
    _state_dict.apply_state_dict(roles, template, state)
    _state_dict.forget_state(roles, manifest.unstepped)
    same_world = rng is not None
    if same_world:
        _state_dict.restore_rng(rng)
    else:
        logger.info("world size changed %d -> %d: per-rank RNG states not restored", manifest.world_size, world_size)
    info = RestoreInfo(
        step=manifest.step,
        saved_world_size=manifest.world_size,
        world_size=world_size,
        seconds=time.perf_counter() - start,
        local_files=reader.local_reads,
        remote_files=reader.remote_reads,
        rng_restored=same_world,
        direct_tensors=reader.direct_tensors,
        remote_bytes=reader.remote_bytes,
    )
    logger.info(
        "rank %d restored step %d in %.2fs (%d local, %d remote file reads)",
        rank,
        info.step,
        info.seconds,
        info.local_files,
        info.remote_files,
    )
    return info


def _read_agreed(
    template: dict[str, Any] | None, reader: TieredReader | None, error: BaseException | None, rank: int
) -> None:
    """Collective: DCP reads ``template`` in place through ``reader``; every rank raises
    alike when any failed (``error``: this rank's, from opening the checkpoint).

    DCP plans each rank's reads from the metadata alone (no collective: the global load
    plan of DCP's default planner is the local ones, unchanged). The load's one agreement
    is in the reader's read_data, once every rank checked its files and before any copies
    a byte; a rank that failed before it (metadata, RNG blob, planning) joins that
    agreement with its error, so no rank waits in it alone."""
    if error is None:
        try:  # dcp.load without its Stateful handling (the template has none) and its warning
            _load_state_dict(template, storage_reader=reader, no_dist=True)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's is a BaseException; agreed below
            # What the file agreement raised is the failing rank's own error; DCP's wrapping
            # of a failure here names rank 0 (one process, as it sees it): say which.
            agreed = reader.agreed_error if reader is not None else None
            error = agreed or (exc if isinstance(exc, Exception) else _ranked(exc, rank))
    try:  # every error here is classified already: DCP's wrapping was replaced above
        if reader is None or not reader.read_agreed:
            _collective.agree(error)
        if error is not None:
            raise error
    finally:
        if reader is not None:  # drop what was fetched early; unmapping waits (load_checkpoint)
            reader.release(defer=True)


def _reader(
    step_loc: StorageLocation,
    local_dir: Path,
    local: set[str],
    manifest: Manifest,
    policy: RetryPolicy,
    guess: LocalGuess | None,
    *,
    whole: bool,
) -> TieredReader:
    """The load's reader, with the guess's check of the rank's own data file as one of its
    early fetches when it is this checkpoint's and read ``whole`` (``_local_precheck``)."""
    entries = {f.name: f for f in manifest.files}
    taken = guess.take(manifest.step, local_dir, entries, whole=whole) if guess is not None else None
    if taken is None:
        return TieredReader(step_loc, local_dir, local, entries, policy, verified=False)
    name, check, guard = taken
    try:
        reader = TieredReader(step_loc, local_dir, local, entries, policy, verified=False, guard=guard)
    except BaseException:
        guess.stop()
        readers = Countdown(guard.done)
        check.add_done_callback(functools.partial(close_result, let_go=readers.hold()))
        readers.arm()
        raise
    reader.fs.early.adopt(name, check, guess.stop)
    return reader


def failed_load_verdict(
    root: StorageLocation,
    manifest: Manifest,
    error: BaseException,
) -> Literal["gone", "damaged", "failed"]:
    """Rank 0, after every rank agreed that loading ``manifest``'s checkpoint failed with
    ``error``: ``"gone"`` when that commit no longer stands in storage (pruned since it was
    chosen, or committed again: choose again, nothing is damaged); else ``"damaged"`` for a
    damaged checkpoint, quarantined here (fall back below it), and ``"failed"`` for any
    other error (raise it). Never raises: a storage error while looking is logged, and the
    load's error is taken as it is."""
    loc = _catalog.step_location(root, manifest.step)
    try:
        current = read_manifest(loc)
        stands = current is not None and current.digest == manifest.digest
    except CheckpointCorruptError:
        stands = False  # COMMITTED rewritten since, and torn: not the commit that was chosen
    except Exception as exc:  # noqa: BLE001 - the load's own error is what counts
        logger.warning("could not check whether step %d is still committed at %s: %s", manifest.step, loc.uri, exc)
        stands = True
    if not stands:
        return "gone"
    if not isinstance(error, CheckpointCorruptError):
        return "failed"
    try:  # best effort: the fall-back happens whether or not the marker is written
        _catalog.quarantine_damaged(loc, manifest, str(error)[:500])
    except Exception as exc:  # noqa: BLE001 - logged; the next reader finds the damage again
        logger.warning("could not quarantine step %d at %s: %s", manifest.step, loc.uri, exc)
    return "damaged"


def choose(
    root: StorageLocation, *, step: int | None, before: tuple[int, int] | None, checksums: bool, hint: int | None = None
) -> Manifest | None:
    """Rank 0's pick: exactly ``step`` when the driver decided one (or, when that one is
    damaged, the newest intact checkpoint below it, never a newer one; CheckpointError when
    it is gone from storage and nothing intact is below it); else the newest intact
    committed checkpoint below ``before``. ``hint``: the step the pick likely is
    (its commit is read beside the listing, see ``_catalog.newest_valid``)."""
    gone = False  # the driver's step has no commit any more (not: found damaged)
    if step is not None and before is None:
        loc = _catalog.step_location(root, step)
        try:  # the commit and the size check's listing side by side (a restart's usual path)
            manifest, present = _catalog.read_beside_listing(loc)
            gone = manifest is None
        except CheckpointCorruptError as exc:
            manifest, present = None, {}
            _catalog.quarantine_damaged(loc, None, str(exc))
        if manifest is not None and _layout.QUARANTINED in present and is_quarantined(manifest, read_quarantine(loc)):
            before = manifest.order  # found damaged since the driver chose it: never restored
        elif manifest is not None:
            problems = _catalog.verify(loc, manifest, checksums=checksums, present=present)
            if problems:  # listed beside the read, maybe before the commit (an orphan finished
                problems = _catalog.verify(loc, manifest, checksums=checksums)  # meanwhile): look again
            if not problems:
                return manifest
            _catalog.quarantine_damaged(loc, manifest, "; ".join(problems[:5]))
            before = manifest.order
        logger.warning("the step the driver chose (%d) is not intact; falling back to an older one", step)
    found = _catalog.newest_valid(
        root,
        checksums=checksums,
        before=before,
        hint=hint,
        max_step=(step if before is not None else step - 1) if step is not None else None,
    )
    if found is None and gone:  # committed when the driver chose it: never a fresh start for want of it
        raise CheckpointError(
            f"the checkpoint the driver chose to resume from (step {step}) is no longer in storage, nor an "
            "intact one below it (a dead attempt's late retention pruned them); this attempt fails so that "
            "the restart's new decision takes what storage holds now"
        )
    return found[1] if found else None
