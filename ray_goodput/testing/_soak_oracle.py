"""The chaos soak's oracle: what storage holds, and the invariants every run must keep.

``benchmarks/chaos_soak.py`` throws failures at short training jobs; after each run it
scans storage (:func:`scan_storage`) and asks the checks here whether the run kept its
promises: ``restore`` returned the newest intact checkpoint with the failure-free state
(:func:`check_restore`), retention lost nothing it had to keep (:func:`check_kept`), no
commit rotted (:func:`check_no_rot`), the data order matched (:func:`check_data`), ranks
agreed and nothing failed without a cause (:func:`judge_run`). The checks are pure
functions over plain data, so a test feeds them made-up scans and runs.

The scan reads the storage layout with plain pyarrow and json, as documented in
``ray_goodput.checkpoint.protocol._layout`` (a contract) -- not through the library's own
readers: a bug in those must not hide itself from the oracle, and this module stays in the
low layer of ``ray_goodput.testing`` (it imports nothing else of the library).

A soak run leaves in its trial directory (the harness's side of the contract)::

    runs/a<attempt>-r<rank>.<pid|done|error|fault|peer_died|watchdog>   marks, published whole
    runs/a<attempt>.restore, runs/a<attempt>.final   JSON lines {"step", "hash"} (rank 0)
    records/a<attempt>-r<rank>.jsonl                 JSON lines {"step", "ids", "hash"} per step
"""

from __future__ import annotations

import json
import posixpath
import re
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import google_crc32c
import pyarrow.fs as pafs

# ---- what storage holds -------------------------------------------------------------------

_CHECKPOINTS_DIR, _COMMITTED, _QUARANTINED, _RANKS_DIR = "checkpoints", "COMMITTED", "QUARANTINED", ".ranks"
_STEP_DIR = re.compile(r"^step-(\d{9,})$")
_MARKER_NAME = re.compile(r"^rank-\d+-.+\.json$")  # a marker's temporary file declares nothing
_CHECKSUMS = {"crc32": zlib.crc32, "crc32c": google_crc32c.value}
_READ_ATTEMPTS = 3


@dataclass
class StorageScan:
    """What storage holds: step -> state, where state is ``intact`` (committed, not
    quarantined, every file matches its manifest), ``quarantined`` (a commit whose files
    all match, yet marked damaged), ``damaged`` (a commit whose files do not match),
    ``orphan`` (uncommitted, every rank of one save durable) or ``partial``; and each
    committed or orphan step's lineage order ``(generation, step)``."""

    steps: dict[int, str] = field(default_factory=dict)
    order: dict[int, tuple[int, int]] = field(default_factory=dict)
    marked: set[int] = field(default_factory=set)  # QUARANTINED names its commit

    def having(self, *states: str) -> list[int]:
        """Steps in these states, oldest first by lineage order."""
        return sorted((s for s, st in self.steps.items() if st in states), key=lambda s: self.order.get(s, (-1, s)))

    def newest(self, *states: str) -> int | None:
        found = self.having(*states)
        return found[-1] if found else None


@dataclass(frozen=True)
class _Dir:
    """A directory on a pyarrow file system (reads retried on transient errors only)."""

    fs: pafs.FileSystem
    path: str

    def child(self, name: str) -> _Dir:
        return _Dir(self.fs, f"{self.path}/{name}")

    def list(self, sub: str = "") -> list[pafs.FileInfo]:
        """Entries (empty when the directory does not exist). pyarrow's local listing looks
        for the directory only after listing it failed: one made in between raises."""
        selector = pafs.FileSelector(f"{self.path}/{sub}" if sub else self.path, allow_not_found=True)
        try:
            return self.fs.get_file_info(selector)
        except FileNotFoundError:
            return self.fs.get_file_info(selector)

    def read(self, name: str) -> bytes:
        """A whole file; FileNotFoundError when absent."""
        attempt = 1
        while True:
            try:
                with self.fs.open_input_file(f"{self.path}/{name}") as f:
                    return f.read()
            except FileNotFoundError:
                raise
            except OSError:  # an S3 server under load: as the library's reads, try again
                if attempt == _READ_ATTEMPTS:
                    raise
                time.sleep(0.2 * attempt)
                attempt += 1


def _open(uri: str) -> _Dir:
    if "://" not in uri:
        return _Dir(pafs.LocalFileSystem(), posixpath.abspath(uri))
    fs, path = pafs.FileSystem.from_uri(uri)
    return _Dir(fs, path.rstrip("/"))


@dataclass(frozen=True)
class _File:
    name: str
    size: int
    checksum: int
    algorithm: str


def _files(record: dict) -> list[_File]:
    """A manifest's or marker's file list. Records before CRC32C name no algorithm (CRC32);
    one that names several has each non-CRC32 file name its own. Raises ValueError,
    KeyError or TypeError on a malformed record, as the library's parser does."""
    default = str(record.get("checksum", "crc32"))
    default = "crc32" if "," in default else default
    out = []
    for f in record["files"]:
        size, block_bytes = int(f["size"]), int(f.get("block_bytes", 0))
        blocks = [int(b) for b in f.get("blocks", ())]
        if blocks and (block_bytes < 1 or len(blocks) != -(-size // block_bytes)):
            raise ValueError(f"{f['name']}: {len(blocks)} block checksums for {size} bytes")
        out.append(_File(str(f["name"]), size, int(f["crc32"]), str(f.get("checksum", default))))
    return out


def _intact(d: _Dir, files: list[_File]) -> bool:
    """Every file present with the size and checksum its record names."""
    for entry in files:
        try:
            data = d.read(entry.name)
        except OSError:
            return False
        check = _CHECKSUMS.get(entry.algorithm)
        if len(data) != entry.size or check is None or check(data) != entry.checksum:
            return False
    return True


class _Torn(Exception):
    """``COMMITTED`` is there but unreadable."""


def _manifest(d: _Dir) -> tuple[list[_File], int, int] | None:
    """(files, generation, digest) of the step's ``COMMITTED``, None when it has none."""
    try:
        data = d.read(_COMMITTED)
    except FileNotFoundError:
        return None
    try:
        m = json.loads(data)
        int(m["step"]), int(m["world_size"]), float(m["created"]), int(m.get("format_version", 1))
        return _files(m), int(m.get("generation", 0)), zlib.crc32(data)
    except (ValueError, KeyError, TypeError) as exc:
        raise _Torn(str(exc)) from exc


def _quarantined(d: _Dir, digest: int) -> bool:
    """Whether a ``QUARANTINED`` record condemns this very commit (not a later re-save);
    a torn record, naming none, condemns whatever is there."""
    try:
        record = json.loads(d.read(_QUARANTINED))
    except FileNotFoundError:
        return False
    except ValueError:
        return True
    return record.get("digest") is None or record.get("digest") == digest


def _completable(d: _Dir) -> int | None:
    """Generation of the newest save whose every rank declared itself durable with intact
    files (an orphan that restore may commit), or None."""
    saves: dict[tuple[int, str, int], dict[int, list[_File]]] = defaultdict(dict)
    for info in d.list(_RANKS_DIR):
        name = info.path.rsplit("/", 1)[-1]
        if not _MARKER_NAME.match(name):
            continue
        try:
            m = json.loads(d.read(f"{_RANKS_DIR}/{name}"))
            key = (int(m.get("generation", 0)), str(m["nonce"]), int(m["world_size"]))
            saves[key][int(m["rank"])] = _files(m)
        except (ValueError, KeyError, TypeError, OSError):
            continue
    done = [
        g
        for (g, _, ws), ranks in saves.items()
        if set(ranks) == set(range(ws)) and all(_intact(d, f) for f in ranks.values())
    ]
    return max(done) if done else None


def _scan_step(d: _Dir, step: int, out: StorageScan) -> None:
    try:
        manifest = _manifest(d)
    except _Torn:
        out.steps[step] = "damaged"
        return
    if manifest is not None:
        files, generation, digest = manifest
        marked = _quarantined(d, digest)
        out.steps[step] = "damaged" if not _intact(d, files) else "quarantined" if marked else "intact"
        if marked:
            out.marked.add(step)
        out.order[step] = (generation, step)
        return
    generation = _completable(d)
    out.steps[step] = "partial" if generation is None else "orphan"
    if generation is not None:
        out.order[step] = (generation, step)


def scan_storage(uri: str) -> StorageScan:
    """Every step directory under ``<uri>/checkpoints``, read in full (every file's
    checksum): a local path or a URI pyarrow resolves (``s3://b/p?endpoint_override=...``)."""
    checkpoints = _open(uri).child(_CHECKPOINTS_DIR)
    out = StorageScan()
    for info in checkpoints.list():
        match = _STEP_DIR.match(info.path.rstrip("/").rsplit("/", 1)[-1])
        if match is not None:
            step = int(match.group(1))
            _scan_step(checkpoints.child(f"step-{step:09d}"), step, out)
    return out


# ---- the invariants -----------------------------------------------------------------------


@dataclass
class ReferenceRun:
    """A failure-free run: state hash and samples of every step, the final state."""

    schedule: tuple[int, int]
    hashes: dict[int, str]
    ids: dict[int, list[int]]
    final: str


def check_restore(pre: StorageScan, record: dict | None, ref: ReferenceRun) -> list[str]:
    """The restored checkpoint is at least the newest intact one (by lineage order), was
    committed (or completable), and its state is the failure-free state of that step."""
    if record is None:
        return []  # the run died before restore returned
    step, newest = record["step"], pre.newest("intact", "orphan")
    out = []
    if step is None:
        if newest is not None:
            out.append(f"restore_lost_progress: restored nothing, step {newest} was intact")
        if record["hash"] != ref.hashes.get(0):
            out.append(
                "restored_wrong_state: restore returned None yet changed the state "
                "(a damaged checkpoint was partly loaded before the fallback)"
            )
        return out
    if newest is not None and pre.order.get(step, (-1, step)) < pre.order[newest]:
        out.append(
            f"restore_lost_progress: restored step {step} {pre.order.get(step)}, "
            f"step {newest} {pre.order[newest]} was intact"
        )
    if pre.steps.get(step) not in ("intact", "orphan", "damaged", "quarantined"):
        out.append(f"restored_uncommitted: step {step} was {pre.steps.get(step, 'absent')}")
    if record["hash"] != ref.hashes.get(step):
        out.append(
            f"restored_wrong_state: step {step} ({pre.steps.get(step)}) loaded a state "
            "that differs from the failure-free one"
        )
    return out


def check_kept(pre: StorageScan, post: StorageScan, keep_last: int, known_bad: set[int] = frozenset()) -> list[str]:
    """An intact committed checkpoint may go only when keep_last newer (by lineage) ones
    exist; a step re-saved by a newer generation replaces it and counts as kept.

    Newer ones count when intact, or damaged where the library cannot know it yet
    (silent damage no reader has met: not quarantined, never skipped by a restore).
    """
    after = [
        s
        for s in post.having("intact", "damaged")
        if post.steps[s] == "intact" or (s not in post.marked and s not in known_bad)
    ]
    out = []
    for step in pre.having("intact"):
        if post.steps.get(step) == "intact" and post.order[step] >= pre.order[step]:
            continue
        newer = [s for s in after if post.order.get(s, (-1, s)) > pre.order[step]]
        if len(newer) < keep_last:
            out.append(
                f"committed_lost: step {step} {pre.order[step]} is "
                f"{post.steps.get(step, 'gone')} with {len(newer)} newer intact "
                f"(keep_last={keep_last})"
            )
    return out


def check_no_rot(post: StorageScan, excused: set[int]) -> list[str]:
    """A committed checkpoint's files match its manifest unless the harness damaged it."""
    return [
        f"committed_damaged: step {s} is committed but its files do not match the "
        "manifest (no damage was injected there)"
        for s in post.having("damaged")
        if s not in excused
    ] + [
        f"false_quarantine: step {s} is quarantined yet every file matches its manifest"
        for s in post.having("quarantined")
    ]


def check_data(kept: dict[int, dict], ref: ReferenceRun, steps: int, *, n_samples: int, global_batch: int) -> list[str]:
    """Every step ran, on the failure-free run's samples; each of the dataset's
    ``n_samples`` once per epoch (``global_batch`` samples a step)."""
    out = []
    missing = [s for s in range(1, steps + 1) if s not in kept]
    if missing:
        out.append(f"step_missing: no run recorded steps {missing} on every rank")
    wrong = [s for s in sorted(kept) if kept[s]["ids"] != ref.ids.get(s)]
    if wrong:
        out.append(f"data_order: steps {wrong} saw other samples than the failure-free run")
    per_epoch = steps * global_batch // n_samples
    for epoch in range(per_epoch + 1):
        seen = Counter(i for s, r in kept.items() if (s - 1) * global_batch // n_samples == epoch for i in r["ids"])
        twice = sorted(i for i, n in seen.items() if n > 1)
        if twice or (epoch < per_epoch and len(seen) != n_samples and not missing):
            out.append(f"sample_not_once: epoch {epoch} repeated {twice}, saw {len(seen)} of {n_samples}")
    diverged = [s for s in sorted(kept) if kept[s]["hash"] != ref.hashes.get(s)]
    if diverged:
        out.append(f"step_state_differs: state after steps {diverged} differs from the failure-free run")
    return out


# ---- what a run left ----------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    """The whole lines of a JSON-lines file (a kill never tears one: each is one write)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def kept_steps(root: Path, worlds: dict[int, int]) -> dict[int, dict]:
    """step -> {"ids", "hash", "attempt"} from the last run that recorded that step on every
    rank (a resumed run redoes what a dead one did after its checkpoint)."""
    out: dict[int, dict] = {}
    for attempt, world in sorted(worlds.items()):
        per_rank = [
            {r["step"]: r for r in read_jsonl(root / "records" / f"a{attempt}-r{rank}.jsonl")} for rank in range(world)
        ]
        for step in set.intersection(*(set(p) for p in per_rank)):
            out[step] = {
                "attempt": attempt,
                "hash": per_rank[0][step]["hash"],
                "ids": [i for p in per_rank for i in p[step]["ids"]],
            }
    return out


def read_outcome(root: Path, attempt: int, world: int) -> dict[int, str]:
    """rank -> done | error | fault (killed by the harness) | peer_died | watchdog |
    killed (no marker: a library fault point, or a crash)."""
    out = {}
    for rank in range(world):
        base = root / "runs" / f"a{attempt}-r{rank}"
        out[rank] = next(
            (s for s in ("fault", "done", "error", "peer_died", "watchdog") if Path(f"{base}.{s}").exists()), "killed"
        )
    return out


def _error_info(root: Path, attempt: int, rank: int) -> dict:
    text = (root / "runs" / f"a{attempt}-r{rank}.error").read_text()
    try:
        return json.loads(text)
    except ValueError:
        return {"error": text[-300:], "chain": ["?"], "storage": False, "actor": False}


def judge_run(
    root: Path, attempt: int, outcome: dict[int, str], accepted: tuple[str, ...], armed: bool
) -> tuple[str, list[str]]:
    """(status, violations) of one run from its ranks' outcomes. A rank may die without a
    marker only when a fault point was ``armed`` in the run. A run may fail (every rank
    raising the same error) only when an injected fault in ``accepted`` ("storage":
    failing requests, in the error's cause chain; "any": the run's uploader was killed)
    caused it."""
    states = set(outcome.values())
    if states == {"done"}:
        return "completed", []
    if states & {"fault", "killed"}:
        if not armed and "killed" in states:
            return "killed", ["unexpected_death: a rank died with no injected fault"]
        return "killed", []
    errors = {r: _error_info(root, attempt, r) for r, s in outcome.items() if s == "error"}
    summary = sorted({e["error"] for e in errors.values()})
    violations = []
    if states & {"done", "watchdog"}:
        violations.append(f"divergent_outcome: ranks {outcome}; errors {summary}")
    elif len({e["chain"][0] for e in errors.values()}) > 1:
        violations.append(f"divergent_outcome: ranks raised different errors {summary}")
    if "any" not in accepted and not all(any(e.get(c) for c in accepted) for e in errors.values()):
        violations.append(f"run_failed: {summary}")
    return "failed", violations


def _proc_dead(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def peer_dead(pid_file: Path) -> bool:
    """Whether the rank whose pid mark ``pid_file`` is has died (not known while the mark
    is missing, or empty: no reader is told pid 0, which no process has)."""
    try:
        text = pid_file.read_text().strip()
    except FileNotFoundError:
        return False
    return bool(text) and _proc_dead(int(text))
