"""Cases that run in a child process of their own (``tp_process.py``, ``policy_process.py``:
SGLang's runtime context is per process), each printing ``OK case {json}`` or
``FAIL case {json}``; the tests read one case's line."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_cases(script, cases, timeout):
    """Runs ``script`` (a file beside this one) over ``cases``; returns the cases' results
    by name and the finished process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + sys.path))
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, script), *cases],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip
    got = {}
    for line in out.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("OK", "FAIL"):
            case, _, detail = rest.partition(" ")
            got[case] = (word, json.loads(detail))
    return got, out


def result(results, case):
    """The detail of ``case``, which must have run and passed."""
    got, out = results
    assert case in got, f"no result for {case} (exit {out.returncode}): {out.stderr[-4000:]}"
    word, detail = got[case]
    assert word == "OK", detail
    return detail
