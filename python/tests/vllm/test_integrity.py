"""``kvbridge_integrity`` (digests.py) with real kvbridge channels: a decoder's load whose
bytes differ from what the prefiller held fails with cause ``integrity``, on every
transport; a clean load is counted as checked; rows read before the prefiller wrote them
are read again, not taken for corruption.

The fault hook: the decoder's check (``digests.differing``) is wrapped so that, before it
runs, one byte that landed in the decoder's cache is flipped, as a faulty copy or NIC would
have flipped it on the way."""

from __future__ import annotations

import pytest
import torch

import kvbridge
from kvbridge.vllm import digests
from kvbridge.vllm.metadata import KvbridgeConnectorMetadata

from vllm_helpers import LAYERS, granted_meta, kv_caches, poll, prefiller_job

LOCAL, REMOTE = [8, 9, 3], [1, 2, 7]

# (name, kvbridge_transport, environment, the counter that shows the path: None for TCP).
# vLLM's KV tensors are not shared memory: with "shm" a same-host decoder copies them by
# cross-memory attach (the row says so); shared memory proper is the LMCache channel's.
TRANSPORTS = [
    ("tcp", "tcp", {"KVBRIDGE_CMA": "0"}, None),
    ("cma", None, {}, "cma_batches"),
    ("shm", "shm", {}, "cma_batches"),
    ("ucx", "ucx", {"UCX_TLS": "posix,cma,self"}, "ucx_batches"),
]
PATH_COUNTERS = ("shm_batches", "cma_batches", "ucx_batches")


job = prefiller_job


def pair(workers, monkeypatch, transport, env, *, p_integrity=True):
    if transport == "ucx" and "ucx" not in kvbridge.TRANSPORTS:
        pytest.fail("this kvbridge package was built without UCX; the integrity check must run over it")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    extra = {"kvbridge_transport": transport} if transport else {}
    p_cache, d_cache = kv_caches(seed=21), kv_caches(seed=None)
    p = workers("kv_producer", p_cache, extra={**extra, "kvbridge_integrity": p_integrity})
    d = workers("kv_consumer", d_cache, extra=extra)
    return p, d, p_cache, d_cache


def load(p, d):
    p.start_load_kv(granted_meta(reqs_to_send={"p-1": 30.0}))
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, LOCAL, REMOTE)}))
    poll(d, want_recving={"d-1"})


def assert_path(stats, counter):
    """The batches went the way the test names (the KV did not come over another transport)."""
    for c in PATH_COUNTERS:
        if c == counter:
            assert stats[c] >= 1, stats
        else:
            assert stats[c] == 0, (c, stats)


def flip_before_check(monkeypatch, cache, block):
    """The fault hook: one byte of ``block`` of the first layer flipped after the reads
    landed, before the first check."""
    check = digests.differing
    flipped = []

    def hooked(*args, **kw):
        if not flipped:
            cache[LAYERS[0]][block].view(torch.uint8).view(-1)[5] ^= 0x10
            flipped.append(block)
        return check(*args, **kw)

    monkeypatch.setattr(digests, "differing", hooked)
    return flipped


@pytest.mark.parametrize("name,transport,env,counter", TRANSPORTS, ids=[t[0] for t in TRANSPORTS])
def test_a_clean_load_is_checked(workers, monkeypatch, name, transport, env, counter):
    p, d, p_cache, d_cache = pair(workers, monkeypatch, transport, env)
    load(p, d)
    stats = d.stats_since_last_report()
    assert d.take_failed_recving() == set()
    assert stats["loads_ok"] == 1 and stats["loads_checked"] == 1, stats
    assert_path(stats, counter)
    for name_ in LAYERS:
        for lo, ro in zip(LOCAL, REMOTE):
            assert torch.equal(d_cache[name_][lo], p_cache[name_][ro]), (name_, lo)


@pytest.mark.parametrize("name,transport,env,counter", TRANSPORTS, ids=[t[0] for t in TRANSPORTS])
def test_a_flipped_byte_fails_the_load_as_integrity(workers, monkeypatch, name, transport, env, counter):
    p, d, _, d_cache = pair(workers, monkeypatch, transport, env)
    flipped = flip_before_check(monkeypatch, d_cache, LOCAL[1])
    load(p, d)
    assert flipped == [LOCAL[1]]
    stats = d.stats_since_last_report()
    assert d.take_failed_recving() == {"d-1"}
    # vLLM's kv_load_failure_policy applies to the load's blocks (recompute computes them)
    assert d.get_block_ids_with_load_errors() == set(LOCAL)
    assert stats["loads_failed_integrity"] == 1 and stats["loads_ok"] == stats["loads_checked"] == 0, stats
    assert_path(stats, counter)
    # the prefiller still hears that the decoder is done with the blocks
    poll(p, want_sending={"p-1"})


def test_rows_read_before_the_prefiller_wrote_them_are_read_again(workers, monkeypatch):
    # the decoder's first look at the rows may precede the prefiller's writing them (a
    # request marked held only when it finished): a row that differs is read again after
    # the lease check, and the load goes on
    p, d, p_cache, d_cache = pair(workers, monkeypatch, None, {})
    check = digests.differing
    stale = []

    def hooked(check_, bases, chunk_bytes, scratch):
        if not stale:
            at = check_.rows_at
            scratch[at : at + check_.rows * digests.ROW_BYTES] = bytes(check_.rows * digests.ROW_BYTES)
            stale.append(at)
        return check(check_, bases, chunk_bytes, scratch)

    monkeypatch.setattr(digests, "differing", hooked)
    load(p, d)
    assert stale and d.take_failed_recving() == set()
    assert d.stats["loads_checked"] == 1 and d.stats["loads_ok"] == 1, d.stats


def test_a_prefiller_without_digests_gives_unchecked_loads(workers, monkeypatch, caplog):
    p, d, p_cache, d_cache = pair(workers, monkeypatch, None, {}, p_integrity=False)
    load(p, d)
    assert d.take_failed_recving() == set()
    assert d.stats["loads_ok"] == 1 and d.stats["loads_checked"] == 0, d.stats
    assert "offer no digests" in caplog.text


def test_a_prefiller_marks_a_request_only_once_its_digests_are_written(workers, monkeypatch):
    # blocks the scheduler did not name (or outside the cache) get no digests: the request
    # is never held, so its decoder's load fails at its first look instead of reading
    # unchecked blocks
    p, d, _, _ = pair(workers, monkeypatch, None, {})
    p.start_load_kv(granted_meta(reqs_to_send={"p-1": 30.0}, hold_blocks={"p-1": [10_000]}))
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, LOCAL, REMOTE)}))
    poll(d, want_recving={"d-1"})
    assert d.take_failed_recving() == {"d-1"}
    assert d.stats["loads_failed_lease_ended"] == 1, d.stats


def test_digest_rows_cover_each_head_of_each_block(workers, monkeypatch):
    # vLLM CPU's blocks keep each KV head together: one row per head per block, so a decoder
    # of another TP size that reads one head of a block still checks what it read
    p, _, p_cache, _ = pair(workers, monkeypatch, None, {})
    table = p._digests
    heads = p_cache[LAYERS[0]].shape[1]
    assert table.chunks == heads and table.chunk_bytes * heads == p_cache[LAYERS[0]][0].numel() * 2
    p.start_load_kv(granted_meta(reqs_to_send={"p-1": 30.0}))
    before = bytes(table.memory)
    p_cache[LAYERS[1]][4][1].view(torch.uint8).view(-1)[0] ^= 1
    table.record(p._layer_bases(), [4])
    changed = [i for i in range(0, len(before), 8) if before[i : i + 8] != table.memory[i : i + 8]]
    assert changed == [(4 * heads + 1) * 8]
