"""Bad input gets a clear refusal, never a crash, and the backend keeps serving: malformed
and unsigned bootstrap requests, malformed control messages on the prefill's ZMQ socket,
forged status notifications, and peers without the secret."""

import json

import numpy as np
import pytest
import requests
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang_pd import SECRET, until_done, wait_for
from test_failures import registration

import kvbridge
from kvbridge.sglang import messages
from kvbridge.sglang.bootstrap import sign


def url(pd, path):
    return f"http://{pd.bootstrap_addr}{path}"


@pytest.mark.parametrize(
    "method,path,body,status,says",
    [
        ("PUT", "/route", b"not json", 400, "bad registration"),
        ("PUT", "/route", b"[]", 400, "JSON object"),
        ("PUT", "/route", json.dumps({"attn_tp_size": 1}).encode(), 400, "attn_tp_rank"),
        ("PUT", "/route", json.dumps(registration(0, attn_tp_rank=3)).encode(), 400, "outside"),
        ("PUT", "/route", json.dumps(registration(0, rank_port="x")).encode(), 400, "rank_port"),
        ("PUT", "/route", json.dumps(registration(0)).encode(), 401, "not signed"),
        ("PUT", "/route", b"{" + b" " * (70 << 10) + b"}", 413, "more than"),
        ("GET", "/route?prefill_dp_rank=x&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0", b"", 400, "prefill_dp_rank"),
        ("GET", "/route?prefill_dp_rank=0", b"", 400, "prefill_cp_rank"),
        ("POST", "/register_dp_rank", b"[1]", 400, "JSON object"),
        ("POST", "/register_dp_rank", json.dumps({"bootstrap_room": -1, "dp_rank": 0}).encode(), 400, "bootstrap_room"),
        ("POST", "/query_dp_ranks", json.dumps({"bootstrap_rooms": ["a"]}).encode(), 400, "not an integer"),
        ("POST", "/query_dp_ranks", b"\xff\xfe", 400, "bad dp rank query"),
    ],
)
def test_bootstrap_refuses_bad_requests_by_name(pd, method, path, body, status, says):
    r = requests.request(method, url(pd, path), data=body, timeout=10)
    assert r.status_code == status, (r.status_code, r.text)
    assert says in r.text, r.text
    # still serving: health, and the real rank's lookup with its kvbridge channel
    assert requests.get(url(pd, "/health"), timeout=10).status_code == 200
    r = requests.get(url(pd, "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"), timeout=10)
    assert r.status_code == 200 and r.json()["kvbridge_peer"] == pd.prefill.kvbridge_peer_id


def test_bootstrap_refuses_a_signed_registration_that_changes_the_topology(pd):
    row = registration(0, attn_tp_size=2, attn_tp_rank=1)
    row["kvbridge_sig"] = sign(SECRET, row)
    r = requests.put(url(pd, "/route"), json=row, timeout=10)
    assert r.status_code == 409 and "attn_tp_size 2" in r.text, r.text
    # a forged signature over a harmless change is refused too
    row = registration(0, rank_ip="10.9.9.9")
    row["kvbridge_sig"] = sign(SECRET + "x", row)
    assert requests.put(url(pd, "/route"), json=row, timeout=10).status_code == 401
    r = requests.get(url(pd, "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"), timeout=10)
    assert r.json()["rank_ip"] != "10.9.9.9"


def _push(pd, frames_list):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(f"tcp://{pd.prefill.local_ip}:{pd.prefill.rank_port}")
    for frames in frames_list:
        sock.send_multipart(frames)
    sock.close()


def test_malformed_control_messages_are_refused_and_the_rank_goes_on(pd):
    good_reg = json.loads(pd.decode.build_receiver_registration_message()[1])
    hostile = [
        [b"garbage"],
        [messages.REG_TAG],
        [messages.REG_TAG, b"{not json"],
        [messages.REG_TAG, json.dumps(dict(good_reg, tp_rank=5, tp_size=1)).encode()],
        [messages.REG_TAG, json.dumps(dict(good_reg, kv_regions=[1])).encode()],
        [messages.REG_TAG, json.dumps(dict(good_reg, addr="nowhere")).encode()],
        [messages.XFER_TAG, b"{}", b""],
        [messages.XFER_TAG, json.dumps({"room": 1}).encode(), b"abc"],
        [messages.XFER_TAG, json.dumps({"room": 1}).encode(), (-1).to_bytes(4, "little", signed=True)],
        [
            messages.XFER_TAG,
            json.dumps({"room": 7, "endpoint": "10.0.0.1", "port": 1, "peer_id": "x", "aux_index": 0,
                        "required_dst_info_num": 1, "decode_prefix_len": 0, "is_dummy": False,
                        "token": "00" * 16}).encode(),
            b"",
        ],  # from a decode that never registered
        [b"ABORT"],
    ]  # fmt: skip
    before = pd.prefill.stats["bad_messages"]
    _push(pd, hostile)
    wait_for(lambda: pd.prefill.stats["bad_messages"] >= before + len(hostile), 10, "every message refused")
    assert pd.prefill.stats["bad_messages"] == before + len(hostile)
    # a real request still goes through
    room = pd.room()
    sender, receiver = pd.sender(room), pd.receiver(room)
    receiver.send_metadata(np.array([60], dtype=np.int32), aux_index=10)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 10, "the decode's indices")
    sender.init(1, aux_index=2)
    sender.send(np.array([6], dtype=np.int32))
    assert until_done(receiver) == KVPoll.Success
    assert pd.dpool.page(0, 60) == pd.ppool.page(0, 6)
    sender.clear()
    receiver.clear()


def test_a_forged_status_is_ignored(pd):
    room = pd.room()
    receiver = pd.receiver(room)
    receiver.send_metadata(np.array([61], dtype=np.int32), aux_index=11)
    before = pd.decode.stats["bad_notices"]
    rogue = kvbridge.Channel("sglang-prefill-rogue", secret=SECRET)  # holds the secret, not the room
    try:
        peer = rogue.connect(pd.decode.kvbridge_addr)
        rogue.notify(peer, messages.status_note(room, KVPoll.Success, 0, None))
        rogue.notify(peer, b"\x00not json")
        rogue.notify(peer, json.dumps({"t": "status", "room": room, "status": 99, "rank": 0}).encode())
    finally:
        rogue.close()
    wait_for(lambda: pd.decode.stats["bad_notices"] >= before + 3, 10, "the notices refused")
    assert receiver.poll() == KVPoll.WaitingForInput
    receiver.abort()
    receiver.clear()


def test_a_peer_without_the_secret_reaches_nothing(pd):
    for secret in (None, "another-secret-of-16-bytes"):
        outsider = kvbridge.Channel("outsider", secret=secret, use_env=False)
        try:
            with pytest.raises((kvbridge.Unauthenticated, kvbridge.Rejected)):
                outsider.connect(pd.decode.kvbridge_addr)
            with pytest.raises((kvbridge.Unauthenticated, kvbridge.Rejected)):
                outsider.connect(pd.prefill.kvbridge_addr)
        finally:
            outsider.close()
