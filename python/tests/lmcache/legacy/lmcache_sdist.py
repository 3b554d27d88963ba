"""LMCache's own tests, fetched from PyPI at test time (never committed).

The sdist ``lmcache-<version>.tar.gz`` carries ``tests/`` and ``pytest.ini``. They are unpacked
into a cache directory *outside* any copy of the sdist's ``lmcache/`` source tree, which would
otherwise shadow the installed package and its compiled extensions.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import tarfile
from pathlib import Path

VERSION = "0.5.6"
SHA256 = "d6951e60ce8818a76aa42d0866a4ba85f1c95cd919355fff30ff24dcc3243f1e"


def cache_dir() -> Path:
    """``$KVBRIDGE_TEST_CACHE`` or ``<repo>/.cache`` (ignored by git)."""
    env = os.environ.get("KVBRIDGE_TEST_CACHE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[4] / ".cache"


def sdist() -> Path:
    """The verified sdist tarball in the cache, downloaded on first use."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from package_index import fetch

    return fetch("lmcache", f"lmcache-{VERSION}.tar.gz", SHA256, cache_dir())


def tests_root() -> Path:
    """A directory holding the sdist's ``tests/`` and ``pytest.ini`` (and nothing else)."""
    root = cache_dir() / f"lmcache-{VERSION}-tests"
    stamp = root / ".complete"
    if stamp.exists():
        return root
    if root.exists():
        shutil.rmtree(root)
    prefix = f"lmcache-{VERSION}/"
    with tarfile.open(fileobj=io.BytesIO(sdist().read_bytes())) as tar:
        members = [
            m for m in tar.getmembers()
            if m.name.startswith(prefix + "tests/") or m.name == prefix + "pytest.ini"
        ]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(root, members=members, filter="data")
    stamp.write_text(SHA256)
    return root
