"""LMCache's own PD backend tests (from its PyPI sdist) pass with kvbridge's hooks installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PD_TESTS = [
    "tests/v1/storage_backend/test_pd_backend_async.py",
    "tests/v1/storage_backend/test_pd_backend_bidirectional.py",
    "tests/v1/storage_backend/test_pd_backend_buffer_alignment.py",
]


def _root() -> Path:
    import lmcache_sdist

    try:
        return lmcache_sdist.tests_root()
    except OSError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"cannot fetch LMCache's sdist from PyPI: {e}")


# LMCache's tests that time themselves against wall-clock bounds (this one: 50 enqueues of a
# mocked channel within 37.5 ms). On a 2-core host under load they can miss the bound with
# kvbridge's hooks or without them; such a test alone may get one rerun. A failure of any
# other test, or a second failure, fails the run.
WALL_CLOCK_TESTS = {
    "tests/v1/storage_backend/test_pd_backend_async.py::test_sender_nonblocking_fifo_transfers",
}


def _pytest(root: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "kvbridge_lmcache_plugin", "-p", "no:cacheprovider",
         "-q", "-rfE", "-o", "log_cli=false", *args],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )


def _summary(out: subprocess.CompletedProcess) -> str:
    """pytest's short summary and its last lines (LMCache's warnings would bury them)."""
    lines = [l for l in out.stdout.splitlines() if l.startswith(("FAILED", "ERROR"))]
    return "\n".join(lines + out.stdout.strip().splitlines()[-3:] + [out.stderr[-2000:]])


def test_lmcache_pd_backend_tests_pass_with_kvbridge_installed():
    root = _root()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    out = _pytest(root, env, *PD_TESTS)
    summary = _summary(out)
    assert "kvbridge.lmcache hooks installed in:" in out.stdout, summary
    failed = set(re.findall(r"^(?:FAILED|ERROR) (\S+)", out.stdout, re.M))
    if out.returncode != 0 and failed and failed <= WALL_CLOCK_TESTS:
        rerun = _pytest(root, env, *sorted(failed))
        assert rerun.returncode == 0, _summary(rerun)
        print(f"rerun once (wall-clock bound): {sorted(failed)}")
    else:
        assert out.returncode == 0, summary
    # LMCache 0.5.6's three files hold 48 tests; none may be skipped.
    m = re.search(r"(\d+) passed", out.stdout)
    assert m and int(m.group(1)) + len(failed) == 48, summary
    assert not re.search(r"\d+ (error|skipped)", out.stdout), summary
    print(out.stdout.strip().splitlines()[-1])
