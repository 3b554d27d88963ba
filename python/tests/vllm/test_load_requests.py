"""Loads that start at allocation (load_requests.py): what the inbox accepts from a datagram,
who can reach it, and the worker starting each request's load once whichever of the inbox
and the step comes first, reporting it to vLLM only after the step delivered it."""

from __future__ import annotations

import json
import os
import socket
import stat
import time

import pytest

from kvbridge.vllm import load_requests
from kvbridge.vllm.load_requests import (
    STALE_S,
    MAX_DATAGRAM,
    InboxAddress,
    LoadRequestInbox,
    LoadRequestSender,
    decode,
    encode,
)
from kvbridge.vllm.metadata import KvbridgeConnectorMetadata, RecvJob

from vllm_helpers import LAYERS, kv_caches, poll
from vllm_helpers import GRANT, granted_meta  # noqa: E402


def recv_job(local=(1, 2), remote=(3, 4), allocated=None, port=5600) -> RecvJob:
    return RecvJob(
        grant=GRANT,
        local_block_ids=list(local),
        remote_block_ids=list(remote),
        remote_engine_id="e",
        remote_request_id="p-1",
        remote_host="127.0.0.1",
        remote_port=port,
        allocated=time.monotonic() if allocated is None else allocated,
    )


def test_a_job_survives_the_datagram():
    job = recv_job()
    job.remote_tp_size, job.hit_block_ids, job.prompt_tokens = 2, [7, 8], 90
    assert decode(encode("d-1", job)) == ("d-1", job)


def test_every_field_of_a_load_travels_in_the_datagram():
    """A field the datagram leaves out reaches the inbox's load as its default (a TP=2
    prefiller's load read as TP=1 that way): each is carried, or is one a load that the inbox
    starts never has (those are the step's alone)."""
    import dataclasses

    step_only = {"awaited", "recomputed", "error", "notify"}
    fields = {f.name for f in dataclasses.fields(RecvJob)}
    assert fields - step_only == set(load_requests._FIELDS)


def doc(**job):
    base = json.loads(encode("d-1", recv_job()))
    base["job"].update(job)
    return json.dumps(base).encode()


@pytest.mark.parametrize(
    "data, why",
    [
        (b"", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[" * 100_001 + b"]" * 100_001, "more than"),
        (b"[" * 50_000 + b"]" * 50_000, "not JSON"),
        (b"[]", "not a {req_id, job}"),
        (b'{"req_id": 1, "job": {}}', "not a {req_id, job}"),
        (b'{"req_id": "d", "job": []}', "not a {req_id, job}"),
        (doc(local_block_ids=[1, -2]), "local_block_ids holds"),
        (doc(local_block_ids=[True]), "local_block_ids holds"),
        (doc(remote_block_ids="12"), "remote_block_ids is not a list"),
        (doc(local_block_ids=[]), "reads no blocks"),
        (doc(remote_block_ids=[]), "offers none"),
        (doc(hit_block_ids=[0, "1"]), "hit_block_ids holds"),
        (doc(remote_tp_size=0), "out of range"),
        (doc(remote_tp_size=1 << 17), "out of range"),
        (doc(prompt_tokens=-1), "out of range"),
        (doc(remote_tp_size=None), "remote_tp_size is not a int"),
        (doc(remote_port=0), "not a port"),
        (doc(remote_port=True), "remote_port is not a int"),
        (doc(remote_host=None), "remote_host is not a str"),
        (doc(allocated="now"), "allocated is not a float"),
        (b"x" * (MAX_DATAGRAM + 1), "more than"),
    ],
)
def test_a_malformed_datagram_is_refused_by_name(data, why):
    with pytest.raises(ValueError) as e:
        decode(data)
    assert why in str(e.value)


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch):
    monkeypatch.setattr(load_requests.tempfile, "gettempdir", lambda: str(tmp_path))
    return tmp_path


def test_the_inbox_lives_in_a_directory_only_this_user_enters(tmpdir_env):
    got = []
    inbox = LoadRequestInbox(0, lambda r, j: got.append(r), set())
    try:
        where = os.path.dirname(inbox.path)
        assert stat.S_IMODE(os.stat(where).st_mode) == 0o700 and os.stat(where).st_uid == os.getuid()
    finally:
        inbox.close()
    assert not os.path.exists(inbox.path)
    os.chmod(where, 0o755)  # others can enter: no inbox, loads start from the step
    inbox = LoadRequestInbox(0, lambda r, j: got.append(r), set())
    assert inbox.path == ""
    inbox.close()


def until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.005)


def test_the_sender_reaches_every_rank_and_the_inbox_drops_junk_and_stale_jobs(tmpdir_env):
    got = []
    inboxes = [LoadRequestInbox(r, lambda r_, j: got.append((r_, j)), set()) for r in range(2)]
    try:
        sender = LoadRequestSender()
        sender.set_addresses({r: InboxAddress(i.path) for r, i in enumerate(inboxes)}, 2)
        assert sender.enabled
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        raw.sendto(b"junk", inboxes[0].path)
        sender.send("old", recv_job(allocated=time.monotonic() - 60))
        sender.send("d-1", recv_job())
        until(lambda: len(got) == 2)
        assert [r for r, _ in got] == ["d-1", "d-1"]
        assert inboxes[0].malformed == 1
    finally:
        for i in inboxes:
            i.close()
    sender.send("d-2", recv_job())  # the ranks are gone: counted, nothing raised
    assert sender.unsent == 2


def test_a_rank_without_an_inbox_turns_the_sender_off():
    sender = LoadRequestSender()
    sender.set_addresses({0: InboxAddress("/nonexistent"), 1: InboxAddress("")}, 2)
    assert not sender.enabled
    sender.set_addresses({0: InboxAddress("/nonexistent")}, 2)
    assert not sender.enabled
    sender.send("d-1", recv_job())
    assert sender.sent == 0


# ---- the worker: one load per request, reported after its step ---------------------------


def job_for(prefiller, local, remote, req="p-1"):
    from test_worker_transfer import job

    out = job(prefiller, local, remote, req)
    out.allocated = time.monotonic()
    return out


def send_to(decoder, req_id, job):
    sender = LoadRequestSender()
    sender.set_addresses({0: decoder.handshake_metadata()}, 1)
    assert sender.enabled
    sender.send(req_id, job)


def test_a_load_from_the_inbox_runs_without_the_step_and_is_reported_after_it(workers):
    p_cache, d_cache = kv_caches(seed=11), kv_caches(seed=None)
    p = workers("kv_producer", p_cache)
    d = workers("kv_consumer", d_cache)
    p.start_load_kv(granted_meta(reqs_to_send={"p-1": 30.0}))
    job = job_for(p, [4, 5], [1, 2])
    send_to(d, "d-1", job)
    # the blocks arrive and the prefiller is told, with no decoder step taken
    poll(p, want_sending={"p-1"})
    for name in LAYERS:
        assert torch_equal(d_cache[name][4], p_cache[name][1])
    assert d.get_finished(set()) == (None, None)  # vLLM has not been handed the job yet
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job}))
    _, recving = poll(d, want_recving={"d-1"})
    assert recving == {"d-1"} and d.stats["loads_ok"] == 1 and p.stats["blocks_freed_on_notify"] == 1


def test_the_inbox_and_the_step_start_one_load_whichever_comes_first(workers):
    p = workers("kv_producer", kv_caches(seed=12))
    d = workers("kv_consumer", kv_caches(seed=None))
    p.start_load_kv(granted_meta(reqs_to_send={"p-1": 30.0, "p-2": 30.0}))
    first = job_for(p, [1], [1], "p-1")
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": first}))
    poll(d, want_recving={"d-1"})
    send_to(d, "d-1", first)  # late, after the load ended and was reported: dropped
    second = job_for(p, [2], [2], "p-2")
    send_to(d, "d-2", second)
    until(lambda: "d-2" in d._loads)
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-2": second}))
    poll(d, want_recving={"d-2"})
    until(lambda: d._inbox.received == 2)
    assert d._loads == {} and d.stats["loads_ok"] == 2  # no second load of d-1 started
    poll(p, want_sending={"p-1", "p-2"})
    assert p.stats["blocks_freed_on_notify"] == 2


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_a_load_no_step_ever_delivers_is_dropped_unreported(workers):
    p = workers("kv_producer", kv_caches(seed=13))
    d = workers("kv_consumer", kv_caches(seed=None))
    job = job_for(p, [1], [99])  # a block the prefiller does not have: the load fails
    job.allocated = time.monotonic() - STALE_S / 2
    send_to(d, "stray", job)
    until(lambda: "stray" in d._loads and d._loads["stray"].future.done())
    assert d.get_finished(set()) == (None, None)  # never reported: vLLM does not know it
    d._loads["stray"].started -= 2 * STALE_S  # as if it were that old
    assert d.get_finished(set()) == (None, None) and d._loads == {}
