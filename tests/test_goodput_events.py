"""The goodput event log on an object store loses nothing to a SIGKILL of its writer.

Rank 0 batches its events into a chunk a second on object stores. A whole-group restart
SIGKILLs it between two batches, and the events of its last second were lost: the S3
runs of the step-failures benchmark at 808d57d counted 0-4 of 240 kept steps in neither
``productive`` nor ``lost``. Each event now also goes to a node-local spool (one
``write()``), whose unsent tail a sweep ships once the writer is dead; a tail shipped twice
is read once. Real processes, killed for real, and moto's S3 server.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ray_goodput import storage
from ray_goodput.goodput import EventLog, read_events
from ray_goodput.goodput._events import SWEPT_PREFIX, _Seqs, ship_orphaned_events
from ray_goodput.testing import FlakyProxy, wait_for

_WRITER = textwrap.dedent(
    """
    import sys
    from ray_goodput import storage
    from ray_goodput.goodput import _events
    from ray_goodput.testing import kill_self

    _events.FLUSH_INTERVAL_S = 3600.0  # no periodic batch: the test's flush() is the only one
    _events.SPOOL_RESET_BYTES = int(sys.argv[2])
    log = _events.EventLog(storage.resolve(sys.argv[1]), rank=0, world_size=2)
    print(log.attempt, flush=True)
    for step in range(1, 21):
        log.emit("step", step=step, n=1, t0=float(step), fetch=0.0, ckpt=0.0)
        if step % 5 == 0:
            log.flush()
    for step in range(21, 26):
        log.emit("step", step=step, n=1, t0=float(step), fetch=0.0, ckpt=0.0)
    kill_self()  # between two batches: steps 21-25 are in the spool only
    """
)


def _spool(tmp_path: Path) -> Path:
    return tmp_path / "spool"


def _killed_writer(uri: str, tmp_path: Path, *, reset_bytes: int = 1 << 20, **env: str) -> str:
    """Run the writer (its spool under ``tmp_path``) until its SIGKILL; its attempt name.
    ``reset_bytes``: the spool is emptied after a batch once it is that long."""
    proc = subprocess.run(
        [sys.executable, "-c", _WRITER, uri, str(reset_bytes)],
        env={**os.environ, "RAY_GOODPUT_EVENTS_SPOOL_DIR": str(_spool(tmp_path)), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr  # SIGKILLed, as a crash
    return proc.stdout.split()[0]


def _steps(uri: str, attempt: str) -> list[int]:
    return [e["step"] for e in read_events(storage.resolve(uri)).get(attempt, []) if e["e"] == "step"]


@pytest.mark.parametrize("reset_bytes", [1 << 20, 1], ids=["spool-kept", "spool-emptied-after-each-batch"])
def test_the_steps_a_killed_rank_0_had_not_batched_reach_storage_from_its_spool(s3_server, tmp_path, reset_bytes):
    uri = s3_server.bucket_uri("spool")
    attempt = _killed_writer(uri, tmp_path, reset_bytes=reset_bytes)
    assert _steps(uri, attempt) == list(range(1, 21))  # the batches; 21-25 died with the process
    assert ship_orphaned_events(_spool(tmp_path)) == 1
    assert _steps(uri, attempt) == list(range(1, 26))
    assert os.listdir(_spool(tmp_path)) == []  # shipped, then removed
    assert ship_orphaned_events(_spool(tmp_path)) == 0


def test_a_log_closed_with_everything_shipped_leaves_no_spool_and_a_refused_batch_is_written_again(
    s3_server, tmp_path, monkeypatch
):
    monkeypatch.setenv("RAY_GOODPUT_EVENTS_SPOOL_DIR", str(_spool(tmp_path)))
    shipped = EventLog(storage.resolve(s3_server.bucket_uri("closed")), rank=0, world_size=1)
    shipped.emit("step", step=1, n=1, t0=1.0, fetch=0.0, ckpt=0.0)
    shipped.close()
    assert os.listdir(_spool(tmp_path)) == []
    proxy = FlakyProxy(s3_server.endpoint)
    try:
        uri = s3_server.bucket_uri("unshipped").replace(s3_server.endpoint, proxy.endpoint)
        proxy.outage(3600)  # before the log's first batch
        kept = EventLog(storage.resolve(uri), rank=0, world_size=1)
        kept.emit("step", step=1, n=1, t0=1.0, fetch=0.0, ckpt=0.0)
        kept.close()  # its batch refused: the spool stays for a sweep once this process ends
        left = sorted(p.suffix for p in _spool(tmp_path).iterdir())
        assert left == [".jsonl", ".root"], left  # nothing marked sent
        assert ship_orphaned_events(_spool(tmp_path)) == 0  # its writer (this process) lives
        proxy.outage(0)  # storage back: the log's own next batch writes what was refused
        wait_for(lambda: _steps(uri, kept.attempt) == [1], timeout_s=60, what="the refused batch written again")
    finally:
        proxy.close()


def test_the_spool_of_a_rank_0_that_steps_during_every_upload_stays_small_and_holds_the_unsent_tail(
    s3_server, tmp_path, monkeypatch
):
    """The spool was emptied only after a batch with no event since it was taken. A rank 0
    whose steps are shorter than a batch's upload emits during nearly every upload, so its
    spool was never emptied: about 1 GB a day at 100 steps a second, in ``$TMPDIR``."""
    from ray_goodput.goodput import _events

    monkeypatch.setenv("RAY_GOODPUT_EVENTS_SPOOL_DIR", str(_spool(tmp_path)))
    monkeypatch.setattr(_events, "SPOOL_RESET_BYTES", 2000)
    monkeypatch.setattr(_events, "FLUSH_INTERVAL_S", 3600.0)  # the test's flush() is the only one
    uri = s3_server.bucket_uri("busy")
    log = EventLog(storage.resolve(uri), rank=0, world_size=1)
    step = 0

    def emit() -> None:
        nonlocal step
        step += 1
        log.emit("step", step=step, n=1, t0=float(step), fetch=0.0, ckpt=0.0)

    real_write = _events.write_bytes

    def write_while_a_step_ends(*args, **kwargs):
        emit()  # the training thread's next step, while the batch uploads
        return real_write(*args, **kwargs)

    monkeypatch.setattr(_events, "write_bytes", write_while_a_step_ends)
    [spool_log] = _spool(tmp_path).glob("*.jsonl")
    for _ in range(30):
        for _ in range(10):
            emit()
        log.flush()
    written = step * len('{"e": "step", "t": 0000000000.000000, "seq": 000, "step": 000, "n": 1}\n')
    assert spool_log.stat().st_size < 2 * 2000 < written / 4
    # What it holds past its mark is what storage does not have yet: the last step, emitted
    # during the last batch's upload.
    sent = int(spool_log.with_suffix(".sent").read_text())
    tail = [json.loads(line) for line in spool_log.read_bytes()[sent:].splitlines()]
    assert [e["step"] for e in tail] == [step]
    monkeypatch.setattr(_events, "write_bytes", real_write)  # no step during the last batch
    log.flush()
    assert _steps(uri, log.attempt) == list(range(1, step + 1))
    log.close()
    assert os.listdir(_spool(tmp_path)) == []


def test_a_tail_shipped_twice_is_read_once(s3_server, tmp_path):
    # Killed after its first batch (steps 1-5) reached storage, before its spool recorded
    # that: the sweep ships the whole spool again.
    uri = s3_server.bucket_uri("twice")
    attempt = _killed_writer(uri, tmp_path, RAY_GOODPUT_FAULT="events.shipped:1")
    assert _steps(uri, attempt) == list(range(1, 6))
    assert ship_orphaned_events(_spool(tmp_path)) == 1
    names = [i.path.rsplit("/", 1)[1] for i in storage.list_dir(storage.resolve(uri), "goodput/events", recursive=True)]
    assert f"{SWEPT_PREFIX}{0:012d}.jsonl" in names  # from the spool's start: nothing was marked sent
    events = read_events(storage.resolve(uri))[attempt]
    assert [e["step"] for e in events if e["e"] == "step"] == list(range(1, 6))
    assert sorted(e["seq"] for e in events) == list(range(len(events)))


def test_a_spool_storage_refused_stays_until_storage_takes_it(s3_server, tmp_path):
    proxy = FlakyProxy(s3_server.endpoint)
    uri = s3_server.bucket_uri("down").replace(s3_server.endpoint, proxy.endpoint)
    try:
        attempt = _killed_writer(uri, tmp_path)
        proxy.outage(3600)  # storage down for the sweep
        assert ship_orphaned_events(_spool(tmp_path)) == 0
        assert [p.suffix for p in _spool(tmp_path).iterdir() if p.suffix == ".jsonl"] == [".jsonl"]  # put back
        proxy.outage(0)
        # Another process's sweep (this one waits before it tries that spool again).
        spool = str(_spool(tmp_path))
        sweep = f"from ray_goodput.goodput._events import ship_orphaned_events as s; print(s({spool!r}))"
        out = subprocess.run([sys.executable, "-c", sweep], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.split()[-1] == "1", out.stderr
        assert _steps(uri, attempt) == list(range(1, 26))
    finally:
        proxy.close()


def test_sequence_ranges_drop_every_event_read_before_whatever_the_chunks_overlap():
    rng = random.Random(7)
    for _ in range(200):
        total = rng.randint(1, 60)
        chunks = []
        for _ in range(rng.randint(1, 8)):  # overlapping runs of consecutive numbers, any order
            lo = rng.randrange(total)
            chunks.append(list(range(lo, rng.randint(lo + 1, total))))
        seen, kept = _Seqs(), []
        for chunk in chunks:
            kept += [e["seq"] for e in seen.keep_new([{"e": "step", "seq": n} for n in chunk])]
        assert sorted(kept) == sorted({n for c in chunks for n in c})
    assert _Seqs().keep_new([{"e": "step"}, {"e": "step"}]) == [{"e": "step"}, {"e": "step"}]  # no seq: always kept


def test_a_spool_under_a_directory_others_can_write_is_refused_and_never_swept(tmp_path):
    """The default spool's parent, ``$TMPDIR/ray_goodput-<uid>``, has a predictable name:
    another user who made it first (mode 0777, no sticky bit) could rename our 0700 spool
    away and put theirs in its place, and the sweep would unpickle their ``.root``: code
    run in the node uploader. Only the spool itself was checked."""
    from ray_goodput.goodput._events import _make_private

    parent = tmp_path / "ray_goodput-made-by-someone-else"
    parent.mkdir()
    parent.chmod(0o777)
    with pytest.raises(PermissionError, match="RAY_GOODPUT_EVENTS_SPOOL_DIR"):
        _make_private(parent / "goodput-spool")
    spool = parent / "goodput-spool"
    found = spool / "123-1.0-abc.jsonl"  # a dead writer's spool, as a sweep finds one
    found.write_text('{"e": "step"}\n')
    (spool / "123-1.0-abc.root").write_bytes(b"not ours to unpickle")
    assert ship_orphaned_events(spool) == 0
    assert sorted(p.name for p in spool.iterdir()) == ["123-1.0-abc.jsonl", "123-1.0-abc.root"]  # not touched
    parent.chmod(0o1777)  # as /tmp: others may add, none may rename what is ours
    assert _make_private(spool) == spool
    link = tmp_path / "their-link"  # a link another user owns could be pointed elsewhere
    link.symlink_to(parent)
    os.lchown(link, 4242, 4242)
    with pytest.raises(PermissionError):
        _make_private(link / "goodput-spool")


def test_a_spool_another_sweep_took_meanwhile_is_left_to_it(s3_server, tmp_path):
    """Two sweeps on one node: the second took the spool from the first between its rename
    and its read (it judged the first taker dead by the spool's old mtime). The first then
    found its taken file gone, called the spool unreadable and deleted its ``.root`` and
    ``.sent``, so the second dropped the whole tail too."""
    from ray_goodput.goodput._events import _ship

    uri = s3_server.bucket_uri("raced")
    attempt = _killed_writer(uri, tmp_path)
    spool = _spool(tmp_path)
    [log] = spool.glob("*.jsonl")
    stem = log.name.removesuffix(".jsonl")
    mine, theirs = spool / f"{stem}.1.shipping", spool / f"{stem}.2.shipping"
    log.rename(theirs)  # taken by the other sweep: ours (``mine``) is gone
    assert _ship(spool, stem, mine, log.stat().st_mtime if log.exists() else 0.0) == 0
    assert (spool / f"{stem}.root").exists()
    theirs.rename(log)  # as if the other sweep's taker died: a later sweep ships it whole
    assert ship_orphaned_events(spool) == 1
    assert _steps(uri, attempt) == list(range(1, 26))


def test_a_run_that_ends_cleanly_leaves_no_spool_behind(s3_server, tmp_path, monkeypatch):
    """Nothing in the library closes rank 0's event log, so every clean run left its spool
    files in ``$TMPDIR`` until some uploader swept them after the process was gone (never,
    without uploaders)."""
    from ray_goodput.goodput._recorder import StepRecorder

    monkeypatch.setenv("RAY_GOODPUT_EVENTS_SPOOL_DIR", str(_spool(tmp_path)))
    uri = s3_server.bucket_uri("ended")
    log = EventLog(storage.resolve(uri), rank=0, world_size=1)
    recorder = StepRecorder(log)
    recorder.step(1)
    assert sorted(p.suffix for p in _spool(tmp_path).iterdir()) == [".jsonl", ".root"]
    recorder.end()
    assert os.listdir(_spool(tmp_path)) == []
    recorder.recovery_point(1, at=2.0)  # after the end (the last commit, settled by close()): shipped at once
    events = read_events(storage.resolve(uri))[log.attempt]
    assert [e["e"] for e in events][-2:] == ["end", "recovery_point"]


def test_a_chunk_listed_before_its_writer_closed_it_is_read_again_at_the_next_poll(tmp_path):
    """A chunk object is immutable once written, so the reader read each one once. HDFS
    lists a file while it is written, empty until closed: a poll that met a chunk then read
    no event from it, marked it read, and its steps were missing from every later ledger,
    the final one included. A chunk is read only once it ends a line; until then it is
    read again."""
    from ray_goodput.goodput import EventReader
    from ray_goodput.goodput._events import EVENTS_DIR

    root = storage.resolve(str(tmp_path / "run"))
    chunk = tmp_path / "run" / EVENTS_DIR / "attempt-1" / "000001.jsonl"
    chunk.parent.mkdir(parents=True)
    event = {"t": 1.0, "seq": 1, "kind": "step", "step": 1}
    reader = EventReader(root)
    for partial in (b"", json.dumps(event).encode()[:10]):  # being written: empty, then cut mid-line
        chunk.write_bytes(partial)
        assert reader.poll().get("attempt-1", []) == []
    reads = reader.reads
    assert reader.poll().get("attempt-1", []) == [] and reader.reads == reads  # unchanged: not read again
    chunk.write_bytes((json.dumps(event) + "\n").encode())  # closed
    assert [e["step"] for e in reader.poll()["attempt-1"]] == [1]
