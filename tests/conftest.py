"""Shared fixtures and test ordering for the whole suite; any test module may use them.

Markers (registered in pyproject.toml; ``python -m pytest`` runs everything):

- ``ray``: needs a Ray instance. Added automatically to tests that use ``ray_local``.
- ``cluster``: needs a multi-node ``ray.cluster_utils.Cluster`` (implies ``ray``). Added
  automatically to tests that use ``ray_cluster``.
- ``slow``: takes more than ~20 s. ``python -m pytest -m "not slow"`` skips them.

Fixtures:

- ``s3_server`` (session): moto's S3 server over HTTP; ``s3_server.bucket_uri(prefix)``
  makes a fresh bucket and returns an ``s3://...?endpoint_override=...&scheme=http`` URI;
  ``s3_server.endpoint`` is its ``host:port`` (e.g. for a ``FlakyProxy``).
- ``ray_local`` (module): the shared single-node Ray (4 CPUs, no dashboard, driver logs
  off; workers get the repository first on ``PYTHONPATH`` and a 0.1 s Train health check).
- ``ray_cluster`` (module): the shared multi-node cluster, a
  :class:`ray_goodput.testing._ray.RayCluster`: a head with 2 CPUs and two worker nodes
  with 2 CPUs and ``{"slot": 1}`` each (``.address``, ``.worker_ids``, ``.remove(id)``:
  kill a worker node and wait until its processes exited, ``.top_up()``: add nodes
  back). Every test starts with both worker nodes; a test that pulls one calls
  ``top_up()`` itself if it needs the nodes again.

``early(start, wave=1)`` (marker): the test's long-running subprocess is started by
``start(dir)`` in the background, and the test, which gets ``(process, dir)`` from the ``early``
fixture (a module fixture calls ``early_process(start)``), only waits for its result. Wave 1
starts when collection ends, beside the quick tests that need no Ray (each leaves about one
core idle); each later wave starts once every process of the waves before it has exited, so
that a long run does not compete with the ones already running. Tests sharing one ``start``
share its process. A test that reaches its process before its wave started starts it.

Each Ray kind starts once per session: tests are ordered (no Ray, then ``ray_local``,
then ``ray_cluster``, then tests marked ``ray``/``cluster`` that start their own Ray,
each group in collection order), and switching kind shuts the other down. A test that
starts its own Ray must be marked ``ray`` or ``cluster`` so that no shared instance is
running when it does. Tests that need no Ray never start one. Node services (the
per-node uploader and cache actors) are ended after each module that used a shared Ray.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
# Ray Train's preemption watcher only logs node drains, and no test drains a node: it is
# one more actor process per worker group (~1.8 s of CPU each here, 18 in a suite run).
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

ROOT = str(Path(__file__).resolve().parents[1])
# The shared Ray's workers import the tests' modules: its processes inherit this
# environment (set here, at import, before any thread of the suite reads it; not as a
# runtime_env, which costs every worker a setup process, see docs/testing.md).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
# The goodput event spools of this session's processes (Ray's inherit it): apart from other
# sessions', whose storage (a moto server) is gone, and removed at the session's end.
_SPOOL = tempfile.mkdtemp(prefix="ray_goodput-spool-")
os.environ["RAY_GOODPUT_EVENTS_SPOOL_DIR"] = _SPOOL
_ORDER = {"none": 0, "local": 1, "cluster": 2, "own": 3}
_shared = None  # the SharedRay, made on first use so that tests without Ray never import it
Start = Callable[[Path], subprocess.Popen]
_early: dict[Start, tuple[subprocess.Popen, Path]] = {}  # start function -> started process, its directory
_waves: dict[int, list[Start]] = {}  # later waves' start functions, not started yet
_early_lock = threading.Lock()
_session_over = threading.Event()


class S3Server:
    """moto's S3 server in a subprocess, on a free loopback port."""

    def __init__(self) -> None:
        from ray_goodput.testing._s3 import start_moto_server

        self.proc, self.endpoint = start_moto_server()

    def bucket_uri(self, prefix: str = "") -> str:
        """A fresh bucket; returns an s3:// URI with the endpoint override."""
        import pyarrow.fs as pafs

        bucket = f"b-{uuid.uuid4().hex[:12]}"
        fs = pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http", allow_bucket_creation=True)
        fs.create_dir(bucket)
        path = f"{bucket}/{prefix}".rstrip("/")
        return f"s3://{path}?endpoint_override={self.endpoint}&scheme=http"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server()
    yield server
    server.close()


# ---- one shared Ray per kind --------------------------------------------------------------


def _shared_ray():
    global _shared  # noqa: PLW0603 - one Ray instance per test session, made on first use
    if _shared is None:
        from ray_goodput.testing._ray import SharedRay

        _shared = SharedRay(
            cluster_env={
                "PYTHONPATH": os.environ["PYTHONPATH"],
                "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
                "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
            }
        )
    return _shared


def _kind(item: pytest.Item) -> str:
    names = getattr(item, "fixturenames", ())
    if "ray_cluster" in names:
        return "cluster"
    if "ray_local" in names:
        return "local"
    if item.get_closest_marker("ray") or item.get_closest_marker("cluster"):
        return "own"
    return "none"


@pytest.hookimpl(tryfirst=True, specname="pytest_collection_modifyitems")
def pytest_mark_ray_users(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark users of the shared fixtures, before ``-m`` selects by marker (a hook's name
    must start with ``pytest_``; ``specname`` says which hook it is)."""
    for item in items:
        kind = _kind(item)
        if kind == "cluster" and not item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.cluster)
        if kind != "none" and not item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.ray)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group tests by the Ray they need (stable sort: after pytest's own fixture-driven
    order, which it keeps within each group)."""
    items.sort(key=lambda it: (_ORDER[_kind(it)], _slot(it)))


def _slot(item: pytest.Item) -> int:
    """Within the tests that need no Ray: the quick ones, then the ``early`` ones (their
    subprocesses ran beside the quick ones), then the other slow ones (which would compete
    with them for the cores). Tests that share a Ray keep their order: their module
    fixtures must not be split."""
    if item.get_closest_marker("early"):
        return 1
    return 2 if _kind(item) == "none" and item.get_closest_marker("slow") else 0


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start wave 1 of the selected ``early`` tests' subprocesses, and a thread that starts
    each later wave once the processes before it have exited (see the module docstring)."""
    if session.config.option.collectonly:
        return
    waves: dict[int, list[Start]] = {}
    for item in session.items:
        if item.get_closest_marker("early") is not None:
            start, wave = _early_marker(item)
            if start not in waves.setdefault(wave, []):
                waves[wave].append(start)
    if not waves:
        return
    first = min(waves)
    with _early_lock:
        _waves.update({w: starts for w, starts in waves.items() if w != first})
    for start in waves[first]:
        early_process(start)
    if _waves:
        threading.Thread(target=_start_later_waves, name="early-waves", daemon=True).start()


def _early_marker(item: pytest.Item) -> tuple[Start, int]:
    marker = item.get_closest_marker("early")
    wave = marker.kwargs.get("wave", 1)
    if len(marker.args) != 1 or not callable(marker.args[0]) or set(marker.kwargs) - {"wave"} or wave < 1:
        raise pytest.UsageError(
            f"{item.nodeid}: use @pytest.mark.early.with_args(start[, wave=N]), start(directory) -> subprocess.Popen"
        )
    return marker.args[0], wave


def _start_later_waves() -> None:
    while not _session_over.wait(0.2):
        with _early_lock:  # processes start under the lock, so the session's end sees each one
            if not _waves:
                return
            if not any(proc.poll() is None for proc, _ in _early.values()):
                for start in _waves.pop(min(_waves)):
                    _start_early(start)


def early_process(start: Start) -> tuple[subprocess.Popen, Path]:
    """``(process, directory)`` of the early subprocess that ``start`` starts: the one already
    started, else started now (also when its wave has not come yet)."""
    with _early_lock:
        if start not in _early:
            for starts in _waves.values():
                if start in starts:
                    starts.remove(start)
            _start_early(start)
        return _early[start]


def _start_early(start: Start) -> None:
    directory = Path(tempfile.mkdtemp(prefix="ray_goodput-early-"))
    _early[start] = (start(directory), directory)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL an ``early`` process and the processes it started (rank, fork-server, moto
    and Ray processes of the soak). It stays in pytest's process group, so whatever kills
    that group from outside (a CI job timeout) takes it too."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.kill()
    proc.wait(timeout=30)


@pytest.fixture
def early(request):
    """``(process, directory)`` of this test's ``early`` subprocess (started now when its
    wave has not started it yet)."""
    return early_process(_early_marker(request.node)[0])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture: the shared Ray this test needs is the one running, and none
    runs for a test that needs none or starts its own."""
    kind = _kind(item)
    if kind in ("local", "cluster"):
        cluster = _shared_ray().use(kind)
        if cluster is not None:
            cluster.top_up()  # a node an earlier test pulled is replaced
    elif _shared is not None:
        _shared.stop()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _session_over.set()
    shutil.rmtree(_SPOOL, ignore_errors=True)
    with _early_lock:  # no wave starts after this
        _waves.clear()
        started = list(_early.values())
    for proc, directory in started:
        kill_tree(proc)  # what it left running, too (or all of it, when its test did not run)
        shutil.rmtree(directory, ignore_errors=True)
    if _shared is not None:
        _shared.stop()


def _end_node_services() -> None:
    """End the per-node uploader and cache actors (detached: they would outlive the
    module and show up in the next module's status and lookups)."""
    from ray_goodput.checkpoint.uploader._actor import KIND as UPLOADER
    from ray_goodput.data._cache_actor import KIND as CACHE
    from ray_goodput.runtime import _services

    for kind in (UPLOADER, CACHE):
        _services.shutdown(kind, drain_timeout_s=10)


@pytest.fixture(scope="module")
def ray_local():
    """The shared single-node Ray (see the module docstring)."""
    _shared_ray().use("local")
    yield
    if _shared_ray().kind == "local":
        _end_node_services()


@pytest.fixture(scope="module")
def ray_cluster():
    """The shared multi-node cluster with both worker nodes up (see the module docstring)."""
    cluster = _shared_ray().use("cluster")
    cluster.top_up()
    yield cluster
    if _shared_ray().kind == "cluster":
        _end_node_services()
