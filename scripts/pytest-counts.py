#!/usr/bin/env python3
"""Checks what a pytest run did, from its JUnit XML (``pytest --junitxml=FILE``): a suite that
collected nothing, lost tests, or skipped them passes pytest, not this.

    scripts/pytest-counts.py NAME FILE MIN

Fails (exit 1) when the run holds fewer than MIN tests (run or skipped; an expected failure,
xfail, counts as run), or, under ``CI`` (any non-empty value), when any test was skipped: there
every one of the MIN must run. Prints one line with the counts, and each skipped test with its
reason.
"""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET


def counts(path: str) -> tuple[int, list[str]]:
    """Tests that ran, and the skipped ones as ``name: reason``."""
    ran = 0
    skipped: list[str] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        skip = case.find("skipped")
        if skip is not None and skip.get("type") != "pytest.xfail":
            name = f"{case.get('classname', '')}.{case.get('name', '')}".lstrip(".")
            skipped.append(f"{name}: {skip.get('message', '')}")
        else:
            ran += 1
    return ran, skipped


def main(argv: list[str]) -> int:
    if len(argv) != 4 or not argv[3].isdigit():
        print("usage: scripts/pytest-counts.py NAME FILE MIN", file=sys.stderr)
        return 2
    name, path, least = argv[1], argv[2], int(argv[3])
    try:
        ran, skipped = counts(path)
    except (OSError, ET.ParseError) as e:
        print(f"{name}: no test report ({e})")
        return 1
    ci = bool(os.environ.get("CI"))
    print(f"{name}: {ran} tests ran, {len(skipped)} skipped (at least {least} must be there)")
    for s in skipped:
        print(f"  skipped: {s}")
    status = 0
    if ran + len(skipped) < least:
        print(f"{name}: FAILED: {ran + len(skipped)} tests, fewer than {least}")
        status = 1
    if ci and skipped:
        print(f"{name}: FAILED: {len(skipped)} tests skipped under CI")
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
