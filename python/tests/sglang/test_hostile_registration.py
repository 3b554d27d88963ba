"""Registrations as an attacker writes them: to the bootstrap server (a prefill rank's PUT
/route, and its DP-rank routes) and to a prefill rank's ZMQ socket (a decode rank's
``KVBRIDGE_REG``, from which the prefill plans its head slices). Negative, zero, huge and
contradictory TP, DP, PP and page counts, wrong types, missing fields, ranks outside their
size, oversized and deeply nested bodies, a body that never ends: each is a 4xx naming the
field, or a refusal naming it (``BadMessage``, or the decode rank's requests failed at once
with the reason), never a 500, a dead thread or a stalled server; the honest peers are served
afterwards."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest
import requests
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang_pd import SECRET, free_port, until_done, wait_for
from test_failures import registration

from kvbridge.sglang import messages
from kvbridge.sglang.bootstrap import sign

LOOKUP = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
HUGE = 1 << 40


def url(pd, path):
    return f"http://{pd.bootstrap_addr}{path}"


def still_serving(pd):
    assert requests.get(url(pd, "/health"), timeout=10).status_code == 200
    r = requests.get(url(pd, LOOKUP), timeout=10)
    assert r.status_code == 200 and r.json()["kvbridge_peer"] == pd.prefill.kvbridge_peer_id, r.text


def without(key):
    row = registration(0)
    del row[key]
    return row


BAD_ROWS = {
    # name -> (the registration, what the refusal names)
    "negative TP": (registration(0, attn_tp_size=-1), "'attn_tp_size'"),
    "zero TP": (registration(0, attn_tp_size=0), "'attn_tp_size'"),
    "huge TP": (registration(0, attn_tp_size=HUGE), "'attn_tp_size'"),
    "TP as text": (registration(0, attn_tp_size="1"), "'attn_tp_size'"),
    "TP as bool": (registration(0, attn_tp_size=True), "'attn_tp_size'"),
    "TP as float": (registration(0, attn_tp_size=1.0), "'attn_tp_size'"),
    "rank outside TP": (registration(0, attn_tp_size=2, attn_tp_rank=2), "outside 'attn_tp_size'"),
    "negative rank": (registration(0, attn_tp_rank=-1), "'attn_tp_rank'"),
    "zero PP": (registration(0, pp_size=0), "'pp_size'"),
    "rank outside PP": (registration(0, pp_rank=1), "outside 'pp_size'"),
    "rank outside DP": (registration(0, attn_dp_rank=1), "outside 'attn_dp_size'"),
    "rank outside system DP": (registration(0, system_dp_size=2, system_dp_rank=5), "outside 'system_dp_size'"),
    "huge DP": (registration(0, system_dp_size=HUGE), "'system_dp_size'"),
    "rank outside CP": (registration(0, attn_cp_rank=3), "outside 'attn_cp_size'"),
    "zero page": (registration(0, page_size=0), "'page_size'"),
    "negative page": (registration(0, page_size=-4), "'page_size'"),
    "huge page": (registration(0, page_size=HUGE), "'page_size'"),
    "port zero": (registration(0, rank_port=0), "'rank_port'"),
    "port too big": (registration(0, rank_port=70000), "'rank_port'"),
    "address as number": (registration(0, rank_ip=7), "'rank_ip'"),
    "kvbridge address without port": (registration(0, kvbridge_addr="nowhere"), "'kvbridge_addr'"),
    "empty peer id": (registration(0, kvbridge_peer=""), "'kvbridge_peer'"),
    "dtype as number": (registration(0, kv_cache_dtype=5), "'kv_cache_dtype'"),
    "huge dtype": (registration(0, kv_cache_dtype="x" * 1000), "'kv_cache_dtype'"),
    "HTTP port as text": (registration(0, prefill_http_port="x"), "'prefill_http_port'"),
    "HTTP port zero": (registration(0, prefill_http_port=0), "'prefill_http_port'"),
    "flag as text": (registration(0, enable_kv_cache_sharding="yes"), "'enable_kv_cache_sharding'"),
    "layout as list": (registration(0, dsv41_spec_layout=[1]), "'dsv41_spec_layout'"),
    "policy as number": (registration(0, decode_allocation_policy=7), "'decode_allocation_policy'"),
    "signature as number": (registration(0, kvbridge_sig=1), "'kvbridge_sig'"),
    **{f"no {k}": (without(k), f"'{k}'") for k in registration(0) if k != "load_balance_method"},  # optional
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_malformed_registration_is_a_400_naming_the_field(pd, case):
    row, says = BAD_ROWS[case]
    # unsigned: the fields are checked first, and a row that passed would be refused (401),
    # not registered over the session's prefill rank
    r = requests.put(url(pd, "/route"), data=json.dumps(row), timeout=10)
    assert r.status_code == 400, (r.status_code, r.text)
    assert says in r.text, r.text
    still_serving(pd)


@pytest.fixture(scope="module")
def lone(pd):
    """A bootstrap server of its own with one signed rank (page 4, float16, TP/DP/PP 1), so
    that a signed contradiction that got through would not replace the session's rank."""
    server = type(pd.server)(host="127.0.0.1", port=free_port())
    base = f"http://127.0.0.1:{server.port}"
    row = registration(0)
    row["kvbridge_sig"] = sign(SECRET, row)
    wait_for(lambda: _put(base, row) == 200, 10, "the lone server's first registration")
    try:
        yield base
    finally:
        server.close()


def _put(base, row):
    try:
        return requests.put(f"{base}/route", json=row, timeout=10).status_code
    except requests.ConnectionError:
        return None


@pytest.mark.parametrize(
    "over,says",
    [
        ({"page_size": 8}, "page_size 8 differs from the registered 4"),
        ({"kv_cache_dtype": "bfloat16"}, "kv_cache_dtype 'bfloat16' differs"),
        ({"attn_dp_size": 2}, "dp size 2 differs from the registered 1"),
        ({"attn_tp_size": 2}, "attn_tp_size 2 differs from the registered 1"),
    ],
)
def test_a_signed_registration_that_contradicts_the_topology_is_a_409(lone, over, says):
    row = registration(0, rank_port=6111, **over)
    row["kvbridge_sig"] = sign(SECRET, row)
    r = requests.put(f"{lone}/route", json=row, timeout=10)
    assert r.status_code == 409 and says in r.text, (r.status_code, r.text)
    got = requests.get(f"{lone}{LOOKUP}", timeout=10).json()
    assert got["rank_port"] == 5999, got


@pytest.mark.parametrize(
    "path",
    ["/route", "/register_dp_rank", "/query_dp_ranks"],
)
def test_nested_and_oversized_bodies_are_refused(pd, path):
    method = "PUT" if path == "/route" else "POST"
    nested = requests.request(method, url(pd, path), data=b"[" * 30_000 + b"]" * 30_000, timeout=10)
    assert nested.status_code == 400 and "nested too deep" in nested.text, (nested.status_code, nested.text)
    # no Content-Length: the body comes in chunks, and the server stops reading past its limit
    big = requests.request(method, url(pd, path), data=(b"{" + b" " * 4096 for _ in range(20)), timeout=10)
    assert big.status_code == 413 and "more than" in big.text, (big.status_code, big.text)
    still_serving(pd)


def test_a_body_that_never_ends_stalls_no_one_else(pd):
    host, port = pd.bootstrap_addr.rsplit(":", 1)
    slow = socket.create_connection((host, int(port)), timeout=10)
    try:
        slow.sendall(b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"attn_tp")
        for _ in range(3):
            still_serving(pd)
    finally:
        slow.close()
    still_serving(pd)


def test_a_retried_registration_of_one_rank_counts_once(pd):
    """SGLang counts PUTs: the same rank twice would make the server ready with a rank
    missing. Re-registering the real rank, signed, leaves the count where it was."""
    count = pd.server._registered_count
    row = dict(pd.server.kvbridge_table[(0, 0, 0, 0)]["kvbridge_registration"])
    r = requests.put(url(pd, "/route"), json=row, timeout=10)
    assert r.status_code == 200, r.text
    assert pd.server._registered_count == count
    still_serving(pd)


# ---- a decode rank's registration on the prefill rank's ZMQ socket ----------------------


def _push(pd, frames_list):
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(f"tcp://{pd.prefill.local_ip}:{pd.prefill.rank_port}")
    for frames in frames_list:
        sock.send_multipart(frames)
    sock.close()


def _reg(pd, port: int, **over):
    good = json.loads(pd.decode.build_receiver_registration_message()[1])
    good.update(endpoint="10.255.0.1", port=port, peer_id=f"sglang-hostile-{port}", addr="127.0.0.1:1")
    good.update(over)
    return [messages.REG_TAG, json.dumps(good).encode()]


REFUSED_AS_BAD = {
    # parsed and refused: BadMessage (counted in bad_messages)
    "zero TP": {"tp_size": 0},
    "negative TP": {"tp_size": -2},
    "huge TP": {"tp_size": HUGE},
    "rank outside TP": {"tp_rank": 2, "tp_size": 2},
    "negative rank": {"tp_rank": -1},
    "zero page": {"page_size": 0},
    "negative page": {"page_size": -4},
    "huge page": {"page_size": HUGE},
    "page as text": {"page_size": "4"},
    "page as float": {"page_size": 4.0},
    "TP as bool": {"tp_size": True},
    "item lengths as text": {"kv_item_lens": "abc"},
    "a zero item length": {"kv_item_lens": [0, 1, 1, 1]},
    "regions and lengths of other counts": {"kv_regions": [1]},
    "a negative region": {"aux_regions": [-1, 2]},
    "a list too long for a frame": {"kv_item_lens": [1] * (messages.MAX_LIST + 1)},
    "no peer id": {"peer_id": None},
    "address port too big": {"addr": "127.0.0.1:99999"},
    "nested": None,
}
REFUSED_AT_LAYOUT = {
    # parsed, the decode rank refused at its registration: every request of it fails with this
    "pages of another size": ({"page_size": 8}, "KV pages differ"),
    "another KV dtype": ({"kv_cache_dtype": "bfloat16"}, "KV pages differ"),
    "huge item lengths": ({"kv_item_lens": [1 << 62] * 4}, "KV layout differs"),
    "no KV buffers": ({"kv_item_lens": [], "kv_regions": []}, "KV layout differs"),
    "another TP, pages of other heads": ({"tp_size": 2, "tp_rank": 1, "kv_item_lens": [100] * 4}, "cannot be paired"),
    "huge TP, pages of other heads": ({"tp_size": 1 << 16, "tp_rank": 9, "kv_item_lens": [7] * 4}, "cannot be paired"),
}


def test_hostile_decode_registrations_are_refused_and_the_rank_goes_on(pd, caplog):
    before = pd.prefill.stats["bad_messages"]
    frames = []
    for i, (case, over) in enumerate(REFUSED_AS_BAD.items()):
        if over is None:
            frames.append([messages.REG_TAG, b"[" * 30_000 + b"]" * 30_000])
        else:
            frames.append(_reg(pd, 20_000 + i, **over))
    for i, (over, _) in enumerate(REFUSED_AT_LAYOUT.values()):
        frames.append(_reg(pd, 21_000 + i, **over))
    _push(pd, frames)
    last = ("10.255.0.1", 21_000 + len(REFUSED_AT_LAYOUT) - 1)
    wait_for(lambda: last in pd.prefill.decode_peers, 20, "the last registration handled")
    assert pd.prefill.stats["bad_messages"] == before + len(REFUSED_AS_BAD)
    for i in range(len(REFUSED_AS_BAD)):
        assert ("10.255.0.1", 20_000 + i) not in pd.prefill.decode_peers
    # each refused by name (BadMessage), none by an exception deep in the control thread
    failed = [r for r in caplog.records if "control message failed" in r.getMessage()]
    assert not failed, failed[0].exc_text
    for i, (case, (_, says)) in enumerate(REFUSED_AT_LAYOUT.items()):
        peer = pd.prefill.decode_peers[("10.255.0.1", 21_000 + i)]
        assert peer.error and says in peer.error, (case, peer.error)
    # the honest decode is served as before
    room = pd.room()
    sender, receiver = pd.sender(room), pd.receiver(room)
    receiver.send_metadata(np.array([62], dtype=np.int32), aux_index=12)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 10, "the decode's indices")
    sender.init(1, aux_index=2)
    sender.send(np.array([8], dtype=np.int32))
    assert until_done(receiver) == KVPoll.Success
    assert pd.dpool.page(0, 62) == pd.ppool.page(0, 8)
    sender.clear()
    receiver.clear()


def test_a_registration_naming_an_address_that_never_answers_stalls_no_one(pd):
    """Dialing it takes the handshake's deadline (10 s); the control thread serves the honest
    decode meanwhile (before, every request behind it waited those 10 s)."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)  # accepts, never answers
    try:
        key = ("10.255.0.2", 22_000)
        _push(pd, [_reg(pd, key[1], endpoint=key[0], addr=f"127.0.0.1:{hole.getsockname()[1]}")])
        wait_for(lambda: key in pd.prefill.decode_peers, 10, "the registration taken")
        room = pd.room()
        sender, receiver = pd.sender(room), pd.receiver(room)
        receiver.send_metadata(np.array([63], dtype=np.int32), aux_index=13)
        # within 8 s of the registration: the dial it started holds its dialer for 10 s
        wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 8, "the decode's indices, while the dial waits")
        sender.init(1, aux_index=2)
        sender.send(np.array([9], dtype=np.int32))
        assert until_done(receiver) == KVPoll.Success
        assert pd.dpool.page(0, 63) == pd.ppool.page(0, 9)
        sender.clear()
        receiver.clear()
        # the dial ends at its deadline, with the reason named
        wait_for(lambda: pd.prefill.decode_peers[key].error, 30, "the dial's end")
        assert "step welcome" in pd.prefill.decode_peers[key].error, pd.prefill.decode_peers[key].error
    finally:
        hole.close()
