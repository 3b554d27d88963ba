"""Attention TP 2 on both sides: each decode rank receives the KV of the prefill rank of its
index (tp_process.py, in a process of its own: SGLang's runtime context is per process)."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_tp2_to_tp2_pairs_rank_with_rank():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + sys.path))
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "tp_process.py")], capture_output=True, text=True, timeout=400, env=env
    )
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-4000:]
