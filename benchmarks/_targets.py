"""The benchmarks' targets (``benchmarks/targets.toml``) and the verdict on a measured ratio.

    targets = load("checkpoint_tax")
    targets["blocked"].verdict(0.86)   # 'target ≤ 1.2×: MET'

Run from a benchmark's directory (``python benchmarks/<name>.py``): imported as ``_targets``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package
    import tomli as tomllib

TARGETS = Path(__file__).resolve().parent / "targets.toml"


@dataclass(frozen=True)
class Target:
    """A bound on one measured ratio: ``at_most`` or ``at_least``; ``extra`` holds any other
    setting of the target (e.g. the step slowdown's ``min_allowed_pct``)."""

    name: str
    what: str
    at_most: float | None = None
    at_least: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.at_most is None) == (self.at_least is None):
            raise ValueError(f"{TARGETS.name}: target {self.name!r} needs exactly one of at_most, at_least")

    def met(self, ratio: float) -> bool:
        return ratio <= self.at_most if self.at_most is not None else ratio >= self.at_least

    @property
    def bound(self) -> str:
        """``≤ 1.2×`` or ``≥ 10×``; a target whose name ends in ``_s`` is in seconds (``≤ 3 s``),
        one whose name ends in ``_count`` a plain number (``≤ 5``)."""
        unit = " s" if self.name.endswith("_s") else "" if self.name.endswith("_count") else "×"
        return f"≤ {self.at_most:g}{unit}" if self.at_most is not None else f"≥ {self.at_least:g}{unit}"

    def verdict(self, ratio: float) -> str:
        """``target ≤ 1.2×: MET`` or ``target ≤ 1.2×: MISSED``."""
        return f"target {self.bound}: {'MET' if self.met(ratio) else 'MISSED'}"


def load(benchmark: str, path: Path = TARGETS) -> dict[str, Target]:
    """The targets of ``benchmark`` (its table in ``path``) by name."""
    tables = tomllib.loads(path.read_text()).get(benchmark)
    if not tables:
        raise KeyError(f"{path}: no [{benchmark}.<target>] tables")
    out = {}
    for name, spec in tables.items():
        spec = dict(spec)
        out[name] = Target(
            name=f"{benchmark}.{name}",
            what=str(spec.pop("what", name)),
            at_most=spec.pop("at_most", None),
            at_least=spec.pop("at_least", None),
            extra=spec,
        )
    return out
