"""Names of things in the storage layout (a contract: tools and tests rely on it).

```
<root>/checkpoints/step-<step:09d>/   DCP files + .metadata + extras, COMMITTED written last
<root>/checkpoints/step-<step:09d>/.ranks/rank-<r:05d>-<save id>.json   "rank r is durable"
<root>/checkpoints/step-<step:09d>/.ranks/commit-<r:05d>-<save id>     "rank r's job stands to commit"
<root>/checkpoints/step-<step:09d>/QUARANTINED   the committed save found damaged (JSON)
<root>/checkpoints/GENERATION                     the newest claim that won (JSON)
<root>/checkpoints/CLAIM-g<generation:06d>-<token>   a claim of that generation, and its owner (JSON)
<root>/checkpoints/RESUME                         the step the live attempt resumes from (JSON)
<root>/checkpoints/SAVING-g<generation:06d>       "this generation saves here" (empty; fencing)
```

A save id is ``g<generation:06d>-<token>``. The generation orders saves by lineage: every
attempt of a run claims a higher one than any before it, so "newest" means the highest
``(generation, step)`` and a step saved again after a restart outranks the dead attempt's.
"""

from __future__ import annotations

import re

CHECKPOINTS_DIR = "checkpoints"
COMMITTED = "COMMITTED"
DCP_METADATA = ".metadata"
RANKS_DIR = ".ranks"
QUARANTINED = "QUARANTINED"
GENERATION = "GENERATION"
RESUME = "RESUME"
SAVING_PREFIX = "SAVING-"
CLAIM_PREFIX = "CLAIM-"
_SAVING_RE = re.compile(r"^SAVING-g(\d{6,})$")
_CLAIM_RE = re.compile(r"^CLAIM-g(\d{6,})(?:-([0-9a-f]{8,}))?$")
_STEP_RE = re.compile(r"^step-(\d{9,})$")
_SAVE_ID_RE = re.compile(r"g(\d{6,})-[0-9a-f]{8,}")


def saving_marker(generation: int) -> str:
    """Name (under ``<root>/checkpoints``) of the empty file that says the attempt of
    ``generation`` has saved: a claim alone (a Checkpointer that only restores) fences nobody."""
    return f"{SAVING_PREFIX}g{generation:06d}"


def saving_generation(name: str) -> int | None:
    """The generation of a :func:`saving_marker` name, or None for any other name."""
    m = _SAVING_RE.match(name)
    return int(m.group(1)) if m else None


def marked_generation(name: str) -> int | None:
    """The generation of a :func:`saving_marker` or :func:`claim_record` name, else None."""
    claimed = claim_of(name)
    return claimed[0] if claimed else saving_generation(name)


def claim_record(generation: int, token: str) -> str:
    """Name (under ``<root>/checkpoints``) of one claim of ``generation``, with the token
    the claim drew (its attempt's save ids start with it): an object of its own, so that
    claims made at once are all seen by a listing, and kept when a later claim replaces
    ``GENERATION``, so a run fenced by that generation can still name its owner. Token "":
    the name an older ray_goodput gave the one record of a generation, ``CLAIM-g<generation>``."""
    return f"{CLAIM_PREFIX}g{generation:06d}" + (f"-{token}" if token else "")


def claim_of(name: str) -> tuple[int, str] | None:
    """``(generation, token)`` of a :func:`claim_record` name (token "" for a record an
    older ray_goodput wrote, ``CLAIM-g<generation>``), or None for any other name."""
    m = _CLAIM_RE.match(name)
    return (int(m.group(1)), m.group(2) or "") if m else None


def step_dir(step: int) -> str:
    """Directory name of ``step`` under ``<root>/checkpoints``."""
    return f"step-{step:09d}"


def parse_step(name: str) -> int | None:
    """The step of a checkpoint directory name, or None when it is not one."""
    match = _STEP_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


# Every file of a save carries the save's save_id (shared by its ranks): a step saved again
# after a restart never overwrites, nor mixes with, the files of an earlier save of it.


def rank_marker(rank: int, save_id: str) -> str:
    """Path of rank ``rank``'s durability marker inside a step directory."""
    return f"{RANKS_DIR}/rank-{rank:05d}-{save_id}.json"


def commit_intent(rank: int, save_id: str) -> str:
    """Path of the (empty) file by which rank ``rank``'s job, having listed every marker
    of save ``save_id``, stands to commit it; the lowest rank among them commits."""
    return f"{RANKS_DIR}/commit-{rank:05d}-{save_id}"


def extras_file(rank: int, save_id: str) -> str:
    """Per-rank file of RNG states (they differ per rank, so they are not in DCP)."""
    return f"extras/rank-{rank:05d}-{save_id}.pkl"


def save_id(generation: int, token: str) -> str:
    """The id of one save (shared by its ranks); every file of the save carries it."""
    return f"g{generation:06d}-{token}"


def generation_of(name: str) -> int | None:
    """The generation in a file name that carries a save id, or None (no id, or a save
    made before generations existed)."""
    match = _SAVE_ID_RE.search(name.rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None
