"""Public names of a package imported on first use (PEP 562 module ``__getattr__``)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str,
    exports: dict[str, str],
    subpackages: frozenset[str] = frozenset(),
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


class LazyModule:
    """A module imported at its first attribute access.

    ``ray = LazyModule("ray")`` in a module that needs Ray only once Ray is in use: a
    process that never touches it (a rank saving through the thread backend, a test
    forked from a server) does not pay for ``import ray`` (most of a second of CPU), and a
    process that does sees the real module. Ask :func:`imported` before asking the module
    anything whose answer is "no" when it was never imported (``ray.is_initialized()``).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: Any = None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # pickle, copy and introspection probe these: no import
            raise AttributeError(attr)
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{'' if self._module is None else ' (imported)'}>"


def imported(name: str) -> Any | None:
    """The module ``name`` if this process imported it already, else None (no import)."""
    return sys.modules.get(name)
