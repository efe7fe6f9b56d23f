"""Randomized fault soak: do committed checkpoints survive any timing of failures?

Each trial is one short training job on real processes (``ray_goodput.testing.run_world``:
gloo; Ray only for the uploader actor): a tiny MLP with AdamW, a ``ray_goodput.data``
FileDataset of 16 one-file samples read by the library's DataLoader (4 samples per global
step whatever the world size, 8 steps = 2 epochs), a ``Checkpointer`` (the in-process
thread uploader, or the node's uploader actor for the production-path kinds). Run 1 gets a fault; resume
runs follow until the schedule completes. Gradients are summed per sample in global sample
order, so the weights do not depend on the world size: a run that resumed at another world
size must still match a failure-free run bit for bit.

Fault kinds (one per trial, rotated in a seeded order so any ``--trials`` >= 18 runs each):
``kill_step`` (SIGKILL of one rank at a random step: mid-step, before/after ``save``, after
``wait``); ``kill_random_time`` (a timer kills a rank 0-0.1 s after a save returned, while
its snapshot is written/uploaded/committed: the thread uploader dies with its worker);
``hook:<phase>`` (the library's named fault points, ``RAY_GOODPUT_FAULT=<phase>:1``, armed in
the chosen rank right before a chosen save); ``uploader_kill_ray`` (the
node's CheckpointUploader actor is killed 0-0.1 s after a save); ``flaky_storage`` (moto's S3
server behind ``FlakyProxy`` failing 5-20 % of requests, plus a kill); ``damage_truncate`` /
``damage_bitflip`` (a file of the newest committed checkpoint is cut in half or has one bit
flipped between runs); ``late_commit`` (the newest committed checkpoint is turned back into
an orphan whose ranks are all durable and hidden; in the middle of the resumed run its files
come back and it is committed, as a dead attempt's uploader would); ``world_change`` (2->1
or 1->2 on resume); ``fast_saves`` (a save every step, never waiting). Four kinds run the
production path, the node's ``CheckpointUploader`` actor over its socket channel at world
>= 2 (the others run ``uploader="thread"``): ``uploader_kill_ray``; ``worker_kill_actor`` (a
timer kills a rank 0-0.1 s after a save, while the actor uploads its shard to S3 at 50 ms a
request); ``storage_outage`` (after a drawn step, once connected to its uploader, rank 0
has the soak take S3 down, every connection reset, for ``--outage-s`` 1-20 s; the saves
after it meet the outage); and
``staging_full`` (the staging dir is a tmpfs filled to its last byte, so each shard goes to
storage from memory; mounting it needs root). Every trial also draws
``keep_last`` in {1, 2, 3}, a world-size schedule, a save cadence (every 2 steps; every 2
steps + ``wait``; every step), local or S3 storage (S3: 0-20 % failed requests), whether the
resumed run is on the same node (staging dir kept) and ``verify_checksums``.

When a rank dies the others are killed 0-0.3 s later (Ray Train restarts the whole group);
when a rank raises, the others get ``--grace`` seconds to raise too.

Invariants, checked after every run and at the end of each trial:

- ``restore`` returns at least the newest intact committed step (orphans whose ranks are all
  durable count), never an uncommitted step, and the state it loads equals, bit for bit,
  the failure-free state at that step (never a mixed or damaged one);
- no intact committed checkpoint disappears unless ``keep_last`` newer intact ones exist;
- the last saved step is committed and intact once the final run returned from ``close``;
- the final weights equal those of a failure-free run with the same world-size schedule,
  and every step's state and samples equal that run's; each sample is seen exactly once
  per epoch;
- a run with no injected fault never fails, ranks never disagree (one raises, another does
  not), and every run ends within ``--run-timeout`` (no hang);
- a run with a storage outage shorter than the recovery-point bound (the default, at least
  600 s) or a full staging disk completes, its last step committed.

The checks themselves (what storage holds, and each invariant) are library test code, the
soak's oracle: ``ray_goodput.testing`` (``scan_storage``, ``check_*``, ``judge_run``).

    python benchmarks/chaos_soak.py --trials 200 --seed 0 --world 2
    python benchmarks/chaos_soak.py --seed 0 --only 17 --keep     # re-run trial 17, keep its files
    python benchmarks/chaos_soak.py --seed 0 --trials 30 --draw-only   # the trials, as JSON lines

Prints markdown tables (faults by kind, violations by kind, wall time) and writes the
results to ``benchmarks/results/chaos_soak_cpu.json`` (``--out``; a re-run of chosen
trials, ``--only`` or ``--kinds``, writes none unless ``--out`` says where); exits 1 on
any violation. Trial ``i`` of ``--seed S`` is the same trial whatever ``--trials`` is.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
import zlib
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _results

from ray_goodput.testing import (
    ReferenceRun,
    StorageScan,
    check_data,
    check_kept,
    check_no_rot,
    check_restore,
    judge_run,
    kept_steps,
    read_outcome,
    scan_storage,
)
from ray_goodput.testing._soak_oracle import peer_dead, read_jsonl

N_SAMPLES = 16
GLOBAL_BATCH = 4
DATA_SEED = 7
HOOKS = (
    "save.copying",
    "save.queued",
    "upload.staging_write",
    "upload.mid_upload",
    "commit.before_committed",
    "retention",
)
ANY_RANK_HOOKS = ("commit.before_committed", "retention")  # fire in whichever rank gets there
KINDS = (
    "kill_step",
    "kill_random_time",
    *(f"hook:{h}" for h in HOOKS),
    "uploader_kill_ray",
    "flaky_storage",
    "damage_truncate",
    "damage_bitflip",
    "late_commit",
    "world_change",
    "fast_saves",
    "worker_kill_actor",
    "storage_outage",
    "staging_full",
)
# The production path: the node's CheckpointUploader actor over its socket channel, at
# world >= 2 (every other kind runs the in-process thread uploader).
ACTOR_KINDS = ("uploader_kill_ray", "worker_kill_actor", "storage_outage", "staging_full")
MAX_RUNS = 4
STEP_S = 0.03
STASH = "chaos-stash"


# ---- the training job (runs in each rank) -----------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """One run of a trial, as every rank receives it. Picklable."""

    trial_dir: str
    uri: str
    data_uri: str
    attempt: int
    steps: int
    stop_at: int
    cadence: str  # "async" | "sync" | "burst"
    keep_last: int
    staging: str
    verify: bool
    backend: str  # "thread" | "actor"
    ray_address: str | None = None
    fault: dict | None = None  # run 1's (or run 2's) injected fault
    late: dict | None = None
    peer_kill_delay: float = 0.1
    grace_s: float = 15.0


def _decode(data: bytes) -> int:
    return int(data)


def _features(sample: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 + sample)
    x = torch.randn(8, generator=g)
    return x, x.sum(dim=0, keepdim=True).sin()


def _model() -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _train_step(model: Any, optim: Any, ids: list[int], world: int) -> None:
    """Per-sample gradients, gathered in global sample order and summed one by one:
    the same bits at any world size."""
    import torch
    import torch.distributed as dist

    params = list(model.parameters())
    rows = []
    for sample in ids:
        x, y = _features(sample)
        grads = torch.autograd.grad((model(x) - y).pow(2).mean(), params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    local = torch.stack(rows)
    if world > 1:
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        local = torch.cat(parts)
    total = local[0].clone()
    for row in local[1:]:
        total += row
    total /= len(local)
    offset = 0
    for p in params:
        p.grad = total[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    optim.step()


def _state_hash(model: Any, optim: Any, loader: Any) -> str:
    import torch

    h = hashlib.sha256()
    for key, value in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(value.detach().numpy().tobytes())
    for pid, entry in sorted(optim.state_dict()["state"].items()):
        for key, value in sorted(entry.items()):
            h.update(f"{pid}.{key}".encode())
            h.update(torch.as_tensor(value).double().numpy().tobytes())
    pos = loader.state_dict()
    h.update(f"{pos['epoch']}:{pos['consumed']}".encode())
    return h.hexdigest()[:20]


def _batches(loader: Any):
    while True:
        for batch in loader:
            yield [int(i) for i in batch]


def _runs_dir(spec: RunSpec) -> Path:
    return Path(spec.trial_dir) / "runs"


def _mark(spec: RunSpec, rank: int, what: str, text: str = "") -> None:
    _mark_file(_runs_dir(spec) / f"a{spec.attempt}-r{rank}.{what}", text)


def _mark_file(path: Path, text: str) -> None:
    """Whole or not at all: peers poll the marks and read them (a pid) as they appear."""
    from ray_goodput.testing import publish_file

    publish_file(path, text)


def _append(path: Path, obj: dict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(obj) + "\n").encode())  # one write: a kill never tears a line
    finally:
        os.close(fd)


def _die(spec: RunSpec, rank: int, why: str) -> None:
    _mark(spec, rank, "fault", why)
    os.kill(os.getpid(), signal.SIGKILL)


def _watch_peers(spec: RunSpec, rank: int, world: int) -> None:
    """Ray Train tears the whole group down when a worker dies: do the same here. A peer
    that raised gets ``grace_s`` for this rank to reach its own outcome first."""
    runs = _runs_dir(spec)
    raised_at = None
    while True:
        time.sleep(0.02)
        for peer in (p for p in range(world) if p != rank):
            base = runs / f"a{spec.attempt}-r{peer}"
            if Path(f"{base}.done").exists():
                continue
            if Path(f"{base}.error").exists():
                raised_at = raised_at or time.monotonic()
                if time.monotonic() - raised_at > spec.grace_s:
                    _mark(spec, rank, "watchdog", f"peer {peer} raised; this rank did not")
                    os.kill(os.getpid(), signal.SIGKILL)
                continue
            if peer_dead(Path(f"{base}.pid")):
                time.sleep(spec.peer_kill_delay)
                _mark(spec, rank, "peer_died", f"peer {peer} died")
                os.kill(os.getpid(), signal.SIGKILL)


def _arm_hook(name: str) -> None:
    os.environ["RAY_GOODPUT_FAULT"] = f"{name}:1:kill"  # the library reads it at each point


def _kill_uploaders(spec: RunSpec, rank: int, delay: float) -> None:
    import ray

    def _kill() -> None:
        time.sleep(delay)
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["name"].startswith("uploader"):
                _mark(spec, rank, "uploader_killed", entry["name"])
                ray.kill(ray.get_actor(entry["name"], namespace=entry["namespace"]), no_restart=True)

    threading.Thread(target=_kill, daemon=True).start()


def _timer_kill(spec: RunSpec, rank: int, delay: float) -> None:
    def _kill() -> None:
        time.sleep(delay)
        _die(spec, rank, f"timer {delay:.3f}s")

    threading.Thread(target=_kill, daemon=True).start()


def _fault(spec: RunSpec, rank: int, step: int, phase: str, ckpt: Any) -> None:
    """Fire run 1's fault when (step, phase) is its moment. Every rank calls it."""
    f = spec.fault
    if not f or step != f["step"]:
        return
    mine = rank == f["rank"]
    kind = f["type"]
    if kind == "kill":
        if phase == "after_save" and f["where"] == "after_wait":
            ckpt.wait()
            phase = "after_wait"
        if phase == f["where"] and mine:
            _die(spec, rank, f"kill {phase} step {step}")
    elif kind == "timer" and phase == "after_save" and mine:
        _timer_kill(spec, rank, f["delay"])
    elif kind == "hook" and phase in ("before_save", "start") and (mine or f["hook"] in ANY_RANK_HOOKS):
        _arm_hook(f["hook"])
    elif kind == "ray_kill" and phase == "after_save" and rank == 0:
        _kill_uploaders(spec, rank, f["delay"])
    elif kind == "outage" and phase == "after_step" and mine:
        _start_outage(spec, rank, f["seconds"], ckpt)


OUTAGE_ACK_S = 30.0


def _start_outage(spec: RunSpec, rank: int, seconds: float, ckpt: Any) -> None:
    """Ask the soak (which owns the S3 proxy) to take storage down for ``seconds``, and go
    on once it is down: the saves that follow are made during the outage. First the rank's
    connection to its node uploader: saves made before it are held until the uploader
    answers, and on a short trial all of them could reach storage after the outage."""
    connected = getattr(ckpt._uploader, "_attached", None)  # the actor backend's wait (bounded)
    if connected is not None:
        connected()
    _mark(spec, rank, "outage", str(seconds))
    ack = _runs_dir(spec) / f"a{spec.attempt}.outage_on"
    deadline = time.monotonic() + OUTAGE_ACK_S
    while not ack.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the soak did not start the storage outage ({ack}) within {OUTAGE_ACK_S} s")
        time.sleep(0.01)


def _late_commit(spec: RunSpec, rank: int, step: int, restored: int | None) -> None:
    """A dead attempt's checkpoint comes back and is committed while this run is going on."""
    late = spec.late
    if not late:
        return
    low = (restored or 0) + 1
    when = low + int(late["frac"] * max(0, late["step"] - low))
    if step != when:
        return
    if rank == 0:
        _restore_stash(late["uri"], late["step"])
        _finish_orphan(late["uri"], late["step"])
        _mark(spec, rank, "late", str(step))
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _saves_at(spec: RunSpec, step: int) -> bool:
    return spec.cadence == "burst" or step % 2 == 0 or step == spec.stop_at


def _open(rank: int, world: int, spec: RunSpec) -> tuple[Any, Any, Any, Any]:
    from ray_goodput import Checkpointer
    from ray_goodput.data import DataLoader, FileDataset

    if spec.backend == "actor":
        import ray

        ray.init(address=spec.ray_address, log_to_driver=False, configure_logging=False)
    model, optim = _model()
    dataset = FileDataset(spec.data_uri, decode=_decode, seed=DATA_SEED, cache=None)
    loader = DataLoader(dataset, GLOBAL_BATCH // world, num_workers=0, collate_fn=list, rank=rank, world_size=world)
    ckpt = Checkpointer(
        spec.uri,
        keep_last=spec.keep_last,
        staging_dir=spec.staging,
        verify_checksums=spec.verify,
        uploader=spec.backend,
    )
    return model, optim, loader, ckpt


def _train(rank: int, world: int, spec: RunSpec, times: dict) -> None:
    model, optim, loader, ckpt = _open(rank, world, spec)
    times["ready"] = time.time()
    state = {"model": model, "optim": optim, "loader": loader}
    restored = ckpt.restore(state)
    times["restored"] = time.time()
    _fault(spec, rank, 0, "start", ckpt)
    runs, records = _runs_dir(spec), Path(spec.trial_dir) / "records"
    if rank == 0:
        _append(runs / f"a{spec.attempt}.restore", {"step": restored, "hash": _state_hash(model, optim, loader)})
    batches = _batches(loader)
    for step in range((restored or 0) + 1, spec.stop_at + 1):
        ids = next(batches)
        _train_step(model, optim, ids, world)
        time.sleep(STEP_S)  # the rest of a real step: room for background saves to overlap
        _fault(spec, rank, step, "after_step", ckpt)
        _append(
            records / f"a{spec.attempt}-r{rank}.jsonl",
            {"step": step, "ids": ids, "hash": _state_hash(model, optim, loader) if rank == 0 else None},
        )
        _late_commit(spec, rank, step, restored)
        _fault(spec, rank, step, "before_save", ckpt)
        if _saves_at(spec, step):
            ckpt.save(step, state)
            if spec.cadence == "sync":
                ckpt.wait()
        _fault(spec, rank, step, "after_save", ckpt)
    times["trained"] = time.time()
    ckpt.close()
    times["closed"] = time.time()
    if rank == 0:
        _append(runs / f"a{spec.attempt}.final", {"step": spec.stop_at, "hash": _state_hash(model, optim, loader)})


def rank_main(rank: int, world: int, spec: RunSpec) -> str:
    """One rank of one run (the function ``run_world`` starts). Its output goes to a log
    file; its outcome to marker files (``runs/a<attempt>-r<rank>.<done|error|fault|...>``)."""
    log = Path(spec.trial_dir) / "logs" / f"a{spec.attempt}-r{rank}.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import torch

    torch.set_num_threads(1)
    _mark(spec, rank, "pid", str(os.getpid()))
    threading.Thread(target=_watch_peers, args=(spec, rank, world), daemon=True).start()
    times = {"start": time.time()}
    try:
        _train(rank, world, spec, times)
    except BaseException as exc:  # noqa: BLE001 - the outcome is judged by the parent
        _mark(spec, rank, "error", json.dumps({**_classify(exc), "tb": traceback.format_exc()}))
        return "error"
    _mark(spec, rank, "done", json.dumps({k: round(v - times["start"], 3) for k, v in times.items()}))
    return "ok"


def _classify(exc: BaseException) -> dict:
    """The exception chain's types, and whether storage or a dead actor caused it (a failure
    injected on purpose) -- by type, never by message."""
    from ray_goodput.errors import StorageError

    chain, seen = [], exc
    while seen is not None and len(chain) < 20:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    actor_error = ()
    if "ray" in sys.modules:
        actor_error = (sys.modules["ray"].exceptions.RayActorError,)
    return {
        "error": f"{type(exc).__name__}: {str(exc)[:300]}",
        "chain": [type(e).__name__ for e in chain],
        "storage": any(isinstance(e, StorageError) for e in chain),
        "actor": bool(actor_error) and any(isinstance(e, actor_error) for e in chain),
    }


# ---- storage access for the harness (direct, never through the faulty proxy) -----------


def _loc(uri: str):
    from ray_goodput.storage import resolve

    return resolve(uri)


def _stash_path(uri: str, step: int) -> tuple[Any, str, str]:
    from ray_goodput.checkpoint.protocol import _layout

    loc = _loc(uri)
    return loc.fs, loc.join(_layout.CHECKPOINTS_DIR, _layout.step_dir(step)), loc.join(STASH, _layout.step_dir(step))


def _move_tree(fs: Any, src: str, dst: str) -> None:
    import pyarrow.fs as pafs

    for info in fs.get_file_info(pafs.FileSelector(src, recursive=True, allow_not_found=True)):
        if info.type == pafs.FileType.File:
            target = dst + info.path[len(src) :]
            fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
            fs.copy_file(info.path, target)
            fs.delete_file(info.path)
    try:
        fs.delete_dir(src)
    except (FileNotFoundError, OSError):
        pass


def _hide_as_orphan(uri: str, step: int, drop_metadata: bool) -> None:
    """Turn a committed checkpoint into one whose committer died (every rank durable, no
    COMMITTED), and hide it until :func:`_restore_stash`."""
    from ray_goodput.checkpoint.protocol import _layout

    fs, live, stash = _stash_path(uri, step)
    for name in (_layout.COMMITTED, *((_layout.DCP_METADATA,) if drop_metadata else ())):
        try:
            fs.delete_file(f"{live}/{name}")
        except FileNotFoundError:
            pass
    _move_tree(fs, live, stash)


def _restore_stash(uri: str, step: int) -> None:
    fs, live, stash = _stash_path(uri, step)
    _move_tree(fs, stash, live)


def _finish_orphan(uri: str, step: int) -> None:
    """Commit the orphan as any holder of storage access may (the dead attempt's uploader)."""
    from ray_goodput.checkpoint.protocol import _catalog

    finish = getattr(_catalog, "finish_orphan", None)
    if finish is not None:
        finish(_catalog.step_location(uri, step), step)
    else:
        _catalog.newest_valid(uri)


def _damage(uri: str, step: int, how: str, rng: random.Random) -> str:
    from ray_goodput.checkpoint.protocol import _catalog
    from ray_goodput.checkpoint.protocol._manifest import read_manifest
    from ray_goodput.storage import read_bytes, write_bytes

    loc = _catalog.step_location(uri, step)
    # Files a restore reads (the ranks' metadata parts only feed .metadata at commit time).
    files = [f for f in read_manifest(loc).files if not f.name.startswith("parts/")]
    entry = rng.choice(sorted(files, key=lambda f: f.name))
    data = bytearray(read_bytes(loc, entry.name))
    if how == "truncate":
        data = data[: len(data) // 2]
    else:
        bit = rng.randrange(len(data) * 8)
        data[bit // 8] ^= 1 << (bit % 8)
    write_bytes(loc, entry.name, bytes(data))
    return entry.name


# ---- trials -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trial:
    index: int
    seed: int
    kind: str
    storage: str
    flaky_rate: float
    latency_s: float
    keep_last: int
    schedule: tuple[int, int]
    cadence: str
    same_node: bool
    verify: bool
    fault: dict  # run 1's
    peer_kill_delay: float
    extra: dict
    resume_fault: dict | None = None  # run 2's
    uploader: str = "thread"  # "actor": the node's CheckpointUploader actor (ACTOR_KINDS)

    def tags(self) -> list[str]:
        w0, w1 = self.schedule
        tags = [
            self.kind,
            f"keep_last={self.keep_last}",
            f"cadence={self.cadence}",
            f"storage={self.storage}",
            f"uploader={self.uploader}",
        ]
        if w0 != w1:
            tags.append(f"world {w0}->{w1}")
        if self.flaky_rate > 0:
            tags.append("flaky requests")
        if self.cadence == "burst":
            tags.append("saves faster than uploads")
        return tags


def _schedules(world: int) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    same = (world, world)
    return same, ([(world, 1), (1, world)] if world > 1 else [(1, 2), (2, 1)])


def draw_trial(seed: int, index: int, args: argparse.Namespace) -> Trial:
    """Trial ``index`` of soak ``seed``: the kinds rotate in a seeded order, the rest is
    drawn from the trial's own seed."""
    rounds, pos = divmod(index, len(KINDS))
    order = list(KINDS)
    random.Random(f"{seed}/kinds/{rounds}").shuffle(order)
    kind = order[pos]
    trial_seed = zlib.crc32(f"{seed}/{index}".encode())
    rng = random.Random(trial_seed)
    same, changes = _schedules(args.world)
    schedule = rng.choice(changes) if kind == "world_change" or rng.random() < 0.4 else same
    if kind in ACTOR_KINDS:
        schedule = (max(2, args.world),) * 2  # the production path runs at world >= 2
    mixed_s3 = args.storage == "mixed" and rng.random() < args.s3_share
    storage = (
        "s3"
        if kind in ("flaky_storage", "storage_outage", "worker_kill_actor")
        or (kind != "uploader_kill_ray" and (args.storage == "s3" or mixed_s3))
        else "local"
    )
    flaky = rng.uniform(0.05, 0.2) if kind == "flaky_storage" else (rng.uniform(0.0, 0.2) if storage == "s3" else 0.0)
    if kind in ("storage_outage", "staging_full"):
        flaky = 0.0  # the one fault is the outage / the full disk: the run must complete
    cadence = "burst" if kind == "fast_saves" else rng.choice(["async", "async", "sync", "burst"])
    keep_last = rng.choice([1, 2, 3])
    fault = _draw_fault(kind, rng, args.steps, schedule[0], tuple(args.outage_s))
    resume_fault = None
    if kind == "hook:retention":
        # Its point lies between two deletions of one retention pass: run 1 keeps 3
        # commits and dies; run 2 resumes with keep_last=1, so its first commit deletes
        # at least two directories, with the point armed from run 2's start.
        cadence, keep_last = "async", 3
        fault = {
            "type": "kill",
            "where": "after_wait",
            "rank": fault["rank"],
            "step": rng.randint(args.steps - 2, args.steps - 1),
        }
        resume_fault = {"type": "hook", "hook": "retention", "rank": 0, "step": 0, "keep_last": 1}
    return Trial(
        index=index,
        seed=trial_seed,
        kind=kind,
        storage=storage,
        flaky_rate=round(flaky, 3),
        # A worker killed mid-upload: 50 ms a request makes each upload outlast the
        # 0-0.1 s between the save's return and the kill.
        latency_s=0.05 if kind == "worker_kill_actor" else 0.02 if storage == "s3" and cadence == "burst" else 0.0,
        keep_last=keep_last,
        schedule=schedule,
        cadence=cadence,
        same_node=rng.random() < 0.5,
        verify=rng.random() < 0.25,
        fault=fault,
        peer_kill_delay=round(rng.uniform(0.0, 0.3), 3),
        extra={"frac": rng.random(), "drop_metadata": rng.random() < 0.5, "damage_seed": rng.randrange(1 << 30)},
        resume_fault=resume_fault,
        uploader="actor" if kind in ACTOR_KINDS else "thread",
    )


def _draw_fault(kind: str, rng: random.Random, steps: int, world: int, outage_s: tuple[float, float]) -> dict:
    rank = rng.randrange(world)
    where = rng.choice(["after_step", "before_save", "after_save", "after_wait"])
    if kind.startswith("hook:"):
        return {"type": "hook", "hook": kind[5:], "rank": rank, "step": rng.randint(1, steps - 1)}
    if kind == "storage_outage":  # rank 0 asks for it after a step; the saves after it meet it
        return {
            "type": "outage",
            "rank": 0,
            "step": rng.randint(1, steps - 2),
            "seconds": round(rng.uniform(*outage_s), 2),
        }
    if kind == "staging_full":  # the staging dir is a full tmpfs from the start
        return {"type": "staging_full", "rank": 0, "step": 0}
    # Timers start early enough (3+ steps of STEP_S left, then close) to always fire.
    if kind in ("kill_random_time", "fast_saves", "worker_kill_actor"):
        return {
            "type": "timer",
            "rank": rank,
            "step": rng.randint(1, steps - 3),
            "delay": round(rng.uniform(0.0, 0.1), 3),
        }
    if kind == "uploader_kill_ray":
        return {
            "type": "ray_kill",
            "rank": 0,
            "step": rng.randint(1, steps - 3),
            "delay": round(rng.uniform(0.0, 0.1), 3),
        }
    if kind in ("damage_truncate", "damage_bitflip", "late_commit"):
        # A committed checkpoint must exist to damage or revive: kill after a wait().
        return {"type": "kill", "where": "after_wait", "rank": rank, "step": rng.randint(2, steps - 1)}
    return {"type": "kill", "where": where, "rank": rank, "step": rng.randint(1, steps)}


# ---- the soak's shared environment --------------------------------------------------------


class Soak:
    """What trials share: a work dir, the dataset, references (one per world-size schedule,
    computed once) and, on first use, moto's S3 server and a Ray instance."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.workdir or tempfile.mkdtemp(prefix="chaos-soak-"))
        self.data_uri = str(self._dataset())
        self.refs: dict[tuple[int, int], ReferenceRun] = {}
        self._moto: Any = None
        self.endpoint: str | None = None
        # The soak's own Ray temp dir: ``<tmp>/ray/session_latest`` follows whichever Ray
        # started last on the machine (the test suite starts several beside the CI soak),
        # so the uploader's logs are looked up here. Short, for Ray's Unix socket paths.
        self.ray_temp = Path(tempfile.mkdtemp(prefix="rgs-", dir="/tmp"))

    def _dataset(self) -> Path:
        data = self.work / "data"
        data.mkdir(parents=True, exist_ok=True)
        for i in range(N_SAMPLES):
            (data / f"sample-{i:04d}.txt").write_text(str(i))
        return data

    def s3_bucket(self) -> tuple[str, str]:
        """A fresh bucket on moto's S3 server (started on first use): (bucket, endpoint)."""
        import pyarrow.fs as pafs

        if self._moto is None:
            from ray_goodput.testing._s3 import start_moto_server

            self._moto, self.endpoint = start_moto_server()
        bucket = f"soak-{uuid.uuid4().hex[:12]}"
        pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http", allow_bucket_creation=True).create_dir(bucket)
        return bucket, self.endpoint

    def ray_address(self) -> str:
        import ray

        if not ray.is_initialized():
            # address="local": a Ray of its own, never a cluster someone else started here.
            ray.init(
                address="local",
                num_cpus=2,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                _temp_dir=str(self.ray_temp),
            )
        return ray.get_runtime_context().gcs_address

    def close(self, keep: bool = False) -> None:
        """Stop the servers; remove the work directory unless ``--keep`` or ``keep`` (a
        trial found a violation: its directory, with the ranks' logs, stays for study)."""
        if self._moto is not None:
            self._moto.terminate()
            try:
                self._moto.wait(timeout=10)
            except subprocess.TimeoutExpired:  # under load: not worth failing a finished soak
                self._moto.kill()
                self._moto.wait(timeout=10)
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()
        if keep or self.args.keep:
            print(f"kept {self.work} (Ray's logs: {self.ray_temp})", flush=True)
        else:
            shutil.rmtree(self.work, ignore_errors=True)
            shutil.rmtree(self.ray_temp, ignore_errors=True)

    def reference(self, schedule: tuple[int, int]) -> ReferenceRun:
        if schedule not in self.refs:
            self.refs[schedule] = _reference(self, schedule)
        return self.refs[schedule]


def _trial_dirs(root: Path) -> None:
    for sub in ("runs", "records", "logs"):
        (root / sub).mkdir(parents=True, exist_ok=True)


def _reference(soak: Soak, schedule: tuple[int, int]) -> ReferenceRun:
    """Failure-free: world w0 up to the middle (a clean stop after a save), w1 to the end."""
    root = soak.work / f"ref-{schedule[0]}-{schedule[1]}"
    _trial_dirs(root)
    steps = soak.args.steps
    legs = [(schedule[0], steps)] if schedule[0] == schedule[1] else [(schedule[0], steps // 2), (schedule[1], steps)]
    for attempt, (world, stop_at) in enumerate(legs):
        spec = RunSpec(
            trial_dir=str(root),
            uri=str(root / "store"),
            data_uri=soak.data_uri,
            attempt=attempt,
            steps=steps,
            stop_at=stop_at,
            cadence="async",
            keep_last=3,
            staging=str(root / "staging"),
            verify=True,
            backend="thread",
        )
        problem = _launch(spec, world, soak.args.run_timeout)
        outcome = read_outcome(root, attempt, world)
        if problem or set(outcome.values()) != {"done"}:
            raise RuntimeError(
                f"the failure-free reference run {schedule} failed ({problem}, {outcome}); see {root}/logs"
            )
    kept = kept_steps(root, {a: w for a, (w, _) in enumerate(legs)})
    final = read_jsonl(root / "runs" / f"a{len(legs) - 1}.final")[-1]["hash"]
    fresh = read_jsonl(root / "runs" / "a0.restore")[-1]["hash"]  # step 0: nothing restored
    return ReferenceRun(
        schedule=schedule,
        final=final,
        hashes={0: fresh, **{s: r["hash"] for s, r in kept.items()}},
        ids={s: r["ids"] for s, r in kept.items()},
    )


# ---- running and judging one run ----------------------------------------------------------


def _launch(spec: RunSpec, world: int, timeout_s: float) -> str | None:
    """Run all ranks; None when every process ended in time, else what went wrong."""
    from ray_goodput.testing import run_world

    try:
        run_world(rank_main, world, spec, timeout_s=timeout_s, allow_deaths=True)
    except TimeoutError as exc:
        return f"hang: {exc}"
    except RuntimeError as exc:
        return f"launcher: {str(exc)[-300:]}"
    return None


# ---- one trial ----------------------------------------------------------------------------


@dataclass
class _TrialStorage:
    direct: str  # what the harness reads and damages
    workers: str  # what the ranks use (through the faulty proxy on S3)
    proxy: Any = None
    full_staging: Path | None = None  # staging_full: a tmpfs with no room left


def _storage(soak: Soak, trial: Trial, root: Path) -> _TrialStorage:
    full = _full_tmpfs(root / "staging-full") if trial.kind == "staging_full" else None
    if trial.storage == "local":
        return _TrialStorage(str(root / "store"), str(root / "store"), full_staging=full)
    from ray_goodput.testing import FlakyProxy

    bucket, endpoint = soak.s3_bucket()
    proxy = FlakyProxy(endpoint, trial.flaky_rate, seed=trial.seed, latency_s=trial.latency_s)
    uri = "s3://{}/run?endpoint_override={}&scheme=http"
    return _TrialStorage(uri.format(bucket, endpoint), uri.format(bucket, proxy.endpoint), proxy, full)


FULL_TMPFS = "64k"


def _full_tmpfs(path: Path) -> Path:
    """A tmpfs of ``FULL_TMPFS`` at ``path``, filled to its last byte: a staging disk that
    has no room for any shard (mounting needs root, as the storage-fault tests do)."""
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FULL_TMPFS}", "tmpfs", str(path)], check=True, timeout=30)
    try:
        fd = os.open(path / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError as exc:  # ENOSPC: full
            if exc.errno != errno.ENOSPC:
                raise
        finally:
            os.close(fd)
    except BaseException:
        _unmount(path)
        raise
    return path


def _unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False, timeout=30)


def _warned_full(staging: Path | None, ray_temp: Path) -> bool:
    """Whether an uploader actor of the soak's Ray (temp dir ``ray_temp``) logged that
    ``staging`` was full (its warning names the dir) -- the sign that the shard went to
    storage from memory."""
    needle = f"staging dir {staging}/".encode()
    logs = ray_temp / "session_latest" / "logs"
    return staging is not None and any(needle in f.read_bytes() for f in logs.glob("worker-*") if f.is_file())


def _outage_when_asked(root: Path, attempt: int, proxy: Any, stop: threading.Event, info: dict) -> None:
    """storage_outage: when rank 0 asks (its ``outage`` mark), take the proxy down for the
    seconds asked and tell the rank (``a<attempt>.outage_on``)."""
    ask = root / "runs" / f"a{attempt}-r0.outage"
    while not stop.wait(0.01):
        if ask.exists() and ask.read_text():
            seconds = float(ask.read_text())
            proxy.outage(seconds)
            _mark_file(root / "runs" / f"a{attempt}.outage_on", str(seconds))
            info["outage_s"] = seconds
            return


def _spec(soak: Soak, trial: Trial, root: Path, store: _TrialStorage, attempt: int, late: dict | None) -> RunSpec:
    ray_trial = trial.uploader == "actor"
    staging = root / ("staging" if trial.same_node else f"staging-a{attempt}")
    return RunSpec(
        trial_dir=str(root),
        uri=store.workers,
        data_uri=soak.data_uri,
        attempt=attempt,
        steps=soak.args.steps,
        stop_at=soak.args.steps,
        cadence=trial.cadence,
        keep_last=(_fault_of(trial, attempt) or {}).get("keep_last", trial.keep_last),
        staging=str(store.full_staging or staging),
        verify=trial.verify,
        backend="actor" if ray_trial else "thread",
        ray_address=soak.ray_address() if ray_trial else None,
        fault=_fault_of(trial, attempt),
        late=late if attempt == 1 else None,
        peer_kill_delay=trial.peer_kill_delay,
        grace_s=soak.args.grace,
    )


def _fault_of(trial: Trial, attempt: int) -> dict | None:
    return trial.fault if attempt == 0 else trial.resume_fault if attempt == 1 else None


def _wait_uploaders_idle(timeout_s: float = 60.0) -> bool:
    """Ray trials: the node uploader outlives the run; let it finish before storage is read."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = False
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["name"].startswith("uploader"):
                try:
                    actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
                    busy |= bool(ray.get(actor.busy.remote(), timeout=10))
                except Exception:  # noqa: BLE001 - a dead uploader is not busy
                    pass
        if not busy:
            return True
        time.sleep(0.2)
    return False


def _between_runs(trial: Trial, store: _TrialStorage, pre: StorageScan, info: dict) -> tuple[StorageScan, dict | None]:
    """After run 1: damage or hide the newest committed checkpoint (damage / late commit)."""
    if trial.kind not in ("damage_truncate", "damage_bitflip", "late_commit"):
        return pre, None
    newest = pre.newest("intact")
    if newest is None:
        info["applied"] = "no committed checkpoint to act on"
        return pre, None
    if trial.kind == "late_commit":
        _hide_as_orphan(store.direct, newest, trial.extra["drop_metadata"])
        info["applied"] = f"step {newest} hidden as an orphan, committed late in run 2"
        late = {"step": newest, "frac": trial.extra["frac"], "uri": store.direct}
        return scan_storage(store.direct), late
    name = _damage(store.direct, newest, trial.kind.split("_")[1], random.Random(trial.extra["damage_seed"]))
    info["applied"] = f"step {newest}: {trial.kind.split('_')[1]} {name}"
    info["damaged_step"] = newest
    return scan_storage(store.direct), None


def _fired(trial: Trial, root: Path, result: dict, store: _TrialStorage, ray_temp: Path) -> bool:
    """Whether the trial's fault actually happened."""
    runs, kind = root / "runs", trial.fault["type"]
    if trial.kind in ("damage_truncate", "damage_bitflip", "late_commit"):
        return "step" in result["info"].get("applied", "no ")[:5]
    if trial.kind in ("flaky_storage", "storage_outage"):
        return store.proxy is not None and store.proxy.counts["failed"] > 0
    if trial.kind == "staging_full":  # the uploader found it full and uploaded from memory
        return _warned_full(store.full_staging, ray_temp)
    if trial.kind == "world_change":
        return len(result["runs"]) > 1
    if kind == "ray_kill":
        return (runs / "a0-r0.uploader_killed").exists()
    if trial.kind.startswith("hook:"):  # a rank died with no marker in the run it was armed in
        return any(
            "killed" in r["outcome"].values()
            for i, r in enumerate(result["runs"])
            if (_fault_of(trial, i) or {}).get("hook") == trial.kind[5:]
        )
    return any((runs / f"a0-r{r}.fault").exists() for r in range(trial.schedule[0]))


def _final_checks(
    root: Path, trial: Trial, ref: ReferenceRun, worlds: dict[int, int], last: int, store: _TrialStorage, steps: int
) -> list[str]:
    finals = read_jsonl(root / "runs" / f"a{last}.final")
    if not finals:
        return [f"not_finished: the schedule did not complete in {len(worlds)} runs"]
    out = []
    if finals[-1]["hash"] != ref.final:
        out.append("final_weights_differ: final state differs from the failure-free run")
    end = scan_storage(store.direct)
    if end.steps.get(steps) != "intact":
        out.append(
            f"final_not_committed: last saved step {steps} is {end.steps.get(steps, 'absent')} after close() returned"
        )
    return out + check_data(kept_steps(root, worlds), ref, steps, n_samples=N_SAMPLES, global_batch=GLOBAL_BATCH)


def run_trial(soak: Soak, trial: Trial) -> dict:
    t0 = time.monotonic()
    root = soak.work / f"trial-{trial.index:05d}"
    _trial_dirs(root)
    result: dict[str, Any] = {
        "index": trial.index,
        "seed": trial.seed,
        "kind": trial.kind,
        "tags": trial.tags(),
        "trial": asdict(trial),
        "runs": [],
        "violations": [],
        "info": {},
    }
    store: _TrialStorage | None = None
    try:
        # The reference run and the S3 server start inside too: raised out of the soak, a
        # failure there (a CI run under load) left rc 1 and no record of its cause.
        ref = soak.reference(trial.schedule)
        store = _storage(soak, trial, root)
        _run_attempts(soak, trial, root, store, ref, result)
    except Exception as exc:  # noqa: BLE001 - a harness error fails the trial loudly
        result["violations"].append(f"harness_error: {type(exc).__name__}: {exc}")
        result["info"]["traceback"] = traceback.format_exc()
    finally:
        if store is not None and store.proxy is not None:
            result["info"]["requests"] = dict(store.proxy.counts)
            store.proxy.close()
        if store is not None and store.full_staging is not None:
            _unmount(store.full_staging)
    result["wall_s"] = round(time.monotonic() - t0, 2)
    if result["violations"] or soak.args.keep:
        result["dir"] = str(root)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return result


def _run_attempts(soak: Soak, trial: Trial, root: Path, store: _TrialStorage, ref: ReferenceRun, result: dict) -> None:
    pre, late, worlds, known_bad = scan_storage(store.direct), None, {}, set()
    violations = result["violations"]
    for attempt in range(MAX_RUNS):
        world = trial.schedule[0 if attempt == 0 else 1]
        worlds[attempt] = world
        began, stop = time.monotonic(), threading.Event()
        if (_fault_of(trial, attempt) or {}).get("type") == "outage":
            args = (root, attempt, store.proxy, stop, result["info"])
            threading.Thread(target=_outage_when_asked, args=args, daemon=True).start()
        try:
            problem = _launch(_spec(soak, trial, root, store, attempt, late), world, soak.args.run_timeout)
        finally:
            stop.set()
        run_s = round(time.monotonic() - began, 2)
        if trial.uploader == "actor" and not _wait_uploaders_idle():
            violations.append("hang: the node uploader stayed busy for 60 s after the run")
        post = scan_storage(store.direct)
        outcome = read_outcome(root, attempt, world)
        # A killed uploader fails the saves it held; the agreed error names it only in text.
        accepted = (("any",) if attempt == 0 and trial.fault["type"] == "ray_kill" else ()) + (
            ("storage",) if trial.flaky_rate > 0 else ()
        )
        armed = (_fault_of(trial, attempt) or {}).get("type") == "hook"
        status, found = judge_run(root, attempt, outcome, accepted, armed)
        if problem:
            status, found = "hang", [f"hang: run {attempt + 1}: {problem}"]
        restored = read_jsonl(root / "runs" / f"a{attempt}.restore")
        found += check_restore(pre, restored[-1] if restored else None, ref)
        if restored:  # what restore skipped as newer than its pick, it found damaged
            pick = pre.order.get(restored[-1]["step"], (-1, -1))
            known_bad |= {s for s in pre.having("damaged") if pre.order.get(s, (-1, s)) > pick}
        found += check_kept(pre, post, (_fault_of(trial, attempt) or {}).get("keep_last", trial.keep_last), known_bad)
        found += check_no_rot(post, {result["info"].get("damaged_step")})
        if trial.kind in ("storage_outage", "staging_full") and attempt == 0 and status != "completed":
            # Neither is a reason to stop: an outage shorter than the recovery-point bound
            # (600 s by default) is retried through; a full staging disk uploads from memory.
            what = (
                f"an outage of {result['info'].get('outage_s')} s" if trial.kind == "storage_outage" else "full staging"
            )
            found.append(f"{trial.kind}_ended_run: {what} ended the run ({status}); it must complete")
        violations += [f"run {attempt + 1}: {v}" for v in found]
        done = root / "runs" / f"a{attempt}-r0.done"
        result["runs"].append(
            {
                "world": world,
                "status": status,
                "outcome": outcome,
                "wall_s": run_s,
                "rank0_times": json.loads(done.read_text()) if done.exists() else None,
                "restored": restored[-1]["step"] if restored else None,
                "before": pre.steps,
                "after": post.steps,
            }
        )
        if status == "hang" or (root / "runs" / f"a{attempt}.final").exists():
            break
        pre = post
        if attempt == 0:
            pre, late = _between_runs(trial, store, pre, result["info"])
    result["fired"] = _fired(trial, root, result, store, soak.ray_temp)
    if not any(v.split(": ", 2)[1].startswith("hang") for v in violations):
        violations += _final_checks(root, trial, ref, worlds, max(worlds), store, soak.args.steps)


# ---- report -------------------------------------------------------------------------------


def _violation_kind(text: str) -> str:
    body = text.split(": ", 1)[1] if text.startswith("run ") else text
    return body.split(":", 1)[0]


def summarize(results: list[dict], wall_s: float, seed: int, ref_problems: list[str]) -> dict:
    kinds: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        c = kinds[r["kind"]]
        c["trials"] += 1
        c["fired"] += int(r.get("fired", False))
        c["runs"] += len(r["runs"])
        c["violations"] += len(r["violations"])
    tags = Counter(t for r in results for t in r["tags"][1:])
    by_violation: dict[str, list[str]] = defaultdict(list)
    for r in results:
        for v in r["violations"]:
            by_violation[_violation_kind(v)].append(f"{seed}/{r['index']}")
    for p in ref_problems:
        by_violation[_violation_kind(p)].append("reference")
    times = [r["wall_s"] for r in results]
    return {
        "trials": len(results),
        "wall_s": round(wall_s, 1),
        "trial_s_mean": round(sum(times) / max(1, len(times)), 2),
        "trial_s_max": max(times, default=0.0),
        "violations": sum(len(v) for v in by_violation.values()),
        "kinds": {k: dict(v) for k, v in sorted(kinds.items())},
        "tags": dict(sorted(tags.items())),
        "by_violation": {k: sorted(set(v)) for k, v in sorted(by_violation.items())},
        "load_avg": os.getloadavg(),
    }


def markdown(summary: dict) -> str:
    s = summary
    lines = [
        "| trials | runs | violations | wall time (s) | per trial mean / max (s) |",
        "|---:|---:|---:|---:|---:|",
        f"| {s['trials']} | {sum(k['runs'] for k in s['kinds'].values())} | {s['violations']} "
        f"| {s['wall_s']} | {s['trial_s_mean']} / {s['trial_s_max']} |",
        "",
        "| fault kind | trials | fired | runs | violations |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {k} | {v['trials']} | {v['fired']} | {v['runs']} | {v['violations']} |" for k, v in s["kinds"].items()
    ]
    lines += ["", "| also drawn | trials |", "|---|---:|"]
    lines += [f"| {k} | {n} |" for k, n in s["tags"].items()]
    lines += ["", "| violation | count | trials (seed/index) |", "|---|---:|---|"]
    lines += [
        f"| {k} | {len(v)} | {', '.join(v[:12])}{' ...' if len(v) > 12 else ''} |" for k, v in s["by_violation"].items()
    ] or ["| none | 0 | |"]
    return "\n".join(lines)


def _check_references(soak: Soak) -> list[str]:
    """Different world-size schedules must agree bit for bit (or the comparison means nothing)."""
    refs = list(soak.refs.values())
    return [
        f"reference_mismatch: schedule {r.schedule} differs from {refs[0].schedule}"
        for r in refs[1:]
        if (r.hashes, r.ids, r.final) != (refs[0].hashes, refs[0].ids, refs[0].final)
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world", type=int, default=2, choices=(1, 2, 4))
    p.add_argument(
        "--storage",
        choices=("local", "s3", "mixed"),
        default="mixed",
        help="mixed: S3 for --s3-share of the trials (flaky_storage trials always use S3)",
    )
    p.add_argument("--s3-share", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--run-timeout", type=float, default=120.0, help="seconds per run (no hang)")
    p.add_argument("--grace", type=float, default=15.0, help="seconds a rank gets to raise after a peer raised")
    p.add_argument(
        "--outage-s",
        type=float,
        nargs=2,
        default=(1.0, 20.0),
        metavar=("LOW", "HIGH"),
        help="storage_outage trials: the outage lasts LOW-HIGH seconds (drawn)",
    )
    p.add_argument("--only", type=int, nargs="*", help="run only these trial indices")
    p.add_argument("--kinds", nargs="*", choices=KINDS, help="run only trials of these kinds")
    p.add_argument(
        "--out",
        help=f"write the JSON results here (default {_results.default_path('chaos_soak')}; none for --only or --kinds)",
    )
    p.add_argument("--workdir", help="default: a fresh temporary directory")
    p.add_argument("--keep", action="store_true", help="keep every trial's directory")
    p.add_argument("--draw-only", action="store_true", help="print the trials drawn (JSON lines) and run nothing")
    args = p.parse_args(argv)
    if args.steps < 4 or args.steps * GLOBAL_BATCH % N_SAMPLES:
        p.error(f"--steps must be >= 4 and a multiple of {N_SAMPLES // GLOBAL_BATCH}")
    if args.out is None and not (args.only or args.kinds or args.draw_only):
        args.out = str(_results.default_path("chaos_soak"))
    return args


def _trials(args: argparse.Namespace) -> list[Trial]:
    """The trials to run: ``--only`` (else ``--trials``), of ``--kinds`` when given."""
    drawn = (draw_trial(args.seed, index, args) for index in (args.only or range(args.trials)))
    return [t for t in drawn if not args.kinds or t.kind in args.kinds]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.draw_only:
        for trial in _trials(args):
            print(json.dumps(asdict(trial)))
        return 0
    run = _results.start_run("chaos_soak", argv)
    if os.environ.pop("RAY_GOODPUT_FAULT", None):
        print("note: RAY_GOODPUT_FAULT was set; cleared (trials arm their own faults)")
    for key, value in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
        ("AWS_EC2_METADATA_DISABLED", "true"),
    ):
        os.environ.setdefault(key, value)
    soak, results, t0 = Soak(args), [], time.monotonic()
    try:
        for trial in _trials(args):
            result = run_trial(soak, trial)
            results.append(result)
            print(
                f"trial {trial.index:4d} {trial.kind:28s} {result['wall_s']:6.1f}s runs="
                f"{len(result['runs'])} {'OK' if not result['violations'] else result['violations']}",
                flush=True,
            )
            _write(args, run, results, t0, [])  # so an interrupted soak leaves what it found
        ref_problems = _check_references(soak)
    finally:
        soak.close(keep=any(r["violations"] for r in results))
    summary = _write(args, run, results, t0, ref_problems)
    print(markdown(summary))
    if args.out:
        print(f"\nresults written to {args.out}")
    return 1 if summary["violations"] else 0


def _write(args: argparse.Namespace, run: dict, results: list[dict], t0: float, ref_problems: list[str]) -> dict:
    summary = summarize(results, time.monotonic() - t0, args.seed, ref_problems)
    if args.out:
        _results.write(
            args.out,
            run,
            {
                "args": vars(args),
                "summary": summary,
                "markdown": markdown(summary),
                "reference_problems": ref_problems,
                "trials": results,
            },
        )
    return summary


if __name__ == "__main__":
    sys.exit(main())
