"""Names of things in the storage layout (a contract: tools and tests rely on it).

```
<root>/checkpoints/step-<step:09d>/   DCP files + .metadata + extras, COMMITTED written last
<root>/checkpoints/step-<step:09d>/.ranks/rank-<r:05d>.json   "rank r is durable" markers
```
"""

from __future__ import annotations

import re

CHECKPOINTS_DIR = "checkpoints"
COMMITTED = "COMMITTED"
DCP_METADATA = ".metadata"
RANKS_DIR = ".ranks"
_STEP_RE = re.compile(r"^step-(\d{9,})$")


def step_dir(step: int) -> str:
    """Directory name of ``step`` under ``<root>/checkpoints``."""
    return f"step-{step:09d}"


def parse_step(name: str) -> int | None:
    """The step of a checkpoint directory name, or None when it is not one."""
    match = _STEP_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


# Every file of a save carries the save's nonce (shared by its ranks): a step saved again
# after a restart never overwrites, nor mixes with, the files of an earlier save of it.

def rank_marker(rank: int, nonce: str) -> str:
    """Path of rank ``rank``'s durability marker inside a step directory."""
    return f"{RANKS_DIR}/rank-{rank:05d}-{nonce}.json"


def extras_file(rank: int, nonce: str) -> str:
    """Per-rank file of RNG states (they differ per rank, so they are not in DCP)."""
    return f"extras/rank-{rank:05d}-{nonce}.pkl"
