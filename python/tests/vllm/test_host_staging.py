"""A KV cache in device memory, staged in host buffers (``kv_buffer_device: "cpu"``): the
blocks reach the decoder's device tensors byte-exact through real kvbridge channels on
loopback, the prefiller offers only what it copied from its device, and a failed copy ends
that request with its blocks freed. The device is a stand-in (stand_in_device.py)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from kvbridge.vllm.config import settings_from
from kvbridge.vllm.metadata import KvbridgeConnectorMetadata, RecvJob
from kvbridge.vllm.staging import DeviceMemoryError, HostStaging
from kvbridge.vllm.worker import KvbridgeWorker

from stand_in_device import CopyOps, device_caches, plain
from vllm_helpers import LAYERS, NUM_BLOCKS, poll, vllm_config
from vllm_helpers import granted_meta, recv_job  # noqa: E402


@pytest.fixture
def staged():
    """Makes workers over stand-in device caches with ``kv_buffer_device`` set (default
    ``"cpu"``) and the stand-in copy op handed over as vLLM does, after registration."""
    made = []

    def make(role, caches, *, kv_buffer_device="cpu", num_blocks=None, ops=None, **kw):
        cfg = vllm_config(role, **kw)
        cfg.kv_transfer_config.kv_buffer_device = kv_buffer_device
        w = KvbridgeWorker(cfg, settings_from(cfg), num_blocks=num_blocks)
        made.append(w)
        w.register_kv_caches(caches)
        w.set_host_xfer_buffer_ops(ops if ops is not None else CopyOps())
        return w

    yield make
    for w in made:
        w.shutdown()


def job(prefiller, local, remote, req="p-1"):
    host, port = prefiller.listen_addr.rsplit(":", 1)
    return recv_job(list(local), list(remote), prefiller.settings.engine_id, req, host, int(port))


def forward(caches, blocks, seed):
    """What a forward pass does to the device KV: new bytes in the request's blocks."""
    for i, (name, t) in enumerate(caches.items()):
        g = torch.Generator().manual_seed(seed + 100 * i)
        fresh = torch.randn((len(blocks), *t.shape[1:]), generator=g).to(t.dtype)
        plain(t)[torch.tensor(blocks)] = fresh


def finish_prefill(p, req, blocks):
    """The prefiller's steps for a do_remote_decode request: wait_for_save of the step that
    completes its prompt, then the next step's start_load_kv with its lease."""
    p.save_to_host({req: list(blocks)})
    p.start_load_kv(granted_meta(reqs_to_send={req: 30.0}, hold_blocks={req: list(blocks)}))


def test_device_blocks_reach_the_decoders_device_byte_exact(staged):
    p_dev = device_caches(seed=1)
    d_dev = device_caches(seed=None)
    p_ops, d_ops = CopyOps(), CopyOps()
    p = staged("kv_producer", p_dev, ops=p_ops)
    d = staged("kv_consumer", d_dev, ops=d_ops)
    # kvbridge has the host buffers, never the device tensors
    device_ptrs = {plain(t).data_ptr() for t in [*p_dev.values(), *d_dev.values()]}
    assert not device_ptrs & {t.data_ptr() for t in [*p._tensors, *d._tensors]}
    remote, local = [1, 3, 4, 7], [5, 9, 10, 2]
    forward(p_dev, remote, seed=50)  # the bytes the decoder must get are the forward's
    finish_prefill(p, "p-1", remote)
    assert p_ops.calls == [("d2h", remote)]
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, local, remote)}))
    _, recving = poll(d, want_recving={"d-1"})
    assert recving == {"d-1"} and d.take_failed_recving() == set()
    assert d_ops.calls == [("h2d", local)]
    for name in LAYERS:
        for lo, ro in zip(local, remote):
            assert torch.equal(plain(d_dev[name])[lo], plain(p_dev[name])[ro]), (name, lo)
        untouched = [i for i in range(NUM_BLOCKS) if i not in local]
        assert not plain(d_dev[name])[untouched].any(), name
    poll(p, want_sending={"p-1"})
    assert p.stats["blocks_freed_on_notify"] == 1 and p.stats["saves_failed"] == 0
    assert d.stats["loads_ok"] == 1


def test_kernel_blocks_smaller_than_vllms_blocks_move_as_one_page(staged):
    # 8 logical blocks of 2 kernel rows each (the attention kernel's block is half vLLM's)
    p_dev = device_caches(seed=2, rows=NUM_BLOCKS)
    d_dev = device_caches(seed=None, rows=NUM_BLOCKS)
    p = staged("kv_producer", p_dev, num_blocks=NUM_BLOCKS // 2)
    d = staged("kv_consumer", d_dev, num_blocks=NUM_BLOCKS // 2)
    forward(p_dev, [4, 5, 6, 7], seed=51)
    finish_prefill(p, "p-1", [2, 3])
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [6, 1], [2, 3])}))
    poll(d, want_recving={"d-1"})
    assert d.take_failed_recving() == set()
    for name in LAYERS:
        for lo, ro in ((12, 4), (13, 5), (2, 6), (3, 7)):
            assert torch.equal(plain(d_dev[name])[lo], plain(p_dev[name])[ro]), (name, lo)


def test_a_request_never_copied_to_host_is_freed_not_offered(staged):
    p = staged("kv_producer", device_caches(seed=3))
    d = staged("kv_consumer", device_caches(seed=None))
    p.start_load_kv(granted_meta(reqs_to_send={"p-1": 30.0}))  # no save came
    sending, _ = p.get_finished(set())
    assert sending == {"p-1"} and p.stats["saves_failed"] == 1
    t0 = time.monotonic()
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [1], [1])}))
    poll(d, want_recving={"d-1"})
    assert time.monotonic() - t0 < 5, "the decoder waited for a lease that never comes"
    assert d.take_failed_recving() == {"d-1"} and d.get_block_ids_with_load_errors() == {1}
    assert d.stats["loads_failed_lease_ended"] == 1


@pytest.mark.parametrize("broken", ["copy fails", "no copy op"])
def test_a_failed_device_to_host_copy_frees_the_request(staged, caplog, broken):
    ops = CopyOps()
    ops.fail = "d2h"
    p = staged("kv_producer", device_caches(seed=4), ops=ops)
    if broken == "no copy op":
        p._copy_op = None
        p.staging._copy_op = None
    d = staged("kv_consumer", device_caches(seed=None))
    with caplog.at_level(logging.ERROR, logger="kvbridge.vllm.worker"):
        finish_prefill(p, "p-1", [2, 3])
    want = "stand-in d2h copy refused" if broken == "copy fails" else "set_host_xfer_buffer_ops"
    assert "request p-1: d2h copy of" in caplog.text and want in caplog.text, caplog.text
    assert p._leases == {} and p._lease_table.held() == 0
    sending, _ = p.get_finished(set())
    assert sending == {"p-1"} and p.stats["saves_failed"] == 1
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [2, 3], [2, 3])}))
    poll(d, want_recving={"d-1"})
    assert d.take_failed_recving() == {"d-1"} and d.stats["loads_failed_lease_ended"] == 1


def test_a_failed_host_to_device_copy_fails_the_load_and_frees_both_sides(staged, caplog):
    ops = CopyOps()
    ops.fail = "h2d"
    p = staged("kv_producer", device_caches(seed=5))
    d = staged("kv_consumer", device_caches(seed=None), ops=ops)
    finish_prefill(p, "p-1", [1, 2])
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [3, 4], [1, 2])}))
    _, recving = poll(d, want_recving={"d-1"})
    assert recving == {"d-1"}
    assert d.take_failed_recving() == {"d-1"}
    assert d.get_block_ids_with_load_errors() == {3, 4}
    assert d.stats["loads_failed_copy"] == 1 and d.stats["loads_ok"] == 0
    assert "h2d copy of blocks [3, 4] failed: RuntimeError: stand-in h2d copy refused" in caplog.text
    poll(p, want_sending={"p-1"})  # the prefiller was told, its blocks freed
    assert p.stats["blocks_freed_on_notify"] == 1


@pytest.mark.parametrize("kv_buffer_device", [None, "cuda"])
def test_device_kv_without_host_staging_is_refused_by_name(staged, kv_buffer_device):
    with pytest.raises(DeviceMemoryError) as e:
        staged("kv_producer", device_caches(seed=6), kv_buffer_device=kv_buffer_device)
    msg = str(e.value)
    assert "cuda:0" in msg and '"kv_buffer_device": "cpu"' in msg and repr(kv_buffer_device) in msg, msg
    assert "model.layers.0.self_attn.attn" in msg


def test_host_kv_is_registered_as_it_is_whatever_kv_buffer_device_says(staged):
    from vllm_helpers import kv_caches

    caches = kv_caches(seed=7)
    w = staged("kv_producer", caches, kv_buffer_device="cpu")
    assert w.staging is None
    assert [t.data_ptr() for t in w._tensors] == [t.data_ptr() for t in caches.values()]


def test_rows_that_are_not_whole_blocks_are_refused():
    with pytest.raises(DeviceMemoryError, match="not a whole number of blocks"):
        HostStaging(device_caches(seed=None, rows=NUM_BLOCKS), num_blocks=NUM_BLOCKS - 1)


def test_staged_and_host_kv_caches_of_one_shape_have_one_layout(staged):
    # a GPU prefiller staging in host memory and a vLLM CPU decoder with equal tensor
    # shapes and dtypes line up block for block, so the handshake must not refuse them
    from vllm_helpers import kv_caches

    p_dev = device_caches(seed=8)
    p = staged("kv_producer", p_dev)
    d_cache = kv_caches(seed=None)
    d = staged("kv_consumer", d_cache)
    assert d.staging is None
    finish_prefill(p, "p-1", [3])
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [6], [3])}))
    poll(d, want_recving={"d-1"})
    assert d.take_failed_recving() == set()
    for name in LAYERS:
        assert torch.equal(d_cache[name][6], plain(p_dev[name])[3]), name
