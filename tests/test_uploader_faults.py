"""The node uploader under real faults on a real multi-node Ray cluster (one machine):
a worker SIGKILLed right after save() returned, the uploader killed mid-upload, a stuck
upload that the uploader's wait gives up on, and no uploader left behind after a run ends."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_goodput import Checkpointer, CheckpointError, list_checkpoints
from ray_goodput.checkpoint.protocol._layout import step_dir
from ray_goodput.checkpoint.uploader._actor import KIND
from ray_goodput.cli import main as cli_main
from ray_goodput.runtime import _services
from ray_goodput.testing import FlakyProxy, wait_for

pytestmark = pytest.mark.cluster


def _big_state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048))}


@ray.remote(num_cpus=0)
class Worker:
    """A training process with a Checkpointer (world size 1) on a chosen node."""

    def __init__(self, uri: str, seed: int) -> None:
        self.state = _big_state(seed)
        self.ckpt = Checkpointer(uri, uploader="actor", keep_last=5)

    def pid(self) -> int:
        return os.getpid()

    def save(self, step: int) -> float:
        self.ckpt.save(step, self.state)
        return self.ckpt.stats.last_block_seconds

    def save_and_die(self, step: int) -> None:
        from ray_goodput.testing import kill_self

        self.ckpt.save(step, self.state)
        kill_self()  # at once: the uploader may not have read the job yet

    def wait(self) -> list[int]:
        self.ckpt.wait()
        return self.ckpt.stats.committed

    def arenas(self) -> list[str]:
        return [str(a.path) for a in self.ckpt._arenas.arenas]

    def by_actor_calls(self) -> bool:
        """Whether its jobs go to the uploader by actor calls (no connection to its socket)."""
        return self.ckpt._uploader._channel is None

    def connect(self) -> None:
        """Until connected to the uploader: a save made before hands its job over later."""
        self.ckpt._uploader._attached()

    def released(self, step: int) -> bool:
        return self.ckpt._pending[step].handoff.released.done()  # its arena may be reused

    def key(self, step: int) -> str:
        return self.ckpt._pending[step].handoff.key  # the job's name in the uploader

    def restore(self) -> tuple[int | None, list]:
        step = self.ckpt.restore(self.state)
        return step, [t.clone() for t in self.state["model"].state_dict().values()]

    def close(self) -> None:
        self.ckpt.close()

    def start_events(self, uri: str) -> str:
        """A goodput event log on ``uri`` that batches only when told (as rank 0 keeps one)."""
        from ray_goodput import storage
        from ray_goodput.goodput import _events

        _events.FLUSH_INTERVAL_S = 3600.0
        self.events = _events.EventLog(storage.resolve(uri), rank=0, world_size=1)
        return self.events.attempt

    def steps_then_die(self, batched: int, more: int) -> None:
        """Steps 1..``batched`` batched to storage, ``more`` after them not, then a SIGKILL."""
        from ray_goodput.testing import kill_self

        for step in range(1, batched + more + 1):
            self.events.emit("step", step=step, n=1, t0=float(step), fetch=0.0, ckpt=0.0)
            if step == batched:
                self.events.flush()
        kill_self()


def _on(node_id: str):
    return Worker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))


def _other_node(ray_cluster) -> str:
    """A worker node: not the head, where the driver runs."""
    return ray_cluster.worker_ids[0]


def _worker_with_a_commit(ray_cluster, uri: str, seed: int, step: int = 1):
    """A worker on a worker node that saved and committed ``step``: it is connected to its
    node's uploader. Returns (node, worker, uploader)."""
    node = _other_node(ray_cluster)
    worker = _on(node).remote(uri, seed=seed)
    ray.get(worker.save.remote(step))
    assert ray.get(worker.wait.remote()) == [step]
    return node, worker, _services.find(KIND)[node]


def _wait_committed(uri: str, step: int, timeout: float = 120) -> None:
    wait_for(
        lambda: any(i.step == step and i.committed for i in list_checkpoints(uri)),
        timeout_s=timeout,
        what=f"step {step} committed in {uri}",
        interval_s=0.2,
    )


@contextlib.contextmanager
def _uploader_stopped(node: str) -> Iterator[None]:
    """The node's uploader process stopped (SIGSTOP) for the block: it cannot answer."""
    from ray_goodput.checkpoint.uploader._actor import _actor_class

    uploader = _services.get_or_create(_actor_class(), KIND, node, node_id=node, max_concurrency=64)
    pid = ray.get(uploader.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _save_and_die(node: str, uri: str, *, seed: int, step: int) -> None:
    """A new worker on ``node`` saves ``step`` and is SIGKILLed the moment save() returned."""
    worker = _on(node).remote(uri, seed=seed)
    with pytest.raises(ray.exceptions.RayActorError):  # not GetTimeoutError: save() did not wait
        ray.get(worker.save_and_die.remote(step), timeout=60)


class _Placed:
    """What the trainer's callback reads of one of Ray Train's ``Worker``s: its node (a
    stand-in; the actors the callback creates are real)."""

    def __init__(self, node_id: str) -> None:
        self.metadata = SimpleNamespace(node_id=node_id)


def test_the_trainer_creates_each_workers_uploader_on_the_workers_node_in_their_runtime_env(ray_cluster):
    # Ray Train runs this callback in its controller (here: the driver, on the head node)
    # once a worker group is up, and once a replica replaced in replica mode is; the
    # uploaders must go where the workers are, with the environment a worker-created one
    # would have inherited.
    from ray.util.state import list_actors

    from ray_goodput.driver._node_services import NodeServices

    nodes = list(ray_cluster.worker_ids)
    mark = f"placed-{os.getpid()}"
    services = NodeServices({"env_vars": {"RG_TEST_UPLOADER_MARK": mark}})
    group = SimpleNamespace(get_workers=lambda: [_Placed(nodes[0]), _Placed(nodes[0])])
    replacement = SimpleNamespace(get_workers=lambda: [_Placed(nodes[1])])
    services.after_worker_group_start(group)
    services.after_replica_group_start(replacement)

    def placed() -> dict[str, str]:
        alive = list_actors(filters=[("state", "=", "ALIVE")])
        return {a.name: a.node_id for a in alive if a.name.startswith(f"{KIND}:")}

    want = {_services.actor_name(KIND, n): n for n in nodes}
    wait_for(
        lambda: all(placed().get(name) == n for name, n in want.items()),
        timeout_s=60,
        what="an uploader alive on each worker's node",
        interval_s=0.2,
    )
    assert ray_cluster.worker_ids[0] != ray.get_runtime_context().get_node_id()  # not the caller's node
    for n in nodes:
        handle = _services.find(KIND)[n]
        got = ray.get(handle.__ray_call__.remote(lambda _self: os.environ.get("RG_TEST_UPLOADER_MARK")), timeout=30)
        assert got == mark


def _hold_jobs(uploader, until: str) -> None:
    """Run in the uploader (``__ray_call__``): hold the lock it takes to accept a job until
    the file ``until`` exists (two minutes at most)."""
    held = threading.Event()

    def hold() -> None:
        with uploader._lock:  # what accepting a job waits on
            held.set()
            wait_for(lambda: os.path.exists(until), timeout_s=120, what=until, interval_s=0.02)

    threading.Thread(target=hold, daemon=True).start()
    if not held.wait(60):
        raise TimeoutError("the uploader's lock was not taken within 60 s")


def test_worker_killed_right_after_save_still_commits(ray_cluster, s3_server, tmp_path):
    # save() returns once the job's frame is written to the uploader's socket, without
    # waiting for the uploader to accept it. Here the uploader cannot accept it (its lock
    # is held) until the worker, SIGKILLed the moment save() returned, is dead.
    uri = s3_server.bucket_uri("killed-worker")
    node, worker, uploader = _worker_with_a_commit(ray_cluster, uri, 1, step=4)
    opened = tmp_path / "open"
    ray.get(uploader.__ray_call__.remote(_hold_jobs, str(opened)), timeout=60)
    with pytest.raises(ray.exceptions.RayActorError):  # not GetTimeoutError: save() did not wait
        ray.get(worker.save_and_die.remote(5), timeout=30)
    assert not any(i.step == 5 for i in list_checkpoints(uri))
    opened.touch()
    _wait_committed(uri, 5)
    # The uploader is on the worker's node and shows in the state API (the dashboard's source).
    from ray.util.state import list_actors

    names = {a.name for a in list_actors(filters=[("state", "=", "ALIVE")])}
    assert _services.actor_name(KIND, node) in names
    reader = _on(node).remote(uri, seed=2)
    step, tensors = ray.get(reader.restore.remote())
    assert step == 5
    expected = _big_state(1)["model"].state_dict().values()
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected))
    ray.get(reader.close.remote())


def _killed_and_its_arenas_swept(worker, node: str) -> None:
    """SIGKILL ``worker`` (no close, no goodbye), whose arenas exist, and wait for its node's
    uploader, still serving (not exiting), to remove them."""
    arenas = ray.get(worker.arenas.remote())
    assert arenas and all(os.path.exists(p) for p in arenas)
    ray.kill(worker)
    wait_for(
        lambda: not any(os.path.exists(p) for p in arenas),
        timeout_s=20,  # the uploader lives on for 30 s after its last worker died
        what=f"the killed worker's arenas {arenas} removed",
        interval_s=0.2,
    )
    assert node in _services.find(KIND)  # removed by the uploader still serving, not at its exit


def test_a_killed_workers_snapshot_arenas_are_removed_by_its_nodes_uploader(ray_cluster, tmp_path):
    # A killed worker cannot remove its arenas (in /dev/shm: memory), and only the next
    # Checkpointer of a run on the node swept them: when a job's last attempt was killed,
    # twice its shard's bytes stayed until a reboot. Its uploader, which ran the worker's
    # jobs, removes them once the process is gone.
    node = _other_node(ray_cluster)
    worker = _on(node).remote(str(tmp_path / "root"), seed=5)
    ray.get(worker.save.remote(1))
    ray.get(worker.save.remote(2))  # while 1 may still be written: both arenas in use
    assert ray.get(worker.wait.remote())[-1] == 2
    _killed_and_its_arenas_swept(worker, node)


def test_a_killed_workers_arenas_are_removed_while_its_uploader_serves_however_its_jobs_came(ray_cluster, tmp_path):
    # The uploader swept a worker's arenas only when its connection ended without a goodbye,
    # and only if its process was gone within 10 s of that: a worker whose jobs came by
    # actor calls (it could not reach the socket), or that outlived its connection, kept
    # its arenas (twice its shard, in /dev/shm) until the uploader exited. Every worker
    # whose jobs the uploader ran is now watched until its process is gone.
    from ray_goodput.checkpoint.uploader._actor import _actor_class

    node = _other_node(ray_cluster)
    uploader = _services.get_or_create(_actor_class(), KIND, node, node_id=node, max_concurrency=64)
    # Registered until the end: an uploader whose only client left exits within seconds,
    # and the worker (slower to start) would make a new one, socket and all.
    os.unlink(ray.get(uploader.endpoint.remote(os.getpid(), None, "probe"), timeout=60))  # no socket to reach
    try:
        worker = _on(node).remote(str(tmp_path / "root"), seed=6)
        ray.get(worker.save.remote(1))
        ray.get(worker.save.remote(2))
        assert ray.get(worker.wait.remote())[-1] == 2
        assert ray.get(worker.by_actor_calls.remote())
        _killed_and_its_arenas_swept(worker, node)
    finally:
        ray.get(uploader.unregister.remote(os.getpid(), "probe"), timeout=60)
        ray.kill(uploader, no_restart=True)  # the next test's uploader on the node has its socket


def _cut_connections(uploader) -> None:
    """Run in the uploader (``__ray_call__``): break every worker's connection from its end,
    as a send stuck past its bound does."""
    for peer in list(uploader._peers):
        peer.sock.shutdown(socket.SHUT_RDWR)


def test_a_connection_broken_while_the_uploader_lives_keeps_the_arena_until_the_job_lets_go(
    ray_cluster, s3_server, tmp_path
):
    # Before, a broken connection freed the arenas of the jobs sent on it, and the next save
    # could overwrite an arena the uploader was still writing a checkpoint from; and it
    # failed a save the uploader went on to commit (found in review). Now the worker asks
    # the actor, which answers once the job let go of its arena, and with its outcome.
    uri = s3_server.bucket_uri("cut")
    node, worker, uploader = _worker_with_a_commit(ray_cluster, uri, 7)
    opened = tmp_path / "open"
    ray.get(uploader.__ray_call__.remote(_hold_jobs, str(opened)), timeout=60)
    ray.get(worker.save.remote(2), timeout=60)
    ray.get(uploader.__ray_call__.remote(_cut_connections), timeout=60)
    time.sleep(1.0)
    assert not ray.get(worker.released.remote(2), timeout=60)  # the uploader holds it still
    opened.touch()
    wait_for(
        lambda: ray.get(worker.released.remote(2), timeout=60),
        timeout_s=60,
        what="step 2's arena released by the uploader",
        interval_s=0.1,
    )
    assert ray.get(worker.wait.remote(), timeout=120) == [1, 2]  # committed, and every rank hears it
    _wait_committed(uri, 2)
    ray.get(worker.save.remote(3))  # a new connection takes it
    assert ray.get(worker.wait.remote(), timeout=120) == [1, 2, 3]
    ray.get(worker.close.remote())


def _save_held_at(proxy: FlakyProxy, worker, step: int) -> None:
    """``worker`` saves ``step``; returns once its upload reached the proxy, which holds it
    (until ``proxy.release()``)."""
    proxy.stall(f"/{step_dir(step)}/", methods=("PUT", "POST"))
    ray.get(worker.save.remote(step))
    wait_for(
        lambda: proxy.holding_in(f"/{step_dir(step)}/"),
        timeout_s=60,
        what=f"step {step}'s upload reaching storage",
        interval_s=0.01,
    )


def _killed_with_save_2_held(ray_cluster, s3_server, name: str, *, seed: int) -> tuple[FlakyProxy, str, str]:
    """A worker that committed step 1 through a proxy, saved step 2 (its upload held at the
    proxy until ``proxy.release()``) and was killed; its node's uploader goes on. Returns
    (proxy, the storage URI through it, the node)."""
    proxy = FlakyProxy(s3_server.endpoint)
    uri = s3_server.bucket_uri(name).replace(s3_server.endpoint, proxy.endpoint)
    node, worker, _ = _worker_with_a_commit(ray_cluster, uri, seed)
    try:
        _save_held_at(proxy, worker, 2)
    except BaseException:
        proxy.close()
        raise
    ray.kill(worker, no_restart=True)
    return proxy, uri, node


def test_uploader_killed_mid_upload(ray_cluster, s3_server):
    proxy = FlakyProxy(s3_server.endpoint)
    uri = s3_server.bucket_uri("killed-uploader").replace(s3_server.endpoint, proxy.endpoint)
    node, worker, uploader = _worker_with_a_commit(ray_cluster, uri, 3)
    # Step 2's upload is held at the proxy: the kill lands mid-upload, not after a commit
    # that a loaded machine let finish first.
    try:
        _save_held_at(proxy, worker, 2)
        ray.kill(uploader, no_restart=True)
        with pytest.raises(CheckpointError):
            ray.get(worker.wait.remote())
    finally:
        proxy.release()
    assert [(i.step, i.committed) for i in list_checkpoints(uri) if i.committed] == [(1, True)]
    ray.get(worker.save.remote(3))  # a new uploader is created and takes it
    assert 3 in ray.get(worker.wait.remote())
    assert [i.step for i in list_checkpoints(uri) if i.committed] == [1, 3]
    step, _ = ray.get(worker.restore.remote())
    assert step == 3
    ray.get(worker.close.remote())
    proxy.close()


def test_status_then_uploader_exits_when_its_clients_close(ray_cluster, tmp_path, capsys):
    uri = str(tmp_path / "root")
    node = _other_node(ray_cluster)
    worker = _on(node).remote(uri, seed=4)
    ray.get(worker.save.remote(1))
    assert ray.get(worker.wait.remote()) == [1]
    assert node in _services.find(KIND)
    # The node's uploader may already have served an earlier test of this module: compare
    # its own stats before and after, and the status line with them.
    # At least this test's one checkpoint: every tensor byte of the model (metadata on top).
    # The uploader tells the worker a job is done before it counts the job in its stats (the
    # worker must not wait for bookkeeping), so the count can trail wait() by a moment: read
    # it right after wait(), it was 0 once in a suite run.
    tensor_bytes = sum(t.numel() * t.element_size() for t in _big_state(4)["model"].state_dict().values())
    uploader = _services.find(KIND)[node]
    wait_for(
        lambda: ray.get(uploader.stats.remote())["bytes_uploaded"] >= tensor_bytes,
        timeout_s=30,
        what="the uploader's stats to count the upload that committed",
        interval_s=0.1,
    )
    uploaded = ray.get(uploader.stats.remote())["bytes_uploaded"]
    # In-process through the CLI's main (a subprocess costs seconds of imports and a Ray
    # connection; test_cli runs the entry point as a real process).
    assert cli_main(["status", "--address", ray_cluster.address]) == 0
    stdout = capsys.readouterr().out
    line = next(ln for ln in stdout.splitlines() if node[:12] in ln)
    assert "queue 0" in line and f"uploaded {uploaded / 1e6:.1f} MB" in line and "last error: -" in line, stdout
    ray.get(worker.close.remote())
    wait_for(
        lambda: node not in _services.find(KIND),
        timeout_s=30,
        what=f"the uploader on {node} to exit after its last client closed",
        interval_s=0.2,
    )


def test_a_worker_killed_before_its_uploader_answered_still_commits_its_save_through_the_next_workers_sweep(
    ray_cluster, s3_server
):
    # A save made before the worker's first connection to the uploader is made does not wait
    # for it: its job is held in a file of the node until handed over. Here the uploader
    # process is stopped (SIGSTOP) before the worker exists, so it cannot answer; the
    # worker is SIGKILLed the moment save() returned; once the uploader runs again it takes
    # the dead worker's job from the file and commits it. Meanwhile the run's next worker
    # sweeps dead workers' arenas as it makes its own: before, that unlinked the held job's
    # snapshot and the save was lost (seen in the restart-fidelity test on a loaded machine:
    # no save of the first attempt committed).
    import pickle
    from pathlib import Path

    from ray_goodput.checkpoint.save._arena_files import sweep_dead
    from ray_goodput.checkpoint.uploader import _held

    uri = s3_server.bucket_uri("held")
    node = _other_node(ray_cluster)
    with _uploader_stopped(node):
        _save_and_die(node, uri, seed=3, step=7)
        [held] = _held.held_dir(node).glob("*.job")  # the job was held in a file
        assert not any(i.step == 7 for i in list_checkpoints(uri))
        job, _ = pickle.loads(held.read_bytes())
        arena = Path(job.arena_path)
        sweep_dead(arena.parent)  # what the run's next worker does as it makes its arenas
        assert arena.exists(), "the held job's snapshot arena was swept"
    _wait_committed(uri, 7)
    wait_for(lambda: not list(_held.held_dir(node).iterdir()), timeout_s=60, what="the held job's file removed")
    sweep_dead(arena.parent)  # the job was taken: now the arena goes, with its mark
    assert not list(arena.parent.glob(arena.name + "*"))
    reader = _on(node).remote(uri, seed=4)
    step, tensors = ray.get(reader.restore.remote())
    assert step == 7
    assert all(torch.equal(a, b) for a, b in zip(tensors, _big_state(3)["model"].state_dict().values()))
    ray.get(reader.close.remote())


def test_a_dead_workers_job_the_uploader_has_not_read_keeps_its_arena_through_the_sweeps(ray_cluster, s3_server):
    # A job sent over the socket sits in the uploader's receive queue until it reads it; a
    # starved uploader reads late. The worker was SIGKILLed meanwhile, and the sweeps of
    # dead workers' arenas (the next attempt's worker as it makes its arenas; the uploader
    # once the worker's process is gone) unlinked the snapshot the queued job still
    # had to map: a save that returned never committed.
    from pathlib import Path

    from ray_goodput.checkpoint.save._arena_files import sweep_dead

    uri = s3_server.bucket_uri("unread")
    node, worker, _ = _worker_with_a_commit(ray_cluster, uri, 8)  # connected: save() writes to the socket
    directory = Path(ray.get(worker.arenas.remote())[0]).parent
    with _uploader_stopped(node):
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.save_and_die.remote(9), timeout=60)
        sweep_dead(directory)  # what the run's next worker does as it makes its arenas
    _wait_committed(uri, 9, timeout=60)
    reader = _on(node).remote(uri, seed=4)
    step, tensors = ray.get(reader.restore.remote())
    assert step == 9
    assert all(torch.equal(a, b) for a, b in zip(tensors, _big_state(8)["model"].state_dict().values()))
    ray.get(reader.close.remote())


def test_the_uploaders_wait_for_a_result_ends_at_its_bound(ray_cluster, s3_server):
    """An actor thread that waits for a save's result gives up after its bound (the worker
    passes twice its ``wait_timeout_s``) instead of waiting on a stuck upload for ever;
    the upload itself goes on and commits once storage answers."""
    proxy = FlakyProxy(s3_server.endpoint)
    uri = s3_server.bucket_uri("stuck").replace(s3_server.endpoint, proxy.endpoint)
    node = _other_node(ray_cluster)
    worker = _on(node).remote(uri, seed=6)
    proxy.stall(f"/{step_dir(1)}/", methods=("PUT", "POST"))
    try:
        ray.get(worker.connect.remote(), timeout=300)  # so that save() hands the job over itself
        ray.get(worker.save.remote(1))
        key = ray.get(worker.key.remote(1))
        uploader = _services.find(KIND)[node]
        # save() returns once its job is written to the uploader's socket, maybe before the
        # uploader read it; asked then, the uploader has no such job (seen once in a suite
        # run, under load): ask once it holds the job, which the stalled upload keeps open.
        wait_for(
            lambda: ray.get(uploader.stats.remote(), timeout=30)["queue"] >= 1,
            timeout_s=60,
            what="the uploader to read step 1's job from its socket",
            interval_s=0.1,
        )
        with pytest.raises(TimeoutError, match=r"step 1 \(rank 0\) was not durable after 1s in the uploader"):
            ray.get(uploader.wait_durable.remote(key, 1.0), timeout=60)
    finally:
        proxy.release()
    assert ray.get(worker.wait.remote()) == [1]  # it went on, and committed
    ray.get(worker.close.remote())
    proxy.close()


def test_the_wait_for_a_runs_uploads_also_waits_for_a_save_a_live_worker_still_holds(ray_cluster, tmp_path):
    """A save made while its worker's connection to the uploader was being made is held in
    a file until the worker hands it over (or, once it died, the uploader takes it). The
    resume choice's wait asked only for the jobs in the uploader: a worker in its teardown
    that still held a newer save let the choice settle on the commit before it."""
    import pickle

    from ray_goodput.checkpoint.uploader import _held
    from ray_goodput.checkpoint.uploader._calls import start_node_uploader, wait_for_uploads
    from ray_goodput.storage import resolve

    node = _other_node(ray_cluster)
    start_node_uploader(node)
    wait_for(lambda: node in _services.find(KIND), timeout_s=120, what=f"the uploader on node {node}")
    root = resolve(str(tmp_path / "run"))
    job = SimpleNamespace(owner_pid=os.getpid(), key=f"held-{os.getpid()}-7", step=7, slots=(), arena_path="")
    held = _held.hold(node, job, pickle.dumps(root))  # this process stands for the live worker
    try:
        assert wait_for_uploads(root, above=5, timeout_s=1.0) == {node: [7]}
        assert wait_for_uploads(root, above=7, timeout_s=1.0) == {}  # not above the step asked for
        threading.Timer(0.5, _held.remove, (held, job)).start()  # the worker hands it over
        assert wait_for_uploads(root, above=5, timeout_s=30.0) == {}
    finally:
        _held.remove(held, job)


def test_a_restart_resumes_from_the_save_a_dead_workers_uploader_was_still_uploading(ray_cluster, s3_server):
    """A CI run of the restart-fidelity test resumed attempt 2 from scratch while the killed
    attempt's uploader was still uploading step 4, which committed during that attempt's
    restore: the work since the last commit was redone though its checkpoint was seconds
    from durable. The resume choice now waits, within a bound, for the uploads of the run's
    storage root still in flight in the node uploaders, then takes the newest commit."""
    from ray_goodput.driver._resume_choice import ResumeChoice
    from ray_goodput.storage import resolve

    proxy, uri, _ = _killed_with_save_2_held(ray_cluster, s3_server, "in-flight", seed=8)
    held_s = 4.0
    try:
        # Within a 1 s bound the upload does not land: the choice stands at step 1, at the bound.
        start = time.monotonic()
        bounded = ResumeChoice(resolve(uri), upload_wait_s=1.0).take(2)
        took_bounded = time.monotonic() - start
        release = threading.Timer(held_s, proxy.release)
        start = time.monotonic()
        release.start()
        waited = ResumeChoice(resolve(uri), upload_wait_s=120.0).take(2)
        took = time.monotonic() - start
    finally:
        proxy.release()
    assert bounded is not None and bounded.step == 1
    assert 1.0 <= took_bounded < 30.0, took_bounded
    assert waited is not None and waited.step == 2  # the upload in flight, committed
    assert took >= held_s - 0.5, took  # it waited for the upload, not for a listing
    assert [i.step for i in list_checkpoints(uri) if i.committed] == [1, 2]
    proxy.close()


def test_a_killed_rank_0s_goodput_events_not_yet_batched_are_shipped_by_its_nodes_uploader(ray_cluster, s3_server):
    """A whole-group restart SIGKILLs rank 0 between two batches of its object-store event
    log; the steps of its last second were in no ledger bucket (the step-failures runs at
    808d57d: 0-4 of 240). The node's uploader, which outlives it, ships its spool."""
    from ray_goodput import storage
    from ray_goodput.goodput import read_events

    uri = s3_server.bucket_uri("events")
    _, worker, _ = _worker_with_a_commit(ray_cluster, uri, 9)  # its node's uploader is up
    attempt = ray.get(worker.start_events.remote(uri), timeout=60)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(worker.steps_then_die.remote(20, 5), timeout=60)

    def steps() -> list[int]:
        events = read_events(storage.resolve(uri)).get(attempt, [])
        return [e["step"] for e in events if e["e"] == "step"]

    wait_for(lambda: steps() == list(range(1, 26)), timeout_s=60, what=f"steps 1-25 of {attempt} in storage")


def test_a_restore_that_chooses_for_itself_resumes_from_the_save_a_dead_workers_uploader_was_still_uploading(
    ray_cluster, s3_server
):
    """The flaky CI run of the restart-fidelity test, again after the driver's fix: that
    test runs Ray Train's own TorchTrainer without a Recovery, so rank 0 of the restore
    chooses, and it took the commit before while the killed worker's uploader was still
    uploading a newer save. Rank 0 now waits for those uploads too."""
    proxy, uri, node = _killed_with_save_2_held(ray_cluster, s3_server, "self-choice", seed=10)
    held_s = 4.0
    try:
        reader = _on(node).remote(uri, seed=11)
        release = threading.Timer(held_s, proxy.release)
        start = time.monotonic()
        release.start()
        step, tensors = ray.get(reader.restore.remote(), timeout=300)
        took = time.monotonic() - start
    finally:
        proxy.release()
    assert step == 2  # the save in flight, committed, not step 1
    assert took >= held_s - 0.5, took
    assert all(torch.equal(a, b) for a, b in zip(tensors, _big_state(10)["model"].state_dict().values()))
    ray.get(reader.close.remote())
    proxy.close()
