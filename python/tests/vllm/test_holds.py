"""A prefiller marks a request held in the step that computes its prompt, when the request
finishes with that step (max_tokens 1, as proxies send): its decoder finds it held at the
first look, whatever the prefiller does next. A mark whose request then finishes without a
delayed free ends before the next forward pass can write into its blocks."""

from __future__ import annotations

import time
from types import SimpleNamespace

from kvbridge.vllm.config import settings_from
from kvbridge.vllm.lease_table import PAGE_BYTES, LeaseState, state, where
from kvbridge.vllm.metadata import KvbridgeConnectorMetadata
from kvbridge.vllm.scheduler import KvbridgeScheduler
from kvbridge.vllm.worker import IDLE_WAIT_S

from vllm_helpers import kv_caches, poll, vllm_config
from vllm_helpers import granted_meta  # noqa: E402


def scheduler(role="kv_producer"):
    cfg = vllm_config(role)
    return KvbridgeScheduler(cfg, settings_from(cfg))


def request(req_id, prompt, max_tokens):
    from vllm.v1.request import RequestStatus

    return SimpleNamespace(
        request_id=req_id,
        kv_transfer_params={"do_remote_decode": True},
        num_prompt_tokens=prompt,
        num_computed_tokens=0,
        prompt_token_ids=list(range(prompt)),
        max_tokens=max_tokens,
        status=RequestStatus.RUNNING,
    )


def step(new=(), scheduled=None):
    scheduled = dict(scheduled or {})
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,)) for r, b in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
    )


def test_a_prompt_that_ends_its_request_is_held_in_the_step_that_computes_it():
    from vllm.v1.request import RequestStatus

    s = scheduler()
    one, more = request("one", 40, max_tokens=1), request("more", 40, max_tokens=5)
    for r in (one, more):
        s.update_state_after_alloc(r, None, 0)
    meta = s.build_connector_meta(step(new=[("one", [1, 2]), ("more", [3, 4])], scheduled={"one": 40, "more": 40}))
    # "more" goes on decoding: it is marked when it finishes, from its lease
    assert meta.reqs_to_hold == {"one"} and meta.reqs_to_save == {} and not meta.idle
    # the workers learn the request's grant with its hold: a decoder's notice may come
    # before the next step
    grant = meta.grants["one"]
    assert set(meta.grants) == {"one"} and len(grant) == 32
    one.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = s.request_finished(one, ([1, 2],))
    assert delay and params["remote_request_id"] == "one"
    assert params["kvbridge_grant"] == grant  # the decoder gets the grant the workers hold
    meta = s.build_connector_meta(step())
    assert meta.reqs_to_send == {"one": s.settings.lease_s} and meta.reqs_not_sent == set() and meta.idle
    assert meta.grants == {"one": grant}
    # each request its own grant; none kept once finished
    more.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = s.request_finished(more, ([3, 4],))
    assert params["kvbridge_grant"] != grant and s._grants == {}


def test_a_held_request_that_finishes_without_a_delayed_free_is_unmarked_next_step():
    from vllm.v1.request import RequestStatus

    s = scheduler()
    r = request("r", 40, max_tokens=1)
    s.update_state_after_alloc(r, None, 0)
    assert s.build_connector_meta(step(new=[("r", [1, 2])], scheduled={"r": 40})).reqs_to_hold == {"r"}
    r.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(r, ([1, 2],)) == (False, None)
    meta = s.build_connector_meta(step())
    assert meta.reqs_not_sent == {"r"} and meta.reqs_to_send == {}
    assert s.build_connector_meta(step()).reqs_not_sent == set()


def lease_of(prefiller, req_id) -> LeaseState:
    base = where(req_id) * PAGE_BYTES
    return state(req_id, bytes(prefiller._lease_table.memory[base : base + PAGE_BYTES]))


def test_the_worker_marks_after_the_forward_pass_and_unmarks_before_the_next(workers):
    p = workers("kv_producer", kv_caches(seed=21))
    p.wait_for_save(granted_meta(reqs_to_hold={"r", "q"}))
    assert lease_of(p, "r") is LeaseState.HELD and lease_of(p, "q") is LeaseState.HELD
    # "q" finished with a delayed free: held on, its lease clock started
    meta = granted_meta(reqs_to_send={"q": 30.0}, reqs_not_sent={"r"})
    p.before_forward(meta)
    assert lease_of(p, "r") is LeaseState.ENDED
    p.start_load_kv(meta)
    assert lease_of(p, "q") is LeaseState.HELD and set(p._leases) == {"q"}


def test_a_decoder_finds_its_request_held_at_the_first_look(workers):
    from test_worker_transfer import job

    p = workers("kv_producer", kv_caches(seed=22))
    d = workers("kv_consumer", kv_caches(seed=None))
    p.wait_for_save(granted_meta(reqs_to_hold={"p-1"}))
    # the prefiller takes no further step: no lease clock, no table change
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [3], [3])}))
    poll(d, want_recving={"d-1"})
    assert d.take_failed_recving() == set() and d.stats["loads_ok"] == 1


def test_an_idle_step_waits_for_the_notification_it_steps_for(workers):
    from test_worker_transfer import job

    p = workers("kv_producer", kv_caches(seed=23))
    d = workers("kv_consumer", kv_caches(seed=None))
    hold = granted_meta(reqs_to_send={"p-1": 30.0})
    p.before_forward(hold)
    p.start_load_kv(hold)
    # nothing comes: the step sleeps its whole wait instead of returning to spin
    t0 = time.monotonic()
    p.wait_idle()
    assert time.monotonic() - t0 >= IDLE_WAIT_S * 0.9
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job(p, [2], [2])}))
    poll(d, want_recving={"d-1"})
    # the decoder's "read done" reaches an idle prefiller step, which returns with it
    for _ in range(500):  # bounded: each wait is at most IDLE_WAIT_S
        p.wait_idle()
        if p._taken:
            break
    sending, _ = p.get_finished(set())
    assert sending == {"p-1"} and p.stats["blocks_freed_on_notify"] == 1


def test_on_vllm_cpu_the_idle_wait_grows_with_the_idle_stretch_and_resets_on_a_computing_step(workers):
    from kvbridge.vllm.worker import IDLE_WAIT_MAX_S

    p = workers("kv_producer", kv_caches(seed=24))
    hold = granted_meta(reqs_to_send={"p-1": 30.0}, idle=True)
    p.before_forward(hold)
    p.start_load_kv(hold)
    p._cores = {0}  # as on vLLM CPU, where the servers share the compute cores
    p._idle_since = time.monotonic() - 10 * IDLE_WAIT_MAX_S
    t0 = time.monotonic()
    p.wait_idle()  # idle for long: the longest wait
    assert time.monotonic() - t0 >= IDLE_WAIT_MAX_S * 0.9
    p.before_forward(KvbridgeConnectorMetadata(idle=True))
    assert p._idle_since is not None  # still idle
    p.before_forward(KvbridgeConnectorMetadata())  # a step that computes
    assert p._idle_since is None
