"""A decode's keyring binds a prefill rank's kvbridge id (docs/sglang.md, *Identities*): the
prefill rank has a stable id (``KVBRIDGE_PEER_ID``) and its own key (``KVBRIDGE_PEER_KEY``)
beside the shared secret; the decode's keyring (``KVBRIDGE_PEER_KEYS``) lists that id with
that key. The real prefill's KV lands and its status counts; the decode's probe still
reaches the prefill's listener (shared secret); the prefill's bootstrap registration is
signed with its key. An impostor holding the shared secret who claims the prefill's id is
refused at the handshake (counted in the decode's ``auth_failed``) and lands nothing, and
cannot re-register the prefill's rank at its bootstrap server.

Its own prefill, decode and bootstrap server, in this process next to the session's ``pd``
(whose runtime context they share; the prefill registers with its own bootstrap server)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import requests
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang_pd import ITEM, LAYERS, SECRET, Pool, free_port, kv_args, until_done, wait_for
from test_failures import registration

import kvbridge
from kvbridge.sglang import messages
from kvbridge.sglang.bootstrap import sign

TEMPLATE = "sglang-bound-{role}-r{rank}"
BOUND_ID = "sglang-bound-prefill-r0"  # TEMPLATE for SGLang's prefill role, rank 0
KEY = "key-of-the-bound-prefill-0123"


class Bound:
    """The bound prefill (with its bootstrap server) and the decode whose keyring binds it."""

    def __init__(self, pd, ring_dir, monkeypatch: pytest.MonkeyPatch):
        from sglang.srt.runtime_context import get_disagg

        self.pd = pd
        port = free_port()
        self.bootstrap_addr = f"127.0.0.1:{port}"
        self.ppool, self.dpool = Pool.make(fill=7), Pool.make()
        # the prefill server's environment: its ranks and its bootstrap server share it
        monkeypatch.setenv("KVBRIDGE_PEER_ID", TEMPLATE)
        monkeypatch.setenv("KVBRIDGE_PEER_KEY", KEY)
        with get_disagg().override(disaggregation_bootstrap_port=port):
            self.server = type(pd.server)(host="127.0.0.1", port=port)
            self.prefill = type(pd.prefill)(kv_args(self.ppool), DisaggregationMode.PREFILL, pd.server_args, False)
        monkeypatch.delenv("KVBRIDGE_PEER_ID")
        monkeypatch.delenv("KVBRIDGE_PEER_KEY")
        # the decode server's: the shared secret and a keyring naming the prefill's id
        ring = ring_dir / "peer-keys"
        ring.write_text(f"# prefill server 'bound', rank 0\n{BOUND_ID} {KEY}\n")
        monkeypatch.setenv("KVBRIDGE_PEER_KEYS", str(ring))
        self.decode = type(pd.decode)(kv_args(self.dpool), DisaggregationMode.DECODE, pd.server_args, False)
        monkeypatch.delenv("KVBRIDGE_PEER_KEYS")
        assert self.prefill.kvbridge_peer_id == BOUND_ID

    def pair(self, room: int):
        sender = self.pd.cls[self.pd.types.SENDER](self.prefill, self.bootstrap_addr, room)
        receiver = self.pd.receiver(room, bootstrap_addr=self.bootstrap_addr, mgr=self.decode)
        return sender, receiver

    def auth_failed(self) -> int:
        return self.decode.channel.stats()["auth_failed"]

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        self.server.close()


@pytest.fixture(scope="module")
def bound(pd, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    b = Bound(pd, tmp_path_factory.mktemp("bound"), mp)
    mp.undo()
    try:
        yield b
    finally:
        b.close()


def test_the_bound_prefill_transfers_and_the_decodes_probe_reaches_it(bound):
    room = bound.pd.room()
    sender, receiver = bound.pair(room)
    receiver.send_metadata(np.array([20, 21], dtype=np.int32), aux_index=5)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 10, "the decode's indices")
    # while the room waits, the decode probes the prefill's listener with the shared secret
    probes = bound.decode.stats["probes"]
    wait_for(lambda: bound.decode.stats["probes"] >= probes + 2, 10, "two probes of the bound prefill")
    assert bound.decode.stats["probe_failures"] == 0 and receiver.poll() == KVPoll.WaitingForInput
    failed = bound.auth_failed()
    sender.init(2, aux_index=3)
    sender.send(np.array([4, 9], dtype=np.int32))
    assert until_done(receiver) == KVPoll.Success and until_done(sender) == KVPoll.Success
    for buf in range(2 * LAYERS):
        assert bound.dpool.page(buf, 20) == bound.ppool.page(buf, 4)
        assert bound.dpool.page(buf, 21) == bound.ppool.page(buf, 9)
        assert bound.dpool.page(buf, 22) == bytes(ITEM)
    for buf in range(2):
        assert bound.dpool.aux_slot(buf, 5) == bound.ppool.aux_slot(buf, 3)
    assert bound.decode.stats["kv_received"] >= 1 and bound.auth_failed() == failed
    sender.clear()
    receiver.clear()


@pytest.mark.parametrize("own_key", [None, "not-the-bound-prefills-key"])
def test_an_impostor_with_the_shared_secret_cannot_be_the_bound_prefill(bound, own_key):
    room, page = bound.pd.room(), 30 if own_key is None else 31  # a page no test wrote
    sender, receiver = bound.pair(room)
    receiver.send_metadata(np.array([page], dtype=np.int32), aux_index=6)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 10, "the decode's indices")
    before = bound.auth_failed()
    # it learnt the prefill's id (the bootstrap server hands it to anyone) and holds the secret
    imp = kvbridge.Channel(BOUND_ID, secret=SECRET, peer_key=own_key, use_env=False)
    try:
        with pytest.raises(kvbridge.Unauthenticated) as e:
            imp.connect(bound.decode.kvbridge_addr)
        assert e.value.step, e.value
        with pytest.raises(kvbridge.KvbridgeError):  # no session: nothing to send on
            imp.notify(bound.decode.kvbridge_peer_id, messages.status_note(room, KVPoll.Success, 0, None))
    finally:
        imp.close()
    wait_for(lambda: bound.auth_failed() == before + 1, 10, "the refusal counted")
    # no byte landed, no status counted: the room still waits for the real prefill, which
    # then delivers over its own session
    assert bound.dpool.page(0, page) == bytes(ITEM)
    assert receiver.poll() == KVPoll.WaitingForInput
    sender.init(1, aux_index=2)
    sender.send(np.array([11], dtype=np.int32))
    assert until_done(receiver) == KVPoll.Success
    assert bound.dpool.page(0, page) == bound.ppool.page(0, 11)
    assert bound.auth_failed() == before + 1
    sender.clear()
    receiver.clear()


def test_the_bound_prefills_bootstrap_takes_only_its_own_key(bound):
    url = f"http://{bound.bootstrap_addr}/route"
    lookup = url + "?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
    # a holder of the shared secret re-registers the rank at its own address and id
    row = registration(0, kvbridge_addr="127.0.0.1:5998", kvbridge_peer="sglang-impostor-r0")
    row["kvbridge_sig"] = sign(SECRET, row)
    r = requests.put(url, data=json.dumps(row), timeout=10)
    assert r.status_code == 401 and "KVBRIDGE_PEER_KEY" in r.text, (r.status_code, r.text)
    got = requests.get(lookup, timeout=10).json()
    assert got["kvbridge_peer"] == BOUND_ID and got["kvbridge_addr"] == bound.prefill.kvbridge_addr, got


def test_an_own_key_that_binds_nothing_fails_the_rank_at_startup_naming_it(pd, monkeypatch):
    monkeypatch.delenv("KVBRIDGE_PEER_ID", raising=False)
    monkeypatch.setenv("KVBRIDGE_PEER_KEY", KEY)
    with pytest.raises(ValueError, match="KVBRIDGE_PEER_KEY is set but KVBRIDGE_PEER_ID is not"):
        type(pd.decode)(kv_args(Pool.make()), DisaggregationMode.DECODE, pd.server_args, False)
    monkeypatch.setenv("KVBRIDGE_PEER_ID", TEMPLATE)
    monkeypatch.setenv("KVBRIDGE_PEER_KEY", SECRET)  # the shared secret binds nothing
    with pytest.raises(kvbridge.LocalError, match="KVBRIDGE_PEER_KEY"):
        type(pd.decode)(kv_args(Pool.make()), DisaggregationMode.DECODE, pd.server_args, False)
