"""Attention TP on the two sides (tp_process.py, each case in a process of its own: SGLang's
runtime context is per process)."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def run(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + sys.path))
    return subprocess.run(
        [sys.executable, os.path.join(HERE, "tp_process.py"), *args], capture_output=True, text=True, timeout=400, env=env
    )


@pytest.mark.parametrize(
    "ptp,dtp,kind",
    [
        ("2", "2", "mha"),  # decode rank r receives prefill rank r's KV (each differs)
        ("1", "2", "mla"),  # MLA: both decode ranks receive prefill rank 0's
    ],
)
def test_tp_pairs_that_work(ptp, dtp, kind):
    out = run(ptp, dtp, kind)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-4000:]


def test_mha_tp1_to_tp2_fails_the_request_naming_both_tps():
    out = run("1", "2", "mha")
    assert out.returncode != 0
    assert "KVTransferError" in out.stderr and "TP 1" in out.stderr and "TP 2" in out.stderr, out.stderr[-4000:]
