"""Every request ends, on both sides, with a reason that names the peer and the step: a
prefill killed mid-transfer, a silent prefill, a decode that dies, aborts or never sends
its indices, and a prefill of another TP whose ranks are gone."""

import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang_pd import Pool, failure_text, free_port, kv_args, until_done, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
STARTUP_S = 240  # importing SGLang on the loaded 2-core host


class PrefillProcess:
    """prefill_process.py, in its own process group (killed as a whole)."""

    def __init__(self, port: int):
        self.port = port
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + sys.path))
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "prefill_process.py"), str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.expect("READY", STARTUP_S)

    def expect(self, word: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise AssertionError(f"prefill process: no {word!r} (exit {self.proc.poll()})")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith(word):
                    return line

    def send(self, room: int, pages: int, send: int) -> None:
        self.proc.stdin.write(f"room {room} {pages} {send}\n")
        self.proc.stdin.flush()
        self.expect(f"SENT {room}", 30)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture
def prefill_process():
    procs = []

    def start(port):
        p = PrefillProcess(port)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()


def test_prefill_killed_mid_transfer_fails_the_decode_at_once_and_a_restart_serves(pd, prefill_process):
    port = free_port()
    addr = f"127.0.0.1:{port}"
    prefill = prefill_process(port)
    room = pd.room()
    receiver = pd.receiver(room, bootstrap_addr=addr)
    receiver.send_metadata(np.array([30, 31, 32, 33], dtype=np.int32), aux_index=7)
    prefill.send(room, pages=4, send=2)  # two of four chunks landed
    assert receiver.poll() == KVPoll.WaitingForInput
    t0 = time.monotonic()
    prefill.kill()
    assert until_done(receiver, timeout=10) == KVPoll.Failed
    took = time.monotonic() - t0
    # found by the probe (every 0.2 s here), not the 6 s transfer deadline nor SGLang's 300 s
    assert took < 3.0, took
    text = failure_text(receiver)
    assert "kvbridge: prefill sglang-prefill-" in text and "unreachable (step" in text, text
    assert room not in pd.decode._grants  # no write can land in its pages any more
    receiver.clear()

    # the prefill comes back on the same bootstrap port: the next request is served
    prefill = prefill_process(port)
    room = pd.room()
    receiver = pd.receiver(room, bootstrap_addr=addr)
    receiver.send_metadata(np.array([34, 35], dtype=np.int32), aux_index=8)
    prefill.send(room, pages=2, send=2)
    assert until_done(receiver) == KVPoll.Success
    receiver.clear()


def test_a_silent_prefill_fails_the_decode_at_its_deadline(pd):
    room = pd.room()
    sender = pd.sender(room)
    receiver = pd.receiver(room)
    receiver.send_metadata(np.array([50], dtype=np.int32), aux_index=9)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 10, "the decode's indices")
    t0 = time.monotonic()
    assert until_done(receiver, timeout=15) == KVPoll.Failed
    assert 4.0 < time.monotonic() - t0 < 9.0  # KVBRIDGE_SGLANG_TRANSFER_TIMEOUT_S=6
    text = failure_text(receiver)
    assert "no KV from prefill" in text and pd.prefill.kvbridge_peer_id in text, text
    # the prefill's late writes meet a closed grant: its request fails too, and is freed
    sender.init(1, aux_index=2)
    sender.send(np.array([5], dtype=np.int32))
    assert until_done(sender) == KVPoll.Failed
    text = failure_text(sender)
    assert "AccessDenied" in text and pd.decode.kvbridge_peer_id in text and "step write" in text, text


def test_a_dead_decode_fails_the_prefills_request(pd):
    pool = Pool.make()
    decode = type(pd.decode)(kv_args(pool), DisaggregationMode.DECODE, pd.server_args, False)
    room = pd.room()
    sender = pd.sender(room)
    receiver = pd.receiver(room, mgr=decode)
    receiver.send_metadata(np.array([1, 2], dtype=np.int32), aux_index=1)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 10, "the decode's indices")
    decode.close()  # the decode rank is gone: its listener and memory with it
    sender.init(2, aux_index=3)
    sender.send(np.array([7, 8], dtype=np.int32))
    assert until_done(sender, timeout=15) == KVPoll.Failed
    text = failure_text(sender)
    assert decode.kvbridge_peer_id in text and "(step " in text, text


def test_a_decode_abort_fails_the_prefills_request(pd):
    room = pd.room()
    sender = pd.sender(room)
    receiver = pd.receiver(room)
    receiver.send_metadata(np.array([3], dtype=np.int32), aux_index=4)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 10, "the decode's indices")
    receiver.abort()
    assert receiver.is_abort_release_safe()
    assert until_done(sender, timeout=10) == KVPoll.Failed
    assert "abort" in failure_text(sender).lower()
    receiver.clear()


def test_the_prefill_frees_a_request_whose_decode_never_comes_at_its_lease(pd):
    room = pd.room()
    sender = pd.sender(room)
    t0 = time.monotonic()
    assert until_done(sender, timeout=15) == KVPoll.Failed
    assert 3.0 < time.monotonic() - t0 < 8.0  # KVBRIDGE_SGLANG_LEASE_S=4
    assert "timed out" in failure_text(sender)


def test_a_prefill_of_another_tp_is_taken_and_its_dead_ranks_fail_the_request_at_the_probe(pd):
    """MHA from prefill TP 2 to this decode's TP 1 is a pairing, not a refusal: the decode
    registers with both prefill ranks and waits on both; these ones are not there."""
    import requests

    from kvbridge.sglang.bootstrap import sign
    from kvbridge.sglang.config import settings

    port = free_port()
    server = type(pd.server)(host="127.0.0.1", port=port)
    try:
        for rank in (0, 1):
            row = registration(port, attn_tp_size=2, attn_tp_rank=rank, kvbridge_peer=f"sglang-prefill-test-{rank}")
            row["kvbridge_sig"] = sign(settings().secret, row)
            wait_for(lambda: _put(requests, port, row) == 200, 10, "the registration")
        room = pd.room()
        receiver = pd.receiver(room, bootstrap_addr=f"127.0.0.1:{port}")
        assert receiver.poll() != KVPoll.Failed, failure_text(receiver)
        assert receiver.required_prefill_response_num == 2  # SGLang's count: both prefill ranks
        receiver.send_metadata(np.array([60], dtype=np.int32), aux_index=10)
        assert until_done(receiver, timeout=10) == KVPoll.Failed
        text = failure_text(receiver)
        assert "kvbridge: prefill sglang-prefill-test-" in text and "unreachable (step" in text, text
        receiver.clear()
    finally:
        server.close()


def test_a_decode_refuses_a_prefill_tp_sglang_cannot_pair_once(pd):
    """Decode TP 2 and prefill TP 3: SGLang's rank mapping needs one to divide the other;
    the decode rank refuses before it registers, decided (and counted) once per server."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_size=2, attn_tp_size=2, moe_tp_size=2, tp_rank=1, attn_tp_rank=1):
        decode = type(pd.decode)(kv_args(Pool.make(), rank=1), DisaggregationMode.DECODE, pd.server_args, False)
    try:
        for _ in range(2):
            why = decode.tp_refusal("127.0.0.1:9", 3)
            assert "Incompatible (step layout)" in why and "prefill TP 3 and decode TP 2" in why, why
        assert decode.stats["layouts_refused"] == 1
        assert decode.tp_refusal("127.0.0.1:9", 4) is None and decode.tp_refusal("127.0.0.1:9", 1) is None
    finally:
        decode.close()


def _put(requests, port, row):
    try:
        return requests.put(f"http://127.0.0.1:{port}/route", json=row, timeout=5).status_code
    except requests.ConnectionError:
        return None


def registration(port: int, **over) -> dict:
    row = {
        "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
        "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 5999,
        "page_size": 4, "kv_cache_dtype": "float16", "load_balance_method": "follow_bootstrap_room",
        "kvbridge_addr": "127.0.0.1:5998", "kvbridge_peer": "sglang-prefill-test",
    }  # fmt: skip
    row.update(over)
    return row
