"""kvbridge_read_grants with real kvbridge channels: a prefiller's reads confined to each
held request's blocks, for the holder of that request's grant (read_grants.py). The
attacker is an insider: a decoder that holds the deployment's secret (here: none is set,
so any peer may connect) but not the request's grant."""

from __future__ import annotations

import time

import pytest
import torch

from kvbridge.vllm.config import settings_from
from kvbridge.vllm.metadata import KvbridgeConnectorMetadata
from kvbridge.vllm.read_grants import runs

from vllm_helpers import GRANT, LAYERS, kv_caches, poll, vllm_config
from vllm_helpers import granted_meta, prefiller_job  # noqa: E402

OTHER = "c3" * 16  # the grant of a second request
FORGED = "0f" * 16
GRANTS = {"kvbridge_read_grants": True}


def job(prefiller, local, remote, req="p-1", grant=GRANT):
    return prefiller_job(prefiller, local, remote, req, grant=grant)


def load(decoder, req, j):
    """Runs one load on ``decoder``; True when it succeeded."""
    decoder.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={req: j}))
    poll(decoder, want_recving={req})
    return req not in decoder.take_failed_recving()


def hold(prefiller, req, blocks, grant=GRANT, lease_s=30.0):
    """The prefiller's scheduler hands its worker a finished request, its grant and blocks."""
    meta = granted_meta(reqs_to_send={req: lease_s}, hold_blocks={req: list(blocks)})
    meta.grants[req] = grant
    prefiller.start_load_kv(meta)


def landed(cache, blocks) -> bool:
    return any(cache[name][b].any() for name in LAYERS for b in blocks)


def test_read_grants_are_off_by_default_and_said_in_the_directory(workers):
    assert settings_from(vllm_config("kv_producer")).read_grants is False
    assert settings_from(vllm_config("kv_producer", extra=GRANTS)).read_grants is True
    assert runs([7, 3, 4, 4, 5, 9]) == [(3, 3), (7, 1), (9, 1)]
    p = workers("kv_producer", kv_caches(seed=1), extra=GRANTS)
    d = workers("kv_consumer", kv_caches(seed=None))
    hold(p, "p-1", [2])
    assert load(d, "d-1", job(p, [1], [2]))
    assert d._prefillers[p.listen_addr].peer.read_grants is True
    off = workers("kv_producer", kv_caches(seed=2))
    hold(off, "p-1", [2])
    assert load(d, "d-2", job(off, [3], [2]))
    assert d._prefillers[off.listen_addr].peer.read_grants is False


def test_a_peer_without_the_grant_reads_nothing_and_its_session_goes_on(workers):
    p_cache, i_cache = kv_caches(seed=11), kv_caches(seed=None)
    p = workers("kv_producer", p_cache, extra=GRANTS)
    insider = workers("kv_consumer", i_cache, engine_id="insider")
    hold(p, "p-1", [1, 3])
    hold(p, "p-2", [5], grant=OTHER)
    # the session is up (a read of the other request, under its grant)
    assert load(insider, "i-0", job(p, [9], [5], req="p-2", grant=OTHER))
    sessions = insider.channel.stats()["sessions_ended"], p.channel.stats()["sessions_ended"]
    # a forged grant, and none at all (a decoder of an older connector): refused, typed
    assert not load(insider, "i-1", job(p, [2, 4], [1, 3], grant=FORGED))
    assert not load(insider, "i-2", job(p, [2, 4], [1, 3], grant=""))
    assert insider.stats["loads_failed_refused"] == 2
    assert not landed(i_cache, [2, 4]), "a refused read landed"
    # counted where the prefiller can count it: its channel, and the counters it hands vLLM
    assert p.channel.stats()["access_denied"] >= 2
    assert p.stats_since_last_report()["access_denied"] >= 2
    # a refused read under a grant ends no session
    assert load(insider, "i-3", job(p, [6], [5], req="p-2", grant=OTHER))
    assert torch.equal(i_cache[LAYERS[0]][6], p_cache[LAYERS[0]][5])
    assert insider.channel.stats()["sessions_ended"] == sessions[0]
    assert p.channel.stats()["sessions_ended"] == sessions[1]


def test_the_grantee_reads_its_request_and_no_other(workers):
    p_cache, d_cache = kv_caches(seed=12), kv_caches(seed=None)
    p = workers("kv_producer", p_cache, extra=GRANTS)
    d = workers("kv_consumer", d_cache, engine_id="D")
    hold(p, "p-1", [1, 3, 4])
    hold(p, "p-2", [2, 5], grant=OTHER)
    assert load(d, "d-1", job(p, [7, 8, 9], [1, 3, 4]))
    assert d.stats["loads_checked"] == 1  # its digests were read under the grant too
    for name in LAYERS:
        for local, remote in ((7, 1), (8, 3), (9, 4)):
            assert torch.equal(d_cache[name][local], p_cache[name][remote])
    # p-1's grant, reaching for p-2's blocks: one adjacent, one not
    before = p.channel.stats()["access_denied"]
    assert not load(d, "d-2", job(p, [10], [2]))
    assert not load(d, "d-3", job(p, [11, 12], [4, 5]))
    assert d.stats["loads_failed_refused"] == 2
    assert not landed(d_cache, [10, 11, 12])
    assert p.channel.stats()["access_denied"] >= before + 2
    # and the grant's holder is who read under it
    assert p.channel.token_users(bytes.fromhex(GRANT)) == [d.channel.peer_id]


def test_once_the_request_is_freed_its_grant_reads_nothing(workers):
    p_cache, d_cache = kv_caches(seed=13), kv_caches(seed=None)
    p = workers("kv_producer", p_cache, extra=GRANTS)
    d = workers("kv_consumer", d_cache)
    hold(p, "p-1", [1, 2])
    assert load(d, "d-1", job(p, [3, 4], [1, 2]))
    poll(p, want_sending={"p-1"})  # the decoder's "done": the blocks go back to vLLM
    assert len(p._read_grants) == 0 and p.channel.token_users(bytes.fromhex(GRANT)) == []
    before = p.channel.stats()["access_denied"]
    # refused, then its lease check finds the request ended: the load fails
    assert not load(d, "d-2", job(p, [5, 6], [1, 2]))
    assert not landed(d_cache, [5, 6]), "a read under a closed grant landed"
    assert p.channel.stats()["access_denied"] > before


def test_a_request_freed_by_its_lease_closes_its_grant(workers):
    p = workers("kv_producer", kv_caches(seed=14), extra=GRANTS)
    d_cache = kv_caches(seed=None)
    d = workers("kv_consumer", d_cache, engine_id="D")
    hold(p, "p-1", [1], lease_s=0.3)
    assert len(p._read_grants) == 1
    poll(p, want_sending={"p-1"})
    assert p.stats["leases_expired"] == 1 and len(p._read_grants) == 0
    before = p.channel.stats()["access_denied"]
    assert not load(d, "d-1", job(p, [2], [1]))
    assert not landed(d_cache, [2]) and p.channel.stats()["access_denied"] > before


def test_a_read_before_the_request_is_held_is_refused_then_read_again(workers):
    # the decoder's read reaches the prefiller before its worker holds the request (and
    # opens its windows): refused, the lease check waits for the hold, the read again lands
    p_cache, d_cache = kv_caches(seed=15), kv_caches(seed=None)
    p = workers("kv_producer", p_cache, extra=GRANTS)
    d = workers("kv_consumer", d_cache)
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [6], [3])}))
    deadline = time.monotonic() + 5
    while p.channel.stats()["access_denied"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.channel.stats()["access_denied"] >= 1
    hold(p, "p-1", [3])
    poll(d, want_recving={"d-1"})
    assert d.take_failed_recving() == set() and d.stats["loads_ok"] == 1
    for name in LAYERS:
        assert torch.equal(d_cache[name][6], p_cache[name][3])


@pytest.mark.parametrize("transport", [None, "tcp"])
def test_with_read_grants_every_read_goes_over_tcp(workers, transport):
    extra = {} if transport is None else {"kvbridge_transport": transport}
    p_cache, d_cache = kv_caches(seed=16), kv_caches(seed=None)
    p = workers("kv_producer", p_cache, extra={**GRANTS, **extra})
    d = workers("kv_consumer", d_cache, extra=extra)
    hold(p, "p-1", [1, 2, 3])
    assert load(d, "d-1", job(p, [4, 5, 6], [1, 2, 3]))
    poll(p, want_sending={"p-1"})
    s = d.channel.stats()
    assert (s["cma_batches"], s["shm_batches"], s["ucx_batches"]) == (0, 0, 0)
    assert p.stats["blocks_freed_on_notify"] == 1
