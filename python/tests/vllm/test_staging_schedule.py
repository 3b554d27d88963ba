"""The prefiller's scheduler side of host staging: which blocks the workers copy to host
memory, and when (the step that completes a ``do_remote_decode`` prompt, all its blocks),
and the connector's ``wait_for_save`` handing them to the worker."""

from __future__ import annotations

from types import SimpleNamespace

from kvbridge.vllm.config import settings_from
from kvbridge.vllm.connector import KvbridgeConnector
from kvbridge.vllm.metadata import KvbridgeConnectorMetadata
from kvbridge.vllm.scheduler import KvbridgeScheduler

from vllm_helpers import vllm_config


def scheduler(role="kv_producer", kv_buffer_device="cpu"):
    cfg = vllm_config(role)
    cfg.kv_transfer_config.kv_buffer_device = kv_buffer_device
    return KvbridgeScheduler(cfg, settings_from(cfg))


def request(req_id, prompt, computed=0):
    return SimpleNamespace(
        request_id=req_id,
        kv_transfer_params={"do_remote_decode": True},
        num_prompt_tokens=prompt,
        num_computed_tokens=computed,
        prompt_token_ids=list(range(prompt)),
    )


def step(new=(), cached=(), scheduled=None, resumed=()):
    """A SchedulerOutput with what build_connector_meta reads: new requests with their block
    ids, cached ones with their new block ids, tokens scheduled per request."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,)) for r, b in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached],
            new_block_ids=[(b,) if b is not None else None for _, b in cached],
            resumed_req_ids=set(resumed),
        ),
        num_scheduled_tokens=dict(scheduled or {}),
    )


def test_a_chunked_prompt_is_saved_whole_in_the_step_that_completes_it():
    s = scheduler()
    r = request("r", prompt=100)
    s.update_state_after_alloc(r, None, 0)
    meta = s.build_connector_meta(step(new=[("r", [4, 5])], scheduled={"r": 64}))
    assert meta.reqs_to_save == {}  # 64 of 100 tokens: the KV is not complete
    r.num_computed_tokens = 64
    meta = s.build_connector_meta(step(cached=[("r", [9])], scheduled={"r": 36}))
    assert meta.reqs_to_save == {"r": [4, 5, 9]}
    r.num_computed_tokens = 100
    meta = s.build_connector_meta(step(cached=[("r", None)], scheduled={"r": 1}))
    assert meta.reqs_to_save == {}


def test_a_resumed_request_saves_its_new_blocks_only():
    s = scheduler()
    r = request("r", prompt=40)
    s.update_state_after_alloc(r, None, 0)
    s.build_connector_meta(step(new=[("r", [1])], scheduled={"r": 32}))
    meta = s.build_connector_meta(step(cached=[("r", [7, 8])], scheduled={"r": 40}, resumed=["r"]))
    assert meta.reqs_to_save == {"r": [7, 8]}


def test_nothing_is_saved_without_staging_or_for_a_finished_request():
    s = scheduler(kv_buffer_device="cuda")
    s.update_state_after_alloc(request("r", 10), None, 0)
    assert s.build_connector_meta(step(new=[("r", [1])], scheduled={"r": 10})).reqs_to_save == {}
    s = scheduler(role="kv_consumer")
    s.update_state_after_alloc(request("r", 10), None, 0)
    assert s.build_connector_meta(step(new=[("r", [1])], scheduled={"r": 10})).reqs_to_save == {}
    s = scheduler()
    r = request("r", 100)
    s.update_state_after_alloc(r, None, 0)
    r.status = None
    s.request_finished(r, [[1]])  # aborted mid-prompt
    assert s.build_connector_meta(step(cached=[("r", [2])], scheduled={"r": 100})).reqs_to_save == {}


def test_wait_for_save_hands_the_steps_saves_to_the_worker():
    saved = []
    conn = object.__new__(KvbridgeConnector)
    conn._connector_metadata = None
    conn.connector_worker = SimpleNamespace(save_to_host=saved.append)
    conn.wait_for_save()  # no metadata bound: nothing
    conn.bind_connector_metadata(KvbridgeConnectorMetadata(reqs_to_save={"r": [3, 4]}))
    conn.wait_for_save()
    conn.bind_connector_metadata(KvbridgeConnectorMetadata())
    conn.wait_for_save()
    assert saved == [{"r": [3, 4]}]
