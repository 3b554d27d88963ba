"""Runs LMCache's own transfer-channel tests against kvbridge's context.

``contract_sdist.py`` copies this file, as ``conftest.py``, to the root of a copy of the
``tests/`` of LMCache's sdist (next to its ``pytest.ini``), so pytest loads it before any
test module. It

* registers ``"kvbridge"`` with LMCache's factory (so ``test_factory.py``,
  ``test_context_lifecycle.py`` and ``test_api.py`` run with it registered);
* while pytest imports ``test_nixl_impl.py``, and only then, makes
  ``nixl_impl.NixlTransferChannelContext`` name kvbridge's context, so that the test
  module, unmodified, builds kvbridge contexts; the name is restored right after;
* lets the module's ``pytest.importorskip("nixl")`` pass with a stub when NIXL is not
  installed (the tests never touch the module they get);
* fails the session if any test was skipped or if ``test_nixl_impl.py`` ran without
  building a kvbridge context (a substitution that silently stopped working would
  otherwise test NIXL, or nothing). ``KVBRIDGE_CONTRACT_ALLOW_SKIP=1`` tolerates skips.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

import pytest

from kvbridge.lmcache import distributed
from lmcache.v1.distributed.transfer_channel.impl import nixl_impl

distributed.register()

_SUBSTITUTED_MODULE = "test_nixl_impl.py"
_contexts_built = 0


class CountedKvbridgeContext(distributed.KvbridgeTransferChannelContext):
    """kvbridge's context, counting how many the substituted tests build."""

    def __init__(self, *args, **kwargs) -> None:
        global _contexts_built
        super().__init__(*args, **kwargs)
        _contexts_built += 1


def _ensure_nixl_importable() -> None:
    try:
        importlib.import_module("nixl")
    except ImportError:
        stub = types.ModuleType("nixl")
        stub.__doc__ = "stub: kvbridge's contract run substitutes the context under test"
        sys.modules["nixl"] = stub


_ensure_nixl_importable()


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    substituting = (
        isinstance(collector, pytest.Module)
        and collector.path.name == _SUBSTITUTED_MODULE
    )
    if not substituting:
        yield
        return
    original = nixl_impl.NixlTransferChannelContext
    nixl_impl.NixlTransferChannelContext = CountedKvbridgeContext
    try:
        outcome = yield
    finally:
        nixl_impl.NixlTransferChannelContext = original
    if not outcome.get_result().passed:
        return
    if collector.obj.NixlTransferChannelContext is not CountedKvbridgeContext:
        raise pytest.UsageError(
            f"{_SUBSTITUTED_MODULE} did not pick up kvbridge's context; the contract "
            "run would not test kvbridge"
        )


_outcomes = {"skipped": 0, "substituted_ran": 0}


def pytest_collectreport(report):
    if report.skipped:
        _outcomes["skipped"] += 1


def pytest_runtest_logreport(report):
    if report.skipped:
        _outcomes["skipped"] += 1
    if report.when == "call" and report.fspath.endswith(_SUBSTITUTED_MODULE):
        _outcomes["substituted_ran"] += 1


def pytest_sessionfinish(session, exitstatus):
    problems = []
    if _outcomes["skipped"] and os.environ.get("KVBRIDGE_CONTRACT_ALLOW_SKIP") != "1":
        problems.append(f"{_outcomes['skipped']} test(s) skipped")
    if _outcomes["substituted_ran"] and _contexts_built == 0:
        problems.append(f"{_SUBSTITUTED_MODULE} ran but built no kvbridge context")
    if problems:
        sys.stderr.write("kvbridge contract run FAILED: " + "; ".join(problems) + "\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_report_header(config):
    return f"kvbridge contract run: {_SUBSTITUTED_MODULE} uses {distributed.__name__}"
