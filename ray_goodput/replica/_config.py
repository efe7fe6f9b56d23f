"""``ReplicaGroups``: the fault-tolerance mode where a failed replica is replaced, not the job."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from ray_goodput.errors import ConfigError

#: What to install for replica mode (the ``ft`` extra pins torchft and what it needs).
INSTALL_HINT = 'pip install "ray-goodput[ft]"'


@dataclass(frozen=True, kw_only=True)
class ReplicaGroups:
    """Replica mode for data-parallel jobs (``ray_goodput.TorchTrainer(fault_tolerance=...)``).

    Every Ray Train worker is one replica group (one worker each on Ray 2.60) of a torchft
    job. When a replica fails, Ray replaces only it; the others keep stepping with fewer
    participants, and the replacement heals from a live peer (model, optimizer, data
    position, step) at its first step. When every replica fails at once, Ray restarts the
    whole group and the replicas resume from the last durable checkpoint.

    ``min_replicas``: a step commits only with at least this many participants.
    ``max_failures``: replacements plus whole-group restarts the run may take (each costs one
    of Ray's ``FailureConfig.max_failures``; used when that is left at its default 0).
    ``heartbeat_timeout_s``: how long a dead replica counts as alive for the quorum — the
    survivors' stall per failure. ``join_timeout_s``: how long a quorum that enough replicas
    joined (torchft: ``min_replicas`` and at least half of the live ones) waits for the
    other live ones before it forms without them (None: ``heartbeat_timeout_s``); a live
    replica later than that (one blocked in a large save, say) misses the step and heals
    from a peer at the next. ``timeout_s``: bound on a
    quorum, a collective, or a heal. ``start_timeout_s``: at a whole-group start, how long
    the replicas wait for every replica at their first quorum: replica 0 restores the
    newest checkpoint before it joins (a large one from object storage takes minutes).
    """

    min_replicas: int = 1
    max_failures: int = 16
    heartbeat_timeout_s: float = 1.0
    join_timeout_s: float | None = None
    timeout_s: float = 30.0
    start_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if isinstance(self.min_replicas, bool) or not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise ConfigError(f"ReplicaGroups(min_replicas=...) must be an int >= 1, got {self.min_replicas!r}")
        if isinstance(self.max_failures, bool) or not isinstance(self.max_failures, int) or self.max_failures < 0:
            raise ConfigError(f"ReplicaGroups(max_failures=...) must be an int >= 0, got {self.max_failures!r}")
        if not self.heartbeat_timeout_s > 0:
            raise ConfigError(f"ReplicaGroups(heartbeat_timeout_s=...) must be > 0, got {self.heartbeat_timeout_s!r}")
        if self.join_timeout_s is not None and not 0 < self.join_timeout_s < self.timeout_s:
            raise ConfigError(
                f"ReplicaGroups(join_timeout_s=...) must be None or > 0 and below timeout_s={self.timeout_s!r}, "
                f"got {self.join_timeout_s!r}"
            )
        if not self.start_timeout_s >= self.timeout_s:
            raise ConfigError(
                f"ReplicaGroups(start_timeout_s={self.start_timeout_s!r}) must be at least timeout_s="
                f"{self.timeout_s!r}: it bounds the first quorum of a whole-group start, replica 0's restore included"
            )
        if not self.timeout_s > self.heartbeat_timeout_s:
            raise ConfigError(
                f"ReplicaGroups(timeout_s={self.timeout_s!r}) must exceed heartbeat_timeout_s="
                f"{self.heartbeat_timeout_s!r}: a quorum waits out a dead replica's heartbeat"
            )

    def lighthouse_kwargs(self) -> dict[str, int]:
        """The torchft lighthouse's settings for this mode."""
        return {
            "min_replicas": self.min_replicas,
            "heartbeat_timeout_ms": int(self.heartbeat_timeout_s * 1000),
            "join_timeout_ms": int((self.join_timeout_s or self.heartbeat_timeout_s) * 1000),
        }


def require_torchft() -> None:
    """Raise ConfigError naming the install command when torchft is missing."""
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(f"replica mode (ReplicaGroups) needs torchft: {INSTALL_HINT}")
