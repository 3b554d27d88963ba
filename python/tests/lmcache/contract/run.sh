#!/usr/bin/env bash
# kvbridge's LMCache distributed-channel suite: LMCache's own transfer-channel tests
# (lmcache 0.5.6 sdist, fetched from PyPI into .cache/ at test time, sha256 pinned, run
# unmodified: test_nixl_impl.py against kvbridge's context; test_factory.py,
# test_context_lifecycle.py, test_api.py with "kvbridge" registered), then kvbridge's own
# tests of the context, its page math and its handshake.
#
# Command, from the repository root, with the project's .venv holding kvbridge + lmcache:
#
#     python/tests/lmcache/contract/run.sh [PYTEST ARGS...]
#
# which is exactly:
#
#     .venv/bin/python -m pytest -p no:cacheprovider -q python/tests/lmcache/contract
#
# Env: KVBRIDGE_VENV (default .venv), KVBRIDGE_TEST_CACHE (default .cache), CI (non-empty:
# a missing LMCache or sdist fails instead of skipping).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
exec "${KVBRIDGE_VENV:-.venv}/bin/python" -m pytest -p no:cacheprovider -q python/tests/lmcache/contract "$@"
