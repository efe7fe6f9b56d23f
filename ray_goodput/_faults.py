"""Named fault points in the save/commit path, for fault soaks and crash tests.

``RAY_GOODPUT_FAULT`` is a comma-separated list of ``name:probability[:action]``;
``action`` is ``kill`` (SIGKILL this process, the default) or ``raise``
(:class:`ray_goodput.errors.InjectedFault`). ``RAY_GOODPUT_FAULT_SEED`` seeds the draws
(each process draws from ``seed + pid``, so ranks differ but a rerun repeats). The spec
is parsed again whenever the variable's value changes, so a harness can arm a point inside
a running process (or a process forked from a preloaded server sees its own environment);
with none set :func:`fault_point` costs one environment lookup.

Points (where they sit, and which process runs them):

* ``save.copying``: in the middle of ``save()``'s snapshot copy (worker).
* ``save.queued``: the uploader accepted a job that has not started (uploader side:
  the CheckpointUploader actor, or the worker's ThreadBackend lane).
* ``upload.staging_write``: during the node-local DCP write of a shard (uploader side).
* ``upload.mid_upload``: some files of a shard uploaded, before its rank marker.
* ``commit.before_committed``: in the elected committer (``_commit``), after the last rank
  marker, before ``COMMITTED``.
* ``retention``: between deleting two checkpoint directories.
* ``events.shipped``: a chunk of goodput events written to an object store, before the
  worker's node-local spool records it as shipped (rank 0).
"""

from __future__ import annotations

import os
import random
import signal

from ray_goodput import _env
from ray_goodput.errors import ConfigError, InjectedFault

POINTS = (
    "save.copying",
    "save.queued",
    "upload.staging_write",
    "upload.mid_upload",
    "commit.before_committed",
    "retention",
    "events.shipped",
)
ACTIONS = ("kill", "raise")


def parse(spec: str) -> dict[str, tuple[float, str]]:
    """``{point: (probability, action)}`` of a spec; ConfigError names a bad entry."""
    out: dict[str, tuple[float, str]] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        parts = entry.split(":")
        try:
            name, prob, action = parts[0], float(parts[1]), (parts[2] if len(parts) > 2 else "kill")
        except (IndexError, ValueError):
            name, prob, action = entry, -1.0, ""
        if name not in POINTS or not 0.0 <= prob <= 1.0 or action not in ACTIONS or len(parts) > 3:
            raise ConfigError(
                f"{_env.FAULT_VAR} entry {entry!r} is not 'name:probability[:action]' with a name "
                f"in {POINTS}, 0 <= probability <= 1 and action in {ACTIONS}; fix or unset it"
            )
        out[name] = (prob, action)
    return out


_parsed: tuple[str, dict[str, tuple[float, str]]] = ("", {})


def _spec() -> dict[str, tuple[float, str]]:
    global _parsed  # noqa: PLW0603 - a cache of the last value seen
    raw = _env.fault_spec()
    if raw != _parsed[0]:
        _parsed = (raw, parse(raw))
    return _parsed[1]


_rng: random.Random | None = None
_rng_pid = 0


def _draw() -> float:
    global _rng, _rng_pid  # noqa: PLW0603 - one stream per process (a fork gets its own)
    if _rng is None or _rng_pid != os.getpid():
        seed = _env.fault_seed()
        _rng_pid = os.getpid()
        _rng = random.Random(None if seed is None else seed + _rng_pid)
    return _rng.random()


def fault_point(name: str) -> None:
    """Maybe inject the fault configured for ``name``; free when none is configured."""
    spec = _spec()
    if not spec:
        return
    hit = spec.get(name)
    if hit is None or _draw() >= hit[0]:
        return
    if hit[1] == "raise":
        raise InjectedFault(f"fault injected at {name!r} by {_env.FAULT_VAR}; unset it to run clean")
    os.kill(os.getpid(), signal.SIGKILL)
