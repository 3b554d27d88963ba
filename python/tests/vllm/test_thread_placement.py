"""The decoder's load and notice threads run on vLLM CPU's transfer cores, not on the
compute cores where the worker's main thread (which creates them) spins between steps."""

from __future__ import annotations

import os
import threading

import pytest

import kvbridge.vllm.worker as worker_mod
from kvbridge.vllm.metadata import KvbridgeConnectorMetadata

from test_worker_transfer import job
from vllm_helpers import kv_caches, poll
from vllm_helpers import granted_meta  # noqa: E402

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores"
)


def cores_of(native_id: int) -> set[int]:
    for line in open(f"/proc/self/task/{native_id}/status"):
        if line.startswith("Cpus_allowed_list"):
            out: set[int] = set()
            for part in line.split()[1].split(","):
                lo, _, hi = part.partition("-")
                out |= set(range(int(lo), int(hi or lo) + 1))
            return out
    raise AssertionError("no Cpus_allowed_list")


@pytest.fixture
def compute_and_transfer(monkeypatch):
    """This thread on the first core (as vLLM CPU pins its worker), the last one kept for
    transfers (as vLLM CPU's topology says)."""
    mine = sorted(os.sched_getaffinity(0))
    compute, transfer = {mine[0]}, {mine[-1]}
    monkeypatch.setattr(worker_mod, "transfer_core_set", lambda: set(transfer))
    os.sched_setaffinity(0, compute)
    yield compute, transfer
    os.sched_setaffinity(0, set(mine))


def test_load_and_notice_threads_run_on_the_transfer_cores(workers, compute_and_transfer):
    compute, transfer = compute_and_transfer
    before = {t.ident for t in threading.enumerate()}
    p = workers("kv_producer", kv_caches(seed=1))
    d = workers("kv_consumer", kv_caches(seed=None))
    p.start_load_kv(granted_meta(reqs_to_send={"p-1": 30.0}))
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [1], [2])}))
    poll(d, want_recving={"d-1"})
    poll(p, want_sending={"p-1"})  # the notice went out: its thread exists
    assert d.take_failed_recving() == set()
    assert cores_of(threading.get_native_id()) == compute, "the test's own thread moved"
    ours = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("kvbridge-")]
    names = sorted(t.name for t in ours)
    assert any(n.startswith("kvbridge-load") for n in names) and "kvbridge-notices" in names, names
    for t in ours:
        assert cores_of(t.native_id) == transfer, f"{t.name} runs on cores {cores_of(t.native_id)}"
