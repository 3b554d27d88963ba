"""kvbridge's LMCache distributed-channel tests: they need LMCache, torch and the kvbridge
binding. Without them the tests that use them are skipped, except under ``CI`` (any
non-empty value), where that is a failure. The pure tests (page math, handshake messages)
need only ``msgspec``.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

NEEDS = ("lmcache", "torch", "kvbridge._native")


def _find(name: str):
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


def missing() -> list[str]:
    """The interop dependencies that are not importable."""
    return [m for m in NEEDS if _find(m) is None]


@pytest.fixture(scope="module")
def interop():
    """Skip (fail under CI) a test that needs LMCache and the binding when they are missing."""
    gone = missing()
    if gone:
        why = f"needs {', '.join(gone)} (scripts/test.sh installs them)"
        if os.environ.get("CI"):
            pytest.fail(f"CI: {why}")
        pytest.skip(why)
