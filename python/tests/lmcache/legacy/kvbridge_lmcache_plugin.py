"""pytest plugin (``-p kvbridge_lmcache_plugin``): runs a test session with kvbridge installed.

Used to run LMCache's own tests with ``kvbridge.lmcache.install()`` active, as it is in a vLLM
process that loaded ``kvbridge.lmcache.vllm``. It fails the session if the hooks are missing at
its start or were lost by its end (a test's mock must restore them).
"""

from __future__ import annotations

import pytest

_MODULE = "lmcache.v1.storage_backend.pd_backend_async"


def pytest_configure(config):
    import kvbridge.lmcache

    kvbridge.lmcache.install()
    if _MODULE not in kvbridge.lmcache.installed():
        raise pytest.UsageError(f"kvbridge.lmcache.install() did not hook {_MODULE}")
    config._kvbridge_hooked = kvbridge.lmcache.installed()
    print(f"kvbridge.lmcache hooks installed in: {', '.join(config._kvbridge_hooked)}")


def pytest_sessionfinish(session, exitstatus):
    import kvbridge.lmcache

    lost = set(session.config._kvbridge_hooked) - set(kvbridge.lmcache.installed())
    if lost:
        print(f"kvbridge.lmcache hooks lost during the session: {sorted(lost)}")
        session.exitstatus = 1
