"""LMCache interop tests: they need LMCache (and torch) installed.

Without LMCache they are skipped, except under ``CI`` (any non-empty value), where a missing
LMCache is a failure: the CI job's test command installs it.
Test modules import LMCache and kvbridge inside tests, never at the top, so that collection
works without them.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def _missing() -> list[str]:
    return [m for m in ("lmcache", "torch", "kvbridge._native") if _find(m) is None]


def _find(name: str):
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


def _ours(item) -> bool:
    return str(item.fspath).startswith(os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    missing = _missing()
    if not missing or os.environ.get("CI"):
        return
    why = f"LMCache interop tests need {', '.join(missing)} (scripts/test.sh installs them)"
    for item in items:
        if _ours(item):
            item.add_marker(pytest.mark.skip(reason=why))


def pytest_runtest_setup(item):
    # Under CI a missing dependency is a failure, not a skip.
    if _ours(item) and os.environ.get("CI"):
        missing = _missing()
        if missing:
            pytest.fail(f"CI: LMCache interop dependencies missing: {', '.join(missing)}")
