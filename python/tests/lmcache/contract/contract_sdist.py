"""LMCache's transfer-channel tests, fetched from PyPI at test time and run against kvbridge.

The sdist ``lmcache-<version>.tar.gz`` (sha256 pinned) carries ``tests/`` and
``pytest.ini``; they are copied into a run directory *outside* the sdist's source tree (which
would shadow the installed, compiled ``lmcache``), with ``sdist_conftest.py`` (ours) as that
directory's ``conftest.py``. Nothing of LMCache's is committed to kvbridge.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

VERSION = "0.5.6"
SHA256 = "d6951e60ce8818a76aa42d0866a4ba85f1c95cd919355fff30ff24dcc3243f1e"
HERE = Path(__file__).resolve().parent

SUBSTITUTED = "tests/v1/distributed/transfer_channel/test_nixl_impl.py"
"""Run against kvbridge's context (``sdist_conftest.py`` substitutes the class)."""

WITH_KVBRIDGE_REGISTERED = (
    "tests/v1/distributed/transfer_channel/test_factory.py",
    "tests/v1/distributed/transfer_channel/test_context_lifecycle.py",
    "tests/v1/distributed/transfer_channel/test_api.py",
)
"""Run unchanged with ``"kvbridge"`` in LMCache's registry."""


def cache_dir() -> Path:
    """``$KVBRIDGE_TEST_CACHE`` or ``<repo>/.cache`` (ignored by git)."""
    env = os.environ.get("KVBRIDGE_TEST_CACHE")
    return Path(env) if env else HERE.parents[3] / ".cache"


def sdist() -> Path:
    """The verified sdist tarball in the cache, downloaded on first use."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from package_index import fetch

    return fetch("lmcache", f"lmcache-{VERSION}.tar.gz", SHA256, cache_dir())


def run_dir() -> Path:
    """A fresh directory with the sdist's ``tests/`` and ``pytest.ini`` and our conftest."""
    root = cache_dir() / f"lmcache-{VERSION}-contract-run"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    prefix = f"lmcache-{VERSION}/"
    with tarfile.open(sdist()) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix + "tests/") or m.name == prefix + "pytest.ini"
        ]
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(root, members=members, filter="data")
    shutil.copyfile(HERE / "sdist_conftest.py", root / "conftest.py")
    return root


@dataclass
class Outcome:
    """What one pytest run of LMCache's files reported, per test."""

    returncode: int
    output: str
    passed: dict[str, list[str]] = field(default_factory=dict)  # file -> test names
    not_passed: list[str] = field(default_factory=list)  # "file::name: outcome"


def run(files: tuple[str, ...], timeout_s: float = 600.0) -> Outcome:
    """Run LMCache's test ``files`` (paths in its sdist) in a fresh run directory."""
    root = run_dir()
    junit = root / "junit.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "log_cli=false",
         "-q", "-rs", f"--junitxml={junit}", *files],
        cwd=root, capture_output=True, text=True, timeout=timeout_s,
    )
    outcome = Outcome(returncode=proc.returncode, output=proc.stdout + proc.stderr)
    if not junit.exists():
        return outcome
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        name = case.get("name", "")
        bad = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        if bad:
            outcome.not_passed.append(f"{module}::{name}: {', '.join(bad)}")
        else:
            outcome.passed.setdefault(module, []).append(name)
    return outcome
