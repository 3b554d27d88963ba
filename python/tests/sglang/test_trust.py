"""A decode that requires bound prefills (``KVBRIDGE_SGLANG_REQUIRE_BOUND_PREFILL=1``;
docs/sglang.md, *Identities*) believes only a prefill rank whose id its keyring binds, and
only what that rank's own key vouches for: an answer of the bootstrap server changed on its
plain-HTTP path (a man in the middle, here an HTTP proxy in front of the real server), or a
prefill whose id the keyring does not bind, fails the request with
``kvbridge.Unauthenticated`` naming the step, counted, before the decode registers with the
rank or opens a page; and the request's pages open only to the bound id, so a holder of the
shared secret who learnt the grant token lands nothing. Without the setting the decode
believes the answer as it comes (the migration path).

Its own prefill servers and decodes, in this process next to the session's ``pd``."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict

import numpy as np
import pytest
import requests
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang_pd import ITEM, SECRET, Pool, failure_text, free_port, kv_args, until_done, wait_for

import kvbridge
from kvbridge.sglang.config import ConfigError
from kvbridge.sglang.trust import SIGNED_FIELD, sign

TEMPLATE = "sglang-trusted-{role}-r{rank}"
BOUND_ID = "sglang-trusted-prefill-r0"
KEY = "key-of-the-trusted-prefill-0123"
REQUIRE = "KVBRIDGE_SGLANG_REQUIRE_BOUND_PREFILL"


def prefill_server(pd, monkeypatch, template=None, key=None):
    """A prefill server (its bootstrap server and rank 0) in the environment given."""
    from sglang.srt.runtime_context import get_disagg

    port = free_port()
    for name, value in (("KVBRIDGE_PEER_ID", template), ("KVBRIDGE_PEER_KEY", key)):
        if value:
            monkeypatch.setenv(name, value)
    with get_disagg().override(disaggregation_bootstrap_port=port):
        server = type(pd.server)(host="127.0.0.1", port=port)
        pool = Pool.make(fill=11)
        prefill = type(pd.prefill)(kv_args(pool), DisaggregationMode.PREFILL, pd.server_args, False)
    monkeypatch.delenv("KVBRIDGE_PEER_ID", raising=False)
    monkeypatch.delenv("KVBRIDGE_PEER_KEY", raising=False)
    return server, prefill, pool, f"127.0.0.1:{port}"


class Trusting:
    """A bound prefill (own key), an unbound one (shared secret only), and a decode whose
    keyring binds the first and that requires bound prefills."""

    def __init__(self, pd, ring_dir, monkeypatch: pytest.MonkeyPatch):
        self.pd = pd
        self.server, self.prefill, self.ppool, self.bootstrap_addr = prefill_server(pd, monkeypatch, TEMPLATE, KEY)
        self.other_server, self.other, _, self.other_addr = prefill_server(pd, monkeypatch)
        ring = ring_dir / "peer-keys"
        # rank 1 of the same server shares its key (docs/sglang.md: one key per server)
        ring.write_text(f"{BOUND_ID} {KEY}\nsglang-trusted-prefill-r1 {KEY}\n")
        monkeypatch.setenv("KVBRIDGE_PEER_KEYS", str(ring))
        monkeypatch.setenv(REQUIRE, "1")
        self.dpool = Pool.make()
        self.decode = type(pd.decode)(kv_args(self.dpool), DisaggregationMode.DECODE, pd.server_args, False)
        monkeypatch.delenv(REQUIRE)
        monkeypatch.delenv("KVBRIDGE_PEER_KEYS")
        assert self.prefill.kvbridge_peer_id == BOUND_ID

    def receiver(self, room: int, bootstrap_addr: str, mgr: Any = None):
        return self.pd.receiver(room, bootstrap_addr=bootstrap_addr, mgr=mgr or self.decode)

    def close(self) -> None:
        for x in (self.prefill, self.other, self.decode, self.server, self.other_server):
            x.close()


@pytest.fixture(scope="module")
def trusting(pd, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    t = Trusting(pd, tmp_path_factory.mktemp("trust"), mp)
    mp.undo()
    try:
        yield t
    finally:
        t.close()


class Mitm:
    """An HTTP proxy in front of a bootstrap server that rewrites its answers to a rank's
    lookup with ``alter`` (a man in the middle of SGLang's plain-HTTP bootstrap path)."""

    def __init__(self, upstream: str, alter: Callable[[Dict[str, Any]], Dict[str, Any]]):
        mitm = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                r = requests.get(f"http://{upstream}{self.path}", timeout=10)
                body = r.content
                if r.status_code == 200 and "target_tp_rank=-1" not in self.path and self.path.startswith("/route"):
                    body = json.dumps(alter(r.json())).encode()
                    mitm.altered += 1
                self.send_response(r.status_code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.altered = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.addr = f"127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Listener:
    """A ZMQ socket where an attacker would take the decode's registration and grant token."""

    def __init__(self):
        self.sock = zmq.Context.instance().socket(zmq.PULL)
        self.port = self.sock.bind_to_random_port("tcp://*")  # where rank_ip points, whatever it is

    def heard(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms))

    def close(self) -> None:
        self.sock.close(linger=0)


def _registration_of(info: Dict[str, Any]) -> Dict[str, Any]:
    return dict(info[SIGNED_FIELD])


def _resigned(key: str, **over: Any) -> Callable[[Dict[str, Any]], Dict[str, Any]]:
    """A lookup whose registration says ``over``, signed with ``key``, the answer matching it."""

    def alter(info):
        reg = dict(_registration_of(info), **over)
        reg["kvbridge_sig"] = sign(key, reg)
        return dict(info, **{k: reg[k] for k in ("kvbridge_peer", "kvbridge_addr", "rank_ip", "rank_port")}, **{SIGNED_FIELD: reg})

    return alter


def _transfer(t: Trusting, receiver, sender, page: int, src: int) -> None:
    receiver.send_metadata(np.array([page], dtype=np.int32), aux_index=4)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 10, "the decode's indices")
    sender.init(1, aux_index=1)
    sender.send(np.array([src], dtype=np.int32))
    assert until_done(receiver) == KVPoll.Success and until_done(sender) == KVPoll.Success
    assert t.dpool.page(0, page) == t.ppool.page(0, src)
    sender.clear()
    receiver.clear()


def test_the_bound_prefill_transfers_through_an_honest_proxy(trusting):
    t = trusting
    mitm = Mitm(t.bootstrap_addr, lambda info: info)
    try:
        room = t.pd.room()
        sender = t.pd.cls[t.pd.types.SENDER](t.prefill, t.bootstrap_addr, room)
        receiver = t.receiver(room, mitm.addr)
        assert receiver.poll() == KVPoll.WaitingForInput and mitm.altered >= 1
        _transfer(t, receiver, sender, page=3, src=5)
        assert t.decode.stats["unbound_prefills"] == 0 and t.decode.stats["unvouched_lookups"] == 0
    finally:
        mitm.close()


def test_a_prefill_whose_id_the_keyring_does_not_bind_is_refused_before_anything(trusting):
    t = trusting
    before = dict(t.decode.stats)
    room = t.pd.room()
    receiver = t.receiver(room, t.other_addr)
    assert until_done(receiver) == KVPoll.Failed
    text = failure_text(receiver)
    assert "Unauthenticated (step keyring)" in text and t.other.kvbridge_peer_id in text, text
    assert "KVBRIDGE_PEER_KEYS" in text and REQUIRE in text, text
    assert t.decode.stats["unbound_prefills"] == before.get("unbound_prefills", 0) + 1
    # before the decode registered with the rank or opened a page
    assert t.decode.stats["grants_opened"] == before.get("grants_opened", 0)
    receiver.send_metadata(np.array([8], dtype=np.int32), aux_index=2)
    assert t.decode.stats["grants_opened"] == before.get("grants_opened", 0) and room not in t.decode._grants
    assert not t.other.decode_peers, "the decode registered with an unbound prefill"
    receiver.clear()


MITM_CASES = {
    # what the man in the middle changes -> the step and the words that name the refusal
    "an unbound id": (lambda info: dict(info, kvbridge_peer="sglang-impostor-r0"), "keyring", "sglang-impostor-r0"),
    "the ZMQ port": (lambda info: dict(info, rank_port=LISTENER.port), "bootstrap", "rank_port"),
    "the kvbridge address": (lambda info: dict(info, kvbridge_addr="127.0.0.1:1"), "bootstrap", "kvbridge_addr"),
    "no signed registration": (
        lambda info: {k: v for k, v in info.items() if k != SIGNED_FIELD}, "bootstrap", "no signed registration"
    ),
    "re-signed with the shared secret": (_resigned(SECRET, rank_port=0), "bootstrap", "not signed with the key"),
    "another rank's registration": (
        _resigned(KEY, attn_dp_size=2, attn_dp_rank=1), "bootstrap", "not the one asked for"
    ),  # rank 1's genuine registration (same key), a replay for rank 0's lookup
    "another topology": (_resigned(KEY, page_size=8), "bootstrap", "announced page_size"),
}
LISTENER: Any = None


@pytest.fixture
def listener():
    global LISTENER
    LISTENER = Listener()
    try:
        yield LISTENER
    finally:
        LISTENER.close()


@pytest.mark.parametrize("case", list(MITM_CASES))
def test_a_changed_bootstrap_answer_is_refused_naming_the_step(trusting, listener, case):
    alter, step, says = MITM_CASES[case]
    t = trusting
    if case == "re-signed with the shared secret":  # the attacker's own ZMQ port, signed
        alter = _resigned(SECRET, rank_port=listener.port)
    counter = "unbound_prefills" if step == "keyring" else "unvouched_lookups"
    before = dict(t.decode.stats)
    registered = len(t.prefill.decode_peers)
    mitm = Mitm(t.bootstrap_addr, alter)
    try:
        room = t.pd.room()
        receiver = t.receiver(room, mitm.addr)
        assert until_done(receiver) == KVPoll.Failed and mitm.altered >= 1
        text = failure_text(receiver)
        assert f"Unauthenticated (step {step})" in text and says in text, text
        assert t.decode.stats[counter] == before.get(counter, 0) + 1
        receiver.send_metadata(np.array([9], dtype=np.int32), aux_index=3)
        assert t.decode.stats["grants_opened"] == before.get("grants_opened", 0)
        # nothing went where the answer pointed: no registration, no grant token
        assert not listener.heard(300), "the decode sent to the address the proxy gave"
        assert len(t.prefill.decode_peers) == registered
        receiver.clear()
    finally:
        mitm.close()


def test_a_token_opens_nothing_to_an_unbound_peer_under_the_requirement(trusting):
    t = trusting
    room = t.pd.room()
    sender = t.pd.cls[t.pd.types.SENDER](t.prefill, t.bootstrap_addr, room)
    receiver = t.receiver(room, t.bootstrap_addr)
    receiver.send_metadata(np.array([12], dtype=np.int32), aux_index=6)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 10, "the decode's indices")
    # a holder of the shared secret that read the token on SGLang's clear-text ZMQ path
    token = t.prefill.transfer_infos[room][t.decode.kvbridge_peer_id].token
    spy = kvbridge.Channel("sglang-eavesdropper", secret=SECRET, use_env=False)
    try:
        src = spy.register_buffer(np.full(ITEM, 0xEE, dtype=np.uint8), ITEM, peers=[])
        peer = spy.connect(t.decode.kvbridge_addr)
        with pytest.raises(kvbridge.Rejected) as e:
            spy.write(peer, [(src, 0, t.decode.kv_regions[0], 12 * ITEM, ITEM)], token=token)
        assert e.value.code == "AccessDenied", e.value
    finally:
        spy.close()
    assert t.dpool.page(0, 12) == bytes(ITEM)
    # the bound prefill's writes land as ever
    sender.init(1, aux_index=2)
    sender.send(np.array([7], dtype=np.int32))
    assert until_done(receiver) == KVPoll.Success
    assert t.dpool.page(0, 12) == t.ppool.page(0, 7)
    sender.clear()
    receiver.clear()
    assert room not in t.decode._grant_windows  # closed with the request


def test_without_the_setting_the_decode_believes_the_answer(pd, trusting, listener):
    """The migration path, and the gap the setting closes: the session's decode (no
    requirement) registers where a changed answer points."""
    mitm = Mitm(trusting.bootstrap_addr, lambda info: dict(info, rank_port=listener.port))
    try:
        receiver = pd.receiver(pd.room(), bootstrap_addr=mitm.addr)
        assert listener.heard(10_000), "the decode did not follow the changed answer"
        receiver.abort()
        receiver.clear()
    finally:
        mitm.close()


@pytest.mark.parametrize("value,says", [(None, "needs KVBRIDGE_PEER_KEYS"), ("yes please", "must be 1 or 0")])
def test_a_requirement_that_cannot_be_met_fails_the_decode_at_startup(pd, monkeypatch, value, says):
    monkeypatch.delenv("KVBRIDGE_PEER_KEYS", raising=False)
    monkeypatch.setenv(REQUIRE, value or "1")
    with pytest.raises(ConfigError, match=says):
        type(pd.decode)(kv_args(Pool.make()), DisaggregationMode.DECODE, pd.server_args, False)
