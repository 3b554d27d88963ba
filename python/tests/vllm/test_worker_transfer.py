"""The worker side with real kvbridge channels: a decoder reads a prefiller's blocks and
every request ends, on both sides, whatever happens to the transfer."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from kvbridge.vllm.metadata import KvbridgeConnectorMetadata, RecvJob

from vllm_helpers import LAYERS, kv_caches, poll
from vllm_helpers import GRANT, granted_meta, prefiller_job, recv_job  # noqa: E402


job = prefiller_job


def test_decoder_reads_prefiller_blocks_then_prefiller_frees_them(workers):
    p_cache = kv_caches(seed=1)
    d_cache = kv_caches(seed=None)
    p = workers("kv_producer", p_cache)
    d = workers("kv_consumer", d_cache)
    # the prefiller's scheduler handed its worker the finished request's lease
    p.start_load_kv(granted_meta(reqs_to_send={"p-1": 30.0}))
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [5, 9, 2], [1, 3, 7])}))
    _, recving = poll(d, want_recving={"d-1"})
    assert recving == {"d-1"}
    assert d.get_block_ids_with_load_errors() == set()
    assert d.take_failed_recving() == set()
    for name in LAYERS:
        for local, remote in ((5, 1), (9, 3), (2, 7)):
            assert torch.equal(d_cache[name][local], p_cache[name][remote]), (name, local)
        # blocks nobody asked for stay untouched
        assert not d_cache[name][0].any()
    sending, _ = poll(p, want_sending={"p-1"})
    assert sending == {"p-1"}
    assert p.stats["blocks_freed_on_notify"] == 1 and p.stats["leases_expired"] == 0
    assert d.stats["loads_ok"] == 1


def hold(prefiller, *reqs):
    """The prefiller's scheduler hands its worker finished requests to hold for a decoder."""
    prefiller.start_load_kv(granted_meta(reqs_to_send={r: 30.0 for r in reqs}))


def test_prefix_hit_on_decoder_reads_only_the_tail(workers):
    p_cache = kv_caches(seed=2)
    d_cache = kv_caches(seed=None)
    p = workers("kv_producer", p_cache)
    d = workers("kv_consumer", d_cache)
    hold(p, "p-1")
    # the decoder's own cache holds the prompt's first two blocks (10 and 11)
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [4], [1, 2, 3], hit=[10, 11])}))
    poll(d, want_recving={"d-1"})
    for name in LAYERS:
        assert torch.equal(d_cache[name][4], p_cache[name][3])
        assert not d_cache[name][10].any() and not d_cache[name][11].any()


def test_notification_before_lease_is_known_still_frees(workers):
    # a decoder's notice can overtake the prefiller's next step (after a failed load, say)
    p = workers("kv_producer", kv_caches(seed=3))
    d = workers("kv_consumer", kv_caches(seed=None))
    d._notify_done(p.listen_addr, None, "p-7", GRANT)
    deadline = time.monotonic() + 5
    while not len(p._dones) and time.monotonic() < deadline:
        p.get_finished(set())
        time.sleep(0.01)
    p.start_load_kv(granted_meta(reqs_to_send={"p-7": 30.0}))
    sending, _ = poll(p, want_sending={"p-7"}, timeout=2)
    assert sending == {"p-7"}


def test_a_done_notice_under_another_grant_frees_nothing(workers):
    # an insider: it holds the deployment's secret and knows the request id (not its grant)
    # and tells the prefiller it is done, to have the blocks freed while the real decoder
    # may still read them. Before the grant is known (the notice overtakes the step) and
    # after, the forgery frees nothing; the real notice still does.
    p = workers("kv_producer", kv_caches(seed=3))
    insider = workers("kv_consumer", kv_caches(seed=None))
    decoder = workers("kv_consumer", kv_caches(seed=None))
    forged = "0f" * 16
    insider._notify_done(p.listen_addr, None, "p-early", forged)
    deadline = time.monotonic() + 5
    while not len(p._dones) and time.monotonic() < deadline:
        p.get_finished(set())
        time.sleep(0.01)
    hold(p, "p-early", "p-late")
    insider._notify_done(p.listen_addr, None, "p-late", forged)
    deadline = time.monotonic() + 5
    while p.stats["notices_refused"] < 1 and time.monotonic() < deadline:
        sending, _ = p.get_finished(set())
        assert not sending, f"freed on a forged notice: {sending}"
        time.sleep(0.01)
    assert p.stats["notices_refused"] == 1  # the late one; the early one waits unmatched
    sending, _ = p.get_finished(set())
    assert not sending and set(p._leases) == {"p-early", "p-late"}
    for req in ("p-early", "p-late"):
        decoder._notify_done(p.listen_addr, None, req, GRANT)
    sending, _ = poll(p, want_sending={"p-early", "p-late"}, timeout=5)
    assert sending == {"p-early", "p-late"}
    assert p.stats["blocks_freed_on_notify"] == 2


def test_lease_frees_blocks_nobody_read(workers):
    p = workers("kv_producer", kv_caches(seed=4), extra={"kvbridge_lease_s": 0.3})
    p.start_load_kv(granted_meta(reqs_to_send={"p-1": 0.3}))
    t0 = time.monotonic()
    sending, _ = poll(p, want_sending={"p-1"}, timeout=5)
    assert time.monotonic() - t0 >= 0.3
    assert p.stats["leases_expired"] == 1


def test_unreachable_prefiller_fails_the_load_with_its_blocks(workers):
    d = workers("kv_consumer", kv_caches(seed=None), extra={"kvbridge_lease_s": 3, "kvbridge_read_timeout_s": 2})
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    bad = recv_job([3, 4], [0, 1], "P", "p-1", "127.0.0.1", port)
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": bad}))
    _, recving = poll(d, want_recving={"d-1"})
    assert recving == {"d-1"}
    assert d.take_failed_recving() == {"d-1"}
    assert d.get_block_ids_with_load_errors() == {3, 4}
    assert d.stats["loads_failed"] == 1


def test_out_of_range_remote_blocks_fail_the_load_and_still_free_the_prefiller(workers):
    p = workers("kv_producer", kv_caches(seed=5))
    d = workers("kv_consumer", kv_caches(seed=None))
    p.start_load_kv(granted_meta(reqs_to_send={"p-1": 30.0}))
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [1], [10_000])}))
    poll(d, want_recving={"d-1"})
    assert d.take_failed_recving() == {"d-1"}
    assert d.get_block_ids_with_load_errors() == {1}
    sending, _ = poll(p, want_sending={"p-1"})
    assert p.stats["blocks_freed_on_notify"] == 1


@pytest.mark.parametrize("heads", [1, 4])
def test_a_prefiller_of_another_model_is_refused_once_naming_both_layouts(workers, heads, caplog):
    p = workers("kv_producer", kv_caches(seed=6, heads=2))
    d = workers("kv_consumer", kv_caches(seed=None, heads=heads), total_kv_heads=heads)
    for i in (1, 2):
        d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={f"d-{i}": job(p, [i], [i], req=f"p-{i}")}))
        poll(d, want_recving={f"d-{i}"})
        assert d.take_failed_recving() == {f"d-{i}"}
        assert d.get_block_ids_with_load_errors() == {i}
    assert d.stats["loads_failed_refused"] == 2
    # decided at the first handshake with that prefiller, not at each request
    refusals = [r for r in caplog.records if r.levelname == "ERROR" and "incompatible layouts" in r.getMessage()]
    assert len(refusals) == 1, caplog.text
    assert "2 kv heads" in refusals[0].getMessage() and f"{heads} kv heads" in refusals[0].getMessage()


def test_notify_only_job_frees_the_prefiller_and_is_never_reported_to_vllm(workers):
    # vLLM's scheduler asserts that every finished_recving id is a live request; a job for a
    # request that already finished (or a full prefix hit) only tells the prefiller.
    p = workers("kv_producer", kv_caches(seed=5))
    d = workers("kv_consumer", kv_caches(seed=None))
    p.start_load_kv(granted_meta(reqs_to_send={"p-1": 30.0}))
    only = job(p, [], [1, 2])
    only.awaited = False
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"gone": only}))
    poll(p, want_sending={"p-1"})
    deadline = time.monotonic() + 5
    while d._loads and time.monotonic() < deadline:
        _, recving = d.get_finished(set())
        assert not recving, recving
        time.sleep(0.01)
    assert not d._loads
    assert d.get_finished(set()) == (None, None)
    assert d.take_failed_recving() == set()


def test_decoder_reconnects_to_a_prefiller_restarted_on_the_same_address(workers):
    first = workers("kv_producer", kv_caches(seed=6))
    d = workers("kv_consumer", kv_caches(seed=None))
    hold(first, "p-1")
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(first, [0], [0])}))
    poll(d, want_recving={"d-1"})
    port = int(first.listen_addr.rsplit(":", 1)[1])
    first.shutdown()
    p_cache = kv_caches(seed=7)
    second = workers("kv_producer", p_cache, extra={"kvbridge_port": port})
    hold(second, "p-2")
    d_cache = d._tensors
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-2": job(second, [3], [2], req="p-2")}))
    _, recving = poll(d, want_recving={"d-2"})
    assert d.take_failed_recving() == set()
    for name, t in zip(LAYERS, d_cache):
        assert torch.equal(t[3], p_cache[name][2]), name


def test_counters_reach_vllm_as_the_change_since_the_last_report(workers):
    from kvbridge.vllm.stats import KvbridgeConnectorStats

    p = workers("kv_producer", kv_caches(seed=8))
    d = workers("kv_consumer", kv_caches(seed=None))
    assert d.stats_since_last_report() is None
    hold(p, "p-1")
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [1, 2], [1, 2])}))
    poll(d, want_recving={"d-1"})
    delta = d.stats_since_last_report()
    assert delta["loads_ok"] == 1 and delta["bytes_read"] == 2 * sum(t[0].nbytes for t in d._tensors)
    assert d.stats_since_last_report() is None
    other = KvbridgeConnectorStats(data=dict(delta, loads_failed=1, loads_failed_timeout=1))
    total = KvbridgeConnectorStats(data=delta).aggregate(other)
    out = total.reduce()
    assert out["loads_ok"] == 2 and out["loads_failed_timeout"] == 1 and out["load_GiB_per_s"] > 0
    assert delta["read_seconds"] <= delta["load_seconds"] and out["read_GiB_per_s"] >= out["load_GiB_per_s"]
    assert KvbridgeConnectorStats().is_empty()


def test_a_read_after_the_lease_ended_fails_the_load(workers):
    # the prefiller gave the blocks back to vLLM (its lease ended): the bytes a late read
    # gets may be another request's, so the load fails instead of decoding on them
    p = workers("kv_producer", kv_caches(seed=9), extra={"kvbridge_lease_s": 0.2})
    d = workers("kv_consumer", kv_caches(seed=None))
    p.start_load_kv(granted_meta(reqs_to_send={"p-1": 0.2}))
    poll(p, want_sending={"p-1"}, timeout=5)
    assert p.stats["leases_expired"] == 1
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [2, 3], [4, 5])}))
    poll(d, want_recving={"d-1"})
    assert d.take_failed_recving() == {"d-1"}
    assert d.get_block_ids_with_load_errors() == {2, 3}
    assert d.stats["loads_failed_lease_ended"] == 1 and d.stats["loads_ok"] == 0


def test_a_read_after_the_blocks_were_freed_on_notice_fails_the_load(workers):
    p = workers("kv_producer", kv_caches(seed=10))
    d = workers("kv_consumer", kv_caches(seed=None))
    hold(p, "p-1")
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [1], [1])}))
    poll(d, want_recving={"d-1"})
    poll(p, want_sending={"p-1"})
    # a second decoder request for the same prefill (a retried decode) comes too late
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-2": job(p, [2], [1])}))
    poll(d, want_recving={"d-2"})
    assert d.take_failed_recving() == {"d-2"}
    assert d.stats["loads_failed_lease_ended"] == 1 and d.stats["loads_ok"] == 1


def test_a_read_before_the_prefiller_knows_the_lease_waits_for_it(workers):
    # the prefiller learns of a finished request one engine step after its answer left
    p_cache = kv_caches(seed=11)
    d_cache = kv_caches(seed=None)
    p = workers("kv_producer", p_cache)
    d = workers("kv_consumer", d_cache)
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [6], [3])}))
    time.sleep(0.3)
    _, recving = d.get_finished(set())
    assert not recving, "the load ended before the prefiller held the request"
    hold(p, "p-1")
    poll(d, want_recving={"d-1"})
    assert d.take_failed_recving() == set()
    for name in LAYERS:
        assert torch.equal(d_cache[name][6], p_cache[name][3]), name


def test_a_request_of_another_engine_on_the_address_fails_at_once(workers):
    # a prefiller restarted on the same address (a new engine id) has none of the old
    # engine's blocks: the load fails before it reads anything
    p = workers("kv_producer", kv_caches(seed=12))
    d = workers("kv_consumer", kv_caches(seed=None), extra={"kvbridge_read_timeout_s": 20})
    hold(p, "p-1")
    stale = job(p, [1], [1])
    stale.remote_engine_id = "an-engine-that-is-gone"
    t0 = time.monotonic()
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": stale}))
    poll(d, want_recving={"d-1"})
    assert time.monotonic() - t0 < 5
    assert d.take_failed_recving() == {"d-1"}
    assert d.stats["loads_failed_peer_lost"] == 1


def test_a_decoder_cannot_write_into_the_prefillers_kv_cache(workers, monkeypatch):
    # over TCP the prefiller does every copy and refuses a peer's write into its blocks
    # (a same-host decoder on cross-memory attach copies by itself: docs/vllm.md)
    import kvbridge

    monkeypatch.setenv("KVBRIDGE_CMA", "0")
    p_cache = kv_caches(seed=13)
    before = {name: t.clone() for name, t in p_cache.items()}
    p = workers("kv_producer", p_cache)
    d = workers("kv_consumer", kv_caches(seed=14), extra={"kvbridge_transport": "tcp"})
    peer = d._peer(job(p, [1], [1]), 0, time.monotonic() + 10)
    layer = d.layers[0]
    with pytest.raises(kvbridge.KvbridgeError):
        d.channel.write_pages(peer.peer_id, layer.region, [1], peer.regions[layer.name], [1])
    for name in LAYERS:
        assert torch.equal(p_cache[name], before[name]), name


def test_whole_page_reads_join_blocks_adjacent_on_both_sides():
    from kvbridge.vllm.rank_reads import whole_pages

    # (remote, local, count) runs of the blocks past a hit of one block
    runs = whole_pages(0, [0, 1, 2, 3, 9, 11], 1, [5, 6, 7, 2, 3]).by_rank[0]
    assert runs == [(1, 5, 3), (9, 2, 1), (11, 3, 1)]
    assert whole_pages(0, [0, 1], 0, [4, 3]).by_rank[0] == [(0, 4, 1), (1, 3, 1)]
    assert whole_pages(0, [], 0, []).by_rank[0] == []


def load_and_check(p, d, p_cache, d_cache, local, remote):
    """The decoder ``d`` loads the prefiller's ``remote`` blocks into its ``local`` ones (one
    request); they arrive byte-exact and no other block of the decoder changes."""
    hold(p, "p-1")
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, local, remote)}))
    poll(d, want_recving={"d-1"})
    assert d.take_failed_recving() == set()
    for name in LAYERS:
        for lo, ro in zip(local, remote):
            assert torch.equal(d_cache[name][lo], p_cache[name][ro]), (name, lo)
        untouched = [i for i in range(d_cache[name].shape[0]) if i not in local]
        assert not d_cache[name][untouched].any(), name


def test_contiguous_and_scattered_blocks_arrive_byte_exact_in_one_transfer(workers):
    p_cache = kv_caches(seed=15)
    d_cache = kv_caches(seed=None)
    p = workers("kv_producer", p_cache)
    d = workers("kv_consumer", d_cache)
    load_and_check(p, d, p_cache, d_cache, [8, 9, 10, 11, 3, 14], [1, 2, 3, 4, 8, 7])


def test_blocks_arrive_byte_exact_over_ucx(workers, monkeypatch):
    # kv_connector_extra_config's kvbridge_transport: "ucx", over UCX's same-user transports
    # (what runs without KVBRIDGE_UCX_TRUSTED_FABRIC: docs/ucx.md)
    import kvbridge

    if "ucx" not in kvbridge.TRANSPORTS:
        pytest.skip("this kvbridge package was built without UCX")
    monkeypatch.setenv("UCX_TLS", "posix,cma,self")
    p_cache = kv_caches(seed=17)
    d_cache = kv_caches(seed=None)
    p = workers("kv_producer", p_cache, extra={"kvbridge_transport": "ucx"})
    d = workers("kv_consumer", d_cache, extra={"kvbridge_transport": "ucx"})
    load_and_check(p, d, p_cache, d_cache, [8, 9, 10, 3, 14], [1, 2, 3, 8, 7])
    # the connector's counters (vLLM's "KV Transfer metrics" and /metrics) say UCX carried it
    stats = d.stats_since_last_report()
    assert stats["loads_ok"] == 1 and stats["ucx_batches"] >= 1, stats
    assert stats["shm_batches"] == stats["cma_batches"] == 0, stats
    poll(p, want_sending={"p-1"})


def test_a_prefiller_publishing_a_garbled_directory_fails_the_load_by_name(workers, caplog):
    from kvbridge.vllm.directory import DIRECTORY_MAGIC

    p = workers("kv_producer", kv_caches(seed=16))
    d = workers("kv_consumer", kv_caches(seed=None))
    hold(p, "p-1")
    at = len(DIRECTORY_MAGIC)
    p._directory[at : at + 4] = b"{{{{"  # a hostile or broken prefiller's directory
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [1], [1])}))
    poll(d, want_recving={"d-1"})
    assert d.take_failed_recving() == {"d-1"}
    assert d.stats["loads_failed_other"] == 1
    assert "bad layer directory (JSONDecodeError" in caplog.text, caplog.text


@pytest.mark.parametrize(
    "change, why",
    [
        ({"tp_rank": 5, "tp_size": 2}, "TP rank 5 of 2"),
        ({"tp_rank": -1}, "TP rank -1"),
        ({"layout": ["not", "an", "object"]}, "layout is not an object"),
        ({"layers": ["x"]}, "AttributeError"),
        ({"pages": None, "layout": None, "tp_size": "9" * 5000}, "ValueError"),
        # its integrity digests (digests.py): a chunk of no bytes, a region id that is no number
        ({"digest_chunk_bytes": 0}, "digest chunks of 0 bytes"),
        ({"digest_chunk_bytes": -4096}, "digest chunks of -4096 bytes"),
        ({"digests": "rows"}, "ValueError"),
        ({"digest_chunk_bytes": None}, "TypeError"),
    ],
)
def test_a_prefiller_whose_directory_lies_fails_the_load_by_name(workers, caplog, change, why):
    """A hostile or broken prefiller's directory (a rank past its size, a layout that is no
    object, an integer too long to convert): the load fails as a bad directory, no exception
    escapes into vLLM's step, and the prefiller's blocks are still freed by the notice path
    or the lease."""
    import json

    from kvbridge.vllm.directory import DIRECTORY_LEN, DIRECTORY_MAGIC

    p = workers("kv_producer", kv_caches(seed=18))
    d = workers("kv_consumer", kv_caches(seed=None))
    hold(p, "p-1")
    doc = json.loads(bytes(p._directory[len(DIRECTORY_MAGIC) :]).rstrip(b"\0"))
    doc.update(change)
    body = DIRECTORY_MAGIC + json.dumps(doc).encode()
    p._directory[:] = body + bytes(DIRECTORY_LEN - len(body))
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [1], [1])}))
    poll(d, want_recving={"d-1"})
    assert d.take_failed_recving() == {"d-1"}
    assert d.stats["loads_failed"] == 1
    assert "bad layer directory" in caplog.text and why in caplog.text, caplog.text


class _StallFirstLeaseRead:
    """The decoder's channel, except that its first lease table read never answers (a
    stand-in for a read the engine lost: the read the connector must give up on)."""

    class _Silent:
        done = False
        error = None

        def wait(self, timeout=None):
            time.sleep(timeout or 0)
            raise TimeoutError("no answer")

        def cancel(self):
            pass

    def __init__(self, channel, lease_region):
        self._channel = channel
        self._lease_region = lease_region
        self.stalled = 0

    def submit_read_pages(self, peer, local_region, *args, **kwargs):
        if local_region == self._lease_region and not self.stalled:
            self.stalled += 1
            return self._Silent()
        return self._channel.submit_read_pages(peer, local_region, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._channel, name)


def test_a_lease_read_without_an_answer_is_issued_again_into_another_slot(workers, monkeypatch):
    from kvbridge.vllm import worker as worker_mod

    monkeypatch.setattr(worker_mod, "LEASE_READ_STALL_S", 0.2)
    p_cache = kv_caches(seed=15)
    d_cache = kv_caches(seed=None)
    p = workers("kv_producer", p_cache)
    d = workers("kv_consumer", d_cache)
    stalling = _StallFirstLeaseRead(d.channel, d._lease_pages_region)
    d.channel = stalling
    hold(p, "p-1")
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [3], [4])}))
    poll(d, want_recving={"d-1"})
    assert stalling.stalled == 1
    assert d.take_failed_recving() == set()
    assert d.stats["loads_ok"] == 1 and d.stats["lease_reads_stalled"] == 1
    for name in LAYERS:
        assert torch.equal(d_cache[name][3], p_cache[name][4]), name
    # the given-up read's slot is not used again while its answer could still land there
    assert d._lease_slots.free() == worker_mod.LEASE_SLOTS - 1
    assert d._lease_slots.parked() == 1


class _LateLeaseReads:
    """The decoder's channel, except that its first ``stalls`` lease table reads answer
    late: each has no answer within the connector's stall limit, and completes (as the
    engine completes a read once nothing of it can land any more) only when ``land()`` says
    so, or at once when ``land_at_once``. Records the slot each late read was issued into,
    and whether the connector cancelled one (a cancelled read's end is never seen)."""

    class _Late:
        def __init__(self, slot):
            self.slot, self.done, self.error, self.cancelled = slot, False, None, False

        def wait(self, timeout=None):
            time.sleep(timeout or 0)  # the stall under test, not a readiness wait
            raise TimeoutError("no answer yet")

        def cancel(self):
            self.cancelled = True

    def __init__(self, channel, lease_region, stalls, land_at_once=False):
        self._channel, self._lease_region = channel, lease_region
        self.stalls, self.land_at_once = stalls, land_at_once
        self.late: list = []

    def submit_read_pages(self, peer, local_region, local_pages, *args, **kwargs):
        if local_region == self._lease_region and len(self.late) < self.stalls:
            if self.land_at_once and self.late:
                self.late[-1].done = True  # the previous one's answer came meanwhile
            self.late.append(self._Late(list(local_pages)[0]))
            return self.late[-1]
        return self._channel.submit_read_pages(peer, local_region, local_pages, *args, **kwargs)

    def land(self):
        for t in self.late:
            t.done = True

    def __getattr__(self, name):
        return getattr(self._channel, name)


def test_a_given_up_lease_reads_slot_comes_back_only_once_the_read_ended(workers, monkeypatch):
    """The slot of a lease read given up after the stall limit is not handed out while the
    read may still land there, and is handed out again once the engine completed it."""
    from kvbridge.vllm import worker as worker_mod
    from kvbridge.vllm.scratch_slots import SlotsTaken

    monkeypatch.setattr(worker_mod, "LEASE_READ_STALL_S", 0.1)
    p = workers("kv_producer", kv_caches(seed=16))
    d = workers("kv_consumer", kv_caches(seed=None))
    late = _LateLeaseReads(d.channel, d._lease_pages_region, stalls=1)
    d.channel = late
    hold(p, "p-1")
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [3], [4])}))
    poll(d, want_recving={"d-1"})
    assert d.take_failed_recving() == set() and d.stats["lease_reads_stalled"] == 1
    (read,) = late.late
    assert not read.cancelled, "a cancelled read's end is never seen: its slot could never come back"
    slots = d._lease_slots
    taken = [slots.take(time.monotonic() + 1) for _ in range(worker_mod.LEASE_SLOTS - 1)]
    assert read.slot not in taken
    with pytest.raises(SlotsTaken):  # the read may still land: its slot is not handed out
        slots.take(time.monotonic() + 0.2)
    read.done = True  # the engine completed it: nothing of it lands any more
    assert slots.take(time.monotonic() + 1) == read.slot
    assert slots.parked() == 0


def test_a_decoder_survives_more_stalled_lease_reads_than_it_has_slots(workers, monkeypatch):
    """Each given-up read completes after the next one was issued (an answer that came
    late): the loads go on using the slots, where keeping every given-up slot forever ran
    out of slots after LEASE_SLOTS stalls and failed the next load as ``timeout``."""
    from kvbridge.vllm import worker as worker_mod

    monkeypatch.setattr(worker_mod, "LEASE_READ_STALL_S", 0.02)
    p_cache = kv_caches(seed=17)
    d_cache = kv_caches(seed=None)
    p = workers("kv_producer", p_cache)
    d = workers("kv_consumer", d_cache)
    stalls = worker_mod.LEASE_SLOTS + 4
    late = _LateLeaseReads(d.channel, d._lease_pages_region, stalls=stalls, land_at_once=True)
    d.channel = late
    hold(p, "p-1")
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [3], [4])}))
    poll(d, want_recving={"d-1"})
    assert d.take_failed_recving() == set(), d.stats
    assert d.stats["lease_reads_stalled"] == stalls and d.stats["loads_ok"] == 1
    for name in LAYERS:
        assert torch.equal(d_cache[name][3], p_cache[name][4]), name
    assert not any(t.cancelled for t in late.late)
    late.land()
    d._lease_slots.reclaim()
    assert d._lease_slots.free() == worker_mod.LEASE_SLOTS
