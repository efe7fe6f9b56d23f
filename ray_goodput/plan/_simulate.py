"""A seeded discrete-event simulation of a training run under failures.

One run: wall time ``T``; failures arrive as a Poisson process of rate ``N * AFR`` (per
year) on the wall clock. The job alternates compute and saves. Each save blocks the loop
for ``save_blocking_s``; its upload then takes ``durable_s - save_blocking_s``. As in the
node uploader, a rank uploads one save at a time and keeps at most one waiting: a save that
comes while one uploads waits, and a newer one supersedes it (``Outcome.superseded``). A
save uploaded at once is a recovery point ``durable_s`` after it started. A failure throws away the
compute done since the newest *durable* checkpoint, then the job restarts (``restart_s``)
and restores (``restore_s``); a failure during either starts both over. Time lands in the
ledger's buckets (:mod:`ray_goodput.goodput._ledger` names): ``productive``, ``lost``,
``checkpoint_stall``, ``restore``, ``restart_downtime`` (and ``startup`` when replaying a
measured run). Compute is continuous here: a failure inside a step loses that part of it.

:func:`replay` runs one system against a *given* failure schedule (to compare with a
measured run); :func:`simulate` draws schedules from a seed and compares systems.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from ray_goodput.errors import ConfigError
from ray_goodput.plan import _formulas as f

BUCKETS = ("productive", "lost", "checkpoint_stall", "restore", "restart_downtime", "startup")
SECONDS_PER_YEAR = f.HOURS_PER_YEAR * 3600.0


@dataclass(frozen=True, kw_only=True)
class System:
    """Measured costs of one checkpointing system and its interval policy.

    ``interval`` is compute seconds between saves, or ``"auto"`` for Daly's optimum from
    ``save_blocking_s`` and the job MTBF. ``durable_s`` counts from the start of the save.
    """

    name: str
    step_s: float
    save_blocking_s: float
    durable_s: float
    restore_s: float
    restart_s: float
    interval: float | str = "auto"

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("System name must be a non-empty string")
        f.positive("step_s", self.step_s)
        f.positive("save_blocking_s", self.save_blocking_s, zero_ok=True)
        f.positive("restore_s", self.restore_s, zero_ok=True)
        f.positive("restart_s", self.restart_s, zero_ok=True)
        if f.positive("durable_s", self.durable_s, zero_ok=True) < self.save_blocking_s:
            raise ConfigError(
                f"{self.name}: durable_s ({self.durable_s}) must be >= save_blocking_s "
                f"({self.save_blocking_s}); it counts from the start of the save"
            )
        if self.interval != "auto":
            f.positive("interval", self.interval)

    def interval_steps(self, mtbf_s: float) -> int:
        """Steps between saves: the fixed interval, or the optimum for this MTBF (never
        below the upload: :func:`~ray_goodput.plan._formulas.optimal_interval_s`)."""
        save = max(self.save_blocking_s, 1e-9)
        durable = max(self.durable_s, save)
        if self.interval == "auto":
            seconds = f.optimal_interval_s(save, mtbf_s, durable_s=durable)
        else:
            seconds = float(self.interval)
        return f.interval_steps(seconds, self.step_s, at_least_s=durable - save)


@dataclass
class Outcome:
    """Seconds per bucket of one simulated run."""

    system: str
    interval_s: float
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))
    failures: int = 0
    superseded: int = 0  # saves dropped, waiting, for a newer one: blocking time bought nothing

    @property
    def wall_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def goodput(self) -> float:
        return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else 0.0


class _Lane:
    """One rank's uploads in a segment: one at a time, at most one waiting, the newest wins."""

    def __init__(self, upload_s: float) -> None:
        self.upload_s = upload_s
        self.free_at = -math.inf
        self.waiting: tuple[float, float] | None = None  # (ready at, progress it holds)
        self.durable: list[tuple[float, float]] = []  # (recovery point at, progress kept)
        self.superseded = 0

    def _start_waiting(self, now: float) -> None:
        if self.waiting is not None and self.free_at <= now:
            begin = max(self.free_at, self.waiting[0])
            self.durable.append((begin + self.upload_s, self.waiting[1]))
            self.free_at, self.waiting = begin + self.upload_s, None

    def save(self, now: float, work: float) -> None:
        """A save of progress ``work`` stopped blocking at ``now``."""
        self._start_waiting(now)
        if self.free_at <= now:
            self.durable.append((now + self.upload_s, work))
            self.free_at = now + self.upload_s
            return
        if self.waiting is not None:
            self.superseded += 1
        self.waiting = (now, work)

    def kept(self, now: float, default: float) -> float:
        """The progress of the newest recovery point at ``now``."""
        self._start_waiting(now)
        return max((w for d, w in self.durable if d <= now), default=default)


class _Run:
    """The event loop of one run; ``t`` is the wall clock, ``work`` the progress (compute s)."""

    def __init__(self, system: System, tau: float, failures: list[float], end_s: float, work_s: float):
        self.sys, self.tau, self.end_s, self.work_s = system, tau, end_s, work_s
        self.fails = sorted(failures)
        self.out = Outcome(system=system.name, interval_s=tau)
        self.t, self.kept, self.i, self.hit = 0.0, 0.0, 0, False

    def _next_failure(self) -> float:
        while self.i < len(self.fails) and self.fails[self.i] < self.t:
            self.i += 1  # a failure before now (e.g. during startup) has no job to kill
        return self.fails[self.i] if self.i < len(self.fails) else math.inf

    def _advance(self, seconds: float, bucket: str) -> bool:
        """Spend up to ``seconds`` in ``bucket``; False when a failure or the end cut it short."""
        fail = self._next_failure()
        stop = min(self.t + seconds, fail, self.end_s)
        self.out.seconds[bucket] += stop - self.t
        self.hit = stop == fail and stop < self.t + seconds and stop < self.end_s
        cut = stop < self.t + seconds
        self.t = stop
        if self.hit:
            self.out.failures += 1
            self.i += 1
        return not cut

    def segment(self) -> bool:
        """Train from the newest recovery point; True when a failure ended the segment."""
        start, work = self.kept, self.kept
        lane = _Lane(self.sys.durable_s - self.sys.save_blocking_s)
        while True:
            remaining = self.work_s - work
            need = min(self.tau, remaining)
            t0 = self.t
            whole = self._advance(need, "productive")
            if whole:  # exact at the end: a + (b - a) can miss b by a rounding error
                work = self.work_s if need == remaining else work + need
            else:
                work += self.t - t0
            if not whole or work >= self.work_s:
                break
            if not self._advance(self.sys.save_blocking_s, "checkpoint_stall"):
                break
            lane.save(self.t, work)
        self.out.superseded += lane.superseded
        if not self.hit:
            self.kept = work
            return False
        self.kept = lane.kept(self.t, start)
        self.out.seconds["productive"] -= work - self.kept
        self.out.seconds["lost"] += work - self.kept
        return True

    def recover(self) -> None:
        """Restart then restore; a failure during either starts both over."""
        while self.t < self.end_s:
            if self._advance(self.sys.restart_s, "restart_downtime") and self._advance(self.sys.restore_s, "restore"):
                return

    def run(self, startup_s: float) -> Outcome:
        # The first attempt is not running yet during startup: failures then kill nothing.
        self.t = min(startup_s, self.end_s)
        self.out.seconds["startup"] = self.t
        while self.t < self.end_s and self.kept < self.work_s:
            if self.segment():
                self.recover()
        return self.out


def replay(
    system: System,
    failures_s: list[float],
    *,
    wall_s: float | None = None,
    work_s: float | None = None,
    mtbf_s: float | None = None,
    startup_s: float = 0.0,
) -> Outcome:
    """Run ``system`` against failures at the given wall times (seconds from the job start).

    The run ends after ``wall_s`` of wall time or once ``work_s`` seconds of compute are
    kept (a job of a fixed number of steps), whichever comes first; give at least one.
    ``mtbf_s`` is needed for an ``"auto"`` interval.
    """
    if wall_s is None and work_s is None:
        raise ConfigError("replay needs wall_s or work_s (where the run ends)")
    if system.interval == "auto" and mtbf_s is None:
        raise ConfigError(f"{system.name}: interval 'auto' needs mtbf_s")
    tau = system.interval_steps(mtbf_s or 1.0) * system.step_s
    end = math.inf if wall_s is None else f.positive("wall_s", wall_s)
    work = math.inf if work_s is None else f.positive("work_s", work_s)
    return _Run(system, tau, list(failures_s), end, work).run(f.positive("startup_s", startup_s, zero_ok=True))


def poisson_schedule(rate_per_s: float, wall_s: float, rng: random.Random) -> list[float]:
    """Failure times of a Poisson process of ``rate_per_s`` over ``[0, wall_s)``."""
    times, t = [], rng.expovariate(rate_per_s)
    while t < wall_s:
        times.append(t)
        t += rng.expovariate(rate_per_s)
    return times


def simulate(
    systems: list[System], *, gpus: int, days: float, afr: float = 0.01, seed: int = 0, runs: int = 1
) -> dict[str, list[Outcome]]:
    """``runs`` seeded runs of ``days`` on ``gpus`` GPUs per system.

    Every system sees the same failure schedules (common random numbers), so differences
    between systems are not sampling noise between schedules. Deterministic for a seed.
    """
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ConfigError(f"runs must be an int >= 1, got {runs!r}")
    wall = f.positive("days", days) * 86400.0
    rate = f.check_gpus(gpus) * f.positive("afr", afr) / SECONDS_PER_YEAR
    rng = random.Random(f"{seed}-{gpus}")  # one stream per size: adding a size changes no other
    schedules = [poisson_schedule(rate, wall, rng) for _ in range(runs)]
    return {s.name: [replay(s, sched, wall_s=wall, mtbf_s=1.0 / rate) for sched in schedules] for s in systems}


def mean_buckets(outcomes: list[Outcome]) -> dict[str, float]:
    """Share of wall time per bucket over several runs (pooled seconds), plus ``goodput``."""
    total = sum(o.wall_s for o in outcomes) or 1.0
    shares = {k: sum(o.seconds[k] for o in outcomes) / total for k in BUCKETS}
    shares["goodput"] = shares["productive"]
    return shares


# Per-rank costs measured by benchmarks/checkpoint_tax.py, S3 rows (264 MiB of FSDP2 shard
# per rank, 2 ranks, moto server; benchmarks/README.md, "Checkpoint tax"). restart_s: the ~12 s Ray Train
# worker-group restart measured by benchmarks/goodput_under_failures.py. restore_s is an
# assumption: reading the bytes back costs what the plain upload did (14.08 s).
DEFAULT_SOURCE = (
    "checkpoint_tax benchmark, S3 rows (264 MiB/rank); restart 12 s measured; "
    "restore assumed = upload floor 14.08 s; step 0.113 s measured"
)
_COMMON = {"step_s": 0.113, "restore_s": 14.08, "restart_s": 12.0}
DEFAULT_SYSTEMS = (
    System(name="rank-0 torch.save (sync)", save_blocking_s=17.94, durable_s=17.94, **_COMMON),
    System(name="Ray Train report SYNC", save_blocking_s=15.29, durable_s=15.29, **_COMMON),
    System(name="Ray Train report ASYNC", save_blocking_s=0.68, durable_s=17.21, **_COMMON),
    System(name="ray_goodput fixed 30 min", save_blocking_s=0.29, durable_s=18.88, interval=1800.0, **_COMMON),
    System(name="ray_goodput auto", save_blocking_s=0.29, durable_s=18.88, **_COMMON),
    # Saves closer together than the upload: most are superseded, and the recovery point lags
    # as much as at the auto interval (what the S3/Poisson benchmark ran into at 6.1 s).
    System(name="ray_goodput fixed 6 s (< upload)", save_blocking_s=0.29, durable_s=18.88, interval=6.0, **_COMMON),
)
_FIELDS = ("name", "step_s", "save_blocking_s", "durable_s", "restore_s", "restart_s", "interval")


def systems_from_json(doc: dict) -> list[System]:
    """Systems from a costs document: ``{"systems": [{name, step_s, save_blocking_s,
    durable_s, restore_s, restart_s, interval?}, ...]}``; other top-level keys are ignored."""
    rows = doc.get("systems") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ConfigError('costs JSON needs a non-empty "systems" list (see ray_goodput.plan._simulate)')
    systems = []
    for row in rows:
        missing = [k for k in _FIELDS[:-1] if k not in row]
        if missing:
            raise ConfigError(f"costs JSON system {row.get('name', '?')!r} lacks {', '.join(missing)}")
        systems.append(System(**{k: row[k] for k in _FIELDS if k in row}))
    return systems


def system_to_json(system: System) -> dict:
    return {k: getattr(system, k) for k in _FIELDS}
