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
from vllm_helpers import granted_meta  # noqa: E402


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


def test_wait_for_save_hands_the_steps_saves_and_holds_to_the_worker():
    saved = []
    conn = object.__new__(KvbridgeConnector)
    conn._connector_metadata = None
    conn.connector_worker = SimpleNamespace(wait_for_save=saved.append, before_forward=lambda meta: None)
    conn.wait_for_save()  # no metadata bound: nothing
    to_save = KvbridgeConnectorMetadata(reqs_to_save={"r": [3, 4]})
    conn.bind_connector_metadata(to_save)
    conn.wait_for_save()
    to_hold = granted_meta(reqs_to_hold={"q"})
    conn.bind_connector_metadata(to_hold)
    conn.wait_for_save()
    conn.bind_connector_metadata(KvbridgeConnectorMetadata())
    conn.wait_for_save()
    assert saved == [to_save, to_hold]


def test_vllms_scheduler_gets_a_chunked_prompt_saved_whole_in_its_last_chunk(tmp_path):
    """vLLM's real scheduler (a local OPT config), a prefiller with kv_buffer_device "cpu"
    and chunks of 64 tokens: the 101-token prompt's four blocks are named once, in the
    step that schedules its last chunk, before the request finishes."""
    import torch
    from transformers import OPTConfig
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_helpers import BLOCK_SIZE

    OPTConfig(architectures=["OPTForCausalLM"], torch_dtype="float16").to_json_file(tmp_path / "config.json")
    config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1024, is_encoder_decoder=False,
            enable_chunked_prefill=True,
        ),  # fmt: skip
        model_config=ModelConfig(model=str(tmp_path), dtype="float16", seed=42),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvbridgeConnector", kv_connector_module_path="kvbridge.vllm", kv_role="kv_producer",
            kv_buffer_device="cpu",
        ),  # fmt: skip
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = 64
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    sched = Scheduler(
        vllm_config=config, kv_cache_config=kv, log_stats=True,
        structured_output_manager=StructuredOutputManager(config), block_size=BLOCK_SIZE,
    )  # fmt: skip
    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=1)
    sp.update_from_generation_config({}, 2)
    prompt = 3 * BLOCK_SIZE + 5
    req = Request(
        request_id="p-1", prompt_token_ids=[(i % 900) + 3 for i in range(prompt)], sampling_params=sp,
        pooling_params=None, mm_features=None, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )  # fmt: skip
    req.kv_transfer_params = {"do_remote_decode": True, "do_remote_prefill": False}
    sched.add_request(req)
    saves = []
    for _ in range(4):
        out = sched.schedule()
        if not out.num_scheduled_tokens:
            break
        saves.append(dict(out.kv_connector_metadata.reqs_to_save))
        blocks = list(sched.kv_cache_manager.get_block_ids("p-1")[0])
        done = req.num_computed_tokens >= prompt  # advanced by schedule()
        ids = list(out.num_scheduled_tokens)
        sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[5] if done else [] for _ in ids], logprobs=None, prompt_logprobs_dict={},
                pooler_output=None,
            ),
        )  # fmt: skip
    assert saves == [{}, {"p-1": blocks}], saves
    assert len(blocks) == 4
