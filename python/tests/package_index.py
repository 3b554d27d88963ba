"""Where other projects' sdists come from at test time: the simple index pip itself uses.

The test suites fetch LMCache's and vLLM's sdists for their tests (never committed). They ask
the index pip is configured with (``PIP_INDEX_URL``, pip's config files), else pip's own
default, so the project names no index of its own; ``KVBRIDGE_PYPI_SIMPLE`` overrides both.

    python python/tests/package_index.py NAME FILENAME   # prints FILENAME's URL
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import urllib.request
from pathlib import Path


def simple_index() -> str:
    """The base URL of the simple index, without a trailing slash."""
    override = os.environ.get("KVBRIDGE_PYPI_SIMPLE")
    if override:
        return override.rstrip("/")
    from pip._internal.configuration import Configuration
    from pip._internal.models.index import PyPI

    conf = Configuration(isolated=False)
    conf.load()
    for key in (":env:.index-url", "global.index-url", "download.index-url"):
        try:
            return conf.get_value(key).rstrip("/")
        except Exception:
            continue
    return PyPI.simple_url.rstrip("/")


def file_url(project: str, filename: str, timeout: float = 60.0) -> str:
    """The URL of one of ``project``'s files on the index (PEP 691 JSON)."""
    index = simple_index()
    req = urllib.request.Request(
        f"{index}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        files = json.load(resp)["files"]
    for f in files:
        if f["filename"] == filename:
            return f["url"]
    raise FileNotFoundError(f"{filename} is not on {index}")


def fetch(project: str, filename: str, sha256: str, cache: Path) -> Path:
    """``cache/filename``, downloaded from the index on first use and checked against its
    pinned ``sha256`` (a file that does not match is fetched again, then refused)."""
    path = cache / filename
    if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == sha256:
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with urllib.request.urlopen(file_url(project, filename), timeout=300) as resp:
        data = resp.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ValueError(f"{filename}: sha256 {digest}, expected {sha256}")
    part = path.with_suffix(".part")
    part.write_bytes(data)
    part.replace(path)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: package_index.py NAME FILENAME")
    print(file_url(sys.argv[1], sys.argv[2]))
