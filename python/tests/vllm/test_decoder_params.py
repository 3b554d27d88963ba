"""A decoder request with ``do_remote_prefill`` ends in one counted outcome: loaded, failed
(typed, counted, vLLM's ``kv_load_failure_policy`` applies), or computed by vLLM itself
(``loads_recomputed``). Never computed unnoticed, never parked for a load nobody starts, never
an exception in vLLM's scheduler.

vLLM's real scheduler (a local OPT config, no hub) drives KvbridgeConnector's scheduler side;
its metadata goes to a real KvbridgeWorker, whose results go back into the scheduler.
"""

from __future__ import annotations

import itertools
import json

import pytest

import kvbridge
from kvbridge.vllm import rank_reads
from vllm_helpers import BLOCK_SIZE, kv_caches, poll

torch = pytest.importorskip("torch")

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

PROMPT_TOKENS = 3 * BLOCK_SIZE + 5  # four blocks
_ids = itertools.count(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import OPTConfig

    d = tmp_path_factory.mktemp("opt")
    OPTConfig(architectures=["OPTForCausalLM"], torch_dtype="float16").to_json_file(d / "config.json")
    return str(d)


def scheduler(model: str) -> Scheduler:
    model_config = ModelConfig(model=model, dtype="float16", seed=42)
    config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024,
            is_encoder_decoder=False,
        ),  # fmt: skip
        model_config=model_config,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvbridgeConnector", kv_connector_module_path="kvbridge.vllm",
            kv_role="kv_consumer", kv_load_failure_policy="fail",
        ),  # fmt: skip
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = 64
    kv = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"], FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
            )
        ],
    )
    return Scheduler(
        vllm_config=config, kv_cache_config=kv, log_stats=True,
        structured_output_manager=StructuredOutputManager(config), block_size=BLOCK_SIZE,
    )  # fmt: skip


def good_params(n: int) -> dict:
    return dict(
        do_remote_prefill=True, do_remote_decode=False, remote_engine_id="p",
        remote_request_id=f"prefill-{n}", remote_block_ids=[[10, 11, 12, 13]],
        remote_host="127.0.0.1", remote_port=1, tp_size=1, remote_num_tokens=PROMPT_TOKENS,
        kvbridge_grant="5a" * 16,
    )  # fmt: skip


def decode_request(params: dict, **sampling) -> Request:
    init_none_hash(sha256)
    n = next(_ids)
    sp = SamplingParams(max_tokens=4, **sampling)
    sp.update_from_generation_config({}, 2)
    req = Request(
        request_id=f"d-{n}", prompt_token_ids=[(7 * n + i) % 1000 + 3 for i in range(PROMPT_TOKENS)],
        sampling_params=sp, pooling_params=None, mm_features=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )  # fmt: skip
    req.kv_transfer_params = params
    return req


def runner_output(out, kv: KVConnectorOutput | None) -> ModelRunnerOutput:
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[5] for _ in ids],
        logprobs=None, prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv,
    )  # fmt: skip



BAD_PARAMS = {
    "no_remote_host": lambda p: {**p, "remote_host": None},
    "no_remote_request_id": lambda p: {k: v for k, v in p.items() if k != "remote_request_id"},
    "empty_remote_block_ids": lambda p: {**p, "remote_block_ids": []},
    "remote_block_ids_not_ints": lambda p: {**p, "remote_block_ids": [["a", "b"]]},
    "remote_port_not_a_port": lambda p: {**p, "remote_port": "x"},
    "fewer_remote_blocks_than_the_prompt": lambda p: {**p, "remote_block_ids": [[10, 11]]},
    "prefiller_saw_a_shorter_prompt": lambda p: {**p, "remote_num_tokens": PROMPT_TOKENS - 7},
    "no_grant": lambda p: {k: v for k, v in p.items() if k != "kvbridge_grant"},
    "grant_not_hex": lambda p: {**p, "kvbridge_grant": "Z" * 32},
}


@pytest.mark.parametrize("case", sorted(BAD_PARAMS))
def test_unusable_params_fail_the_load_typed_and_counted(model_dir, workers, case):
    sched = scheduler(model_dir)
    worker = workers("kv_consumer", kv_caches(None))
    req = decode_request(BAD_PARAMS[case](good_params(0)))
    sched.add_request(req)
    out = sched.schedule()  # before: AssertionError in vLLM's scheduler (empty blocks)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, "computed without loading"
    job = out.kv_connector_metadata.reqs_to_recv.get(req.request_id)
    # before: no job, so the request waited in WAITING_FOR_REMOTE_KVS forever
    assert job is not None and job.error, "no load job: the request would wait forever"

    worker.start_load_kv(out.kv_connector_metadata)
    _, recving = poll(worker, want_recving={req.request_id}, timeout=5)
    failed = worker.take_failed_recving()
    assert failed == {req.request_id}
    assert worker.stats["loads_failed_bad_params"] == 1 and worker.stats["loads_failed"] == 1
    assert worker.stats["loads_ok"] == 0
    bad_blocks = worker.get_block_ids_with_load_errors()
    assert bad_blocks and bad_blocks <= set(job.local_block_ids)

    # vLLM's policy "fail" ends the request with an error and frees its blocks
    kv = KVConnectorOutput(finished_recving=recving, failed_recving=failed, invalid_block_ids=bad_blocks)
    sched.update_from_output(out, runner_output(out, kv))
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, runner_output(out, None))
    assert req.request_id not in sched.requests, "the request did not end"
    assert req.status == RequestStatus.FINISHED_ERROR
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 63  # all but the null block


def test_a_prompt_vllm_computes_itself_is_counted_as_recomputed(model_dir, workers):
    """Prompt logprobs make vLLM skip every cache, so the decoder computes the prompt itself
    (vLLM's semantics): the prefiller is still told to free its blocks, and the outcome is
    counted as loads_recomputed instead of passing unnoticed."""
    sched = scheduler(model_dir)
    worker = workers("kv_consumer", kv_caches(None))
    req = decode_request(good_params(1), prompt_logprobs=1)
    sched.add_request(req)
    out = sched.schedule()
    assert req.status == RequestStatus.RUNNING and out.num_scheduled_tokens[req.request_id] == PROMPT_TOKENS
    job = out.kv_connector_metadata.reqs_to_recv[req.request_id]
    assert job.recomputed and not job.awaited and not job.local_block_ids
    worker.start_load_kv(out.kv_connector_metadata)
    poll(worker, timeout=1)
    assert worker.stats["loads_recomputed"] == 1
    assert worker.stats["loads_ok"] == 0 and worker.stats["loads_failed"] == 0


def test_remote_blocks_past_the_prompt_are_not_read(model_dir):
    """A prefiller's list longer than the prompt (lookahead slots at its end): block i of the
    prompt is read from remote block i, not from the list's tail."""
    sched = scheduler(model_dir)
    req = decode_request({**good_params(2), "remote_block_ids": [[10, 11, 12, 13, 14]]})
    sched.add_request(req)
    out = sched.schedule()
    job = out.kv_connector_metadata.reqs_to_recv[req.request_id]
    assert not job.error
    assert len(job.local_block_ids) == 4 and job.prompt_tokens == PROMPT_TOKENS and not job.hit_block_ids
    # whole pages: remote block i into local block i
    runs = rank_reads.whole_pages(0, job.remote_block_ids, 0, job.local_block_ids).by_rank[0]
    assert sorted(r for r, _, n in runs for r in range(r, r + n)) == [10, 11, 12, 13]
    # translated: the bytes read come from blocks 10..13 only
    layout = json.dumps(dict(
        model="m", layers=1, total_kv_heads=1, head_dim=1, mla=False, dtype="fp32", block_tokens=BLOCK_SIZE,
        block_order=["head", "token", "kv"], tp_rank=0, tp_size=1,
    ))  # fmt: skip
    block_bytes = BLOCK_SIZE * 2 * 4
    reads = rank_reads.translated(
        kvbridge.ReadPlanner(layout, layout), block_bytes, BLOCK_SIZE, BLOCK_SIZE, job.remote_block_ids, [],
        job.local_block_ids, job.prompt_tokens,
    ).by_rank[0]  # fmt: skip
    read = {b for src, _, n in reads for b in range(src // block_bytes, -(-(src + n) // block_bytes))}
    assert read == {10, 11, 12, 13}


def test_a_notice_to_an_address_that_does_not_resolve_is_a_failed_notice(model_dir, workers):
    """A request vLLM computes itself still tells its prefiller, from vLLM's step: a host that
    does not resolve (it came from the client) is counted as a failed notice, never an
    exception in the step."""
    sched = scheduler(model_dir)
    worker = workers("kv_consumer", kv_caches(None))
    req = decode_request({**good_params(3), "remote_host": "999.1.1.1"}, prompt_logprobs=1)
    sched.add_request(req)
    out = sched.schedule()
    worker.start_load_kv(out.kv_connector_metadata)  # before: ConfigError raised here
    poll(worker, timeout=1)
    assert worker.stats["notices_failed"] == 1 and worker.stats["loads_recomputed"] == 1
