"""Public names of a package imported on first use (PEP 562 module ``__getattr__``)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], subpackages: frozenset[str] = frozenset(),
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps a public name to the
    module that defines it (imported, and the name cached, at first access);
    ``subpackages`` are reachable as attributes."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name in subpackages:
            return importlib.import_module(f"{package}.{name}")
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
