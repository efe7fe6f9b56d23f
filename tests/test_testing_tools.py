"""``ray_goodput.testing`` itself: what the other tests rely on from its process launcher."""

from __future__ import annotations

from ray_goodput.testing import run_world
from tests import _env_at_import


def test_a_rank_imports_its_functions_module_with_the_callers_environment(monkeypatch):
    # The fork server starts (with the environment of that moment) before the variable is
    # set, as it does when a test without Ray runs before the shared Ray sets RAY_AUTH_MODE.
    run_world(_env_at_import.nothing, 1)
    monkeypatch.setenv("RAY_GOODPUT_TEST_MARKER", "set-by-the-caller")
    assert run_world(_env_at_import.seen_at_import, 2) == ["set-by-the-caller"] * 2
