"""Identities a keyring binds (issue 41 §1): an LMCache sender with a stable kvbridge peer id
(``KVBRIDGE_PEER_ID``) that the receiver's keyring (``KVBRIDGE_PEER_KEYS``) holds with its
key; the write windows the receiver opens to that id are then the sender's alone.

The receiver is a real LMCache PD receiver process (``PDBackendAsync``, write windows on,
``KVBRIDGE_TRANSPORT=tcp``); the sender is a ``KvbridgeChannel`` in this process whose pages
are allocated over LMCache's own alloc socket (an ``AllocRequest`` naming it, as a hooked
sender's does). The impostors are plain ``kvbridge.Channel``s claiming the sender's id: one
holds the shared secret, one another id's key. Without the keyring (the parametrised
baseline) the first one takes the sender's session over and its write lands in the
sender's pages: the gap this closes. The sender holds its key as ``KVBRIDGE_PEER_KEY``
beside the shared secret, or (the older way, still binding) as its ``KVBRIDGE_SECRET``.
"""

from __future__ import annotations

import math
import time

import pytest

from test_channel import Arena, _objs, make  # noqa: F401 - make is a fixture
from test_pd_processes import KV_SMALL, _receiver, free_ports, procs  # noqa: F401 - procs too
from test_write_windows import _alloc_socket, _ask, _page_digest

SHARED = "the-deployments-shared-secret-0"
SENDER_KEY = "key-of-prefill-a-only-0123456789"
OTHER_KEY = "key-of-prefill-b-only-0123456789"
TEMPLATE = "prefill-a-{role}-tp{tp_rank}"
SENDER_ID = "prefill-a-sender-tp0"  # TEMPLATE for LMCache's sender role, rank 0


@pytest.fixture(autouse=True)
def tcp(monkeypatch):
    monkeypatch.setenv("KVBRIDGE_TRANSPORT", "tcp")


def _sessions(r) -> dict:
    r.send(op="sessions")
    return r.expect("sessions", timeout=10)


def _refused(r, before: dict) -> dict:
    """The receiver's view once it has counted one more refused handshake (the impostor's
    dial fails on its side first; the receiver ends that handshake a moment later)."""
    deadline = time.monotonic() + 10
    while True:
        now = _sessions(r)
        if now["auth_failed"] > before["auth_failed"] or time.monotonic() > deadline:
            return now
        time.sleep(0.02)


class _Setup:
    def __init__(self, tmp_path, procs, make, monkeypatch, keyring: bool, own_key: str = "peer_key"):  # noqa: F811
        import importlib
        import typing

        import torch

        import kvbridge.lmcache
        from lmcache.utils import CacheEngineKey

        self.make, self.monkeypatch, self.keyring, self.own_key = make, monkeypatch, keyring, own_key
        env = {"KVBRIDGE_TRANSPORT": "tcp", "KVBRIDGE_LMCACHE_WRITE_WINDOWS": "1", "KVBRIDGE_SECRET": SHARED}
        if keyring:
            ring = tmp_path / "peer-keys"
            ring.write_text(f"# id key\n{SENDER_ID} {SENDER_KEY}\nprefill-b-sender-tp0 {OTHER_KEY}\n")
            env["KVBRIDGE_PEER_KEYS"] = str(ring)
        self.init_port, alloc_port = free_ports(2)
        self.receiver = _receiver(tmp_path, 0, 1, [self.init_port], [alloc_port], env, mode="async")
        procs.append(self.receiver)
        self.receiver.expect("ready", timeout=120)
        self.shape = [int(x) for x in KV_SMALL.split(",")]
        self.page = math.prod(self.shape) * 2
        self.sender = self.real_sender(seed=81)
        kvbridge.lmcache.install()
        mod = importlib.import_module("lmcache.v1.storage_backend.pd_backend_async")
        ext = next(t for t in typing.get_args(mod.PDMsg) if t.__name__ == "AllocRequest")
        keys = [
            CacheEngineKey(model_name="kvbridge-test", world_size=1, worker_id=0, chunk_hash=h,
                           dtype=torch.bfloat16).to_string()
            for h in (5101, 5102)
        ]  # fmt: skip
        fields = dict(keys=keys, fmt=1, shape=self.shape, dtype="bfloat16", last_chunk_toks=self.shape[2])
        sock = _alloc_socket(alloc_port)
        try:
            more = dict(req_id="req-k", is_last_batch=False, total_chunks=3)
            got = _ask(sock, mod, ext(**fields, **more, kvbridge_writer=self.sender.writer_id))
        finally:
            sock.close()
        self.pages = list(got.remote_indexes)
        assert len(self.pages) == 2 and min(self.pages) >= 0, got

    def real_sender(self, seed: int):
        """The sender as its operator runs it: with the keyring, its stable id from the
        template and its own key, as ``KVBRIDGE_PEER_KEY`` beside the shared secret (or as
        its secret, ``own_key="secret"``); without, a random id, as by default."""
        older = self.keyring and self.own_key == "secret"
        self.monkeypatch.setenv("KVBRIDGE_SECRET", SENDER_KEY if older else SHARED)
        if self.keyring and not older:
            self.monkeypatch.setenv("KVBRIDGE_PEER_KEY", SENDER_KEY)
        else:
            self.monkeypatch.delenv("KVBRIDGE_PEER_KEY", raising=False)
        if self.keyring:
            self.monkeypatch.setenv("KVBRIDGE_PEER_ID", TEMPLATE)
        else:
            self.monkeypatch.delenv("KVBRIDGE_PEER_ID", raising=False)
        s = self.make("sender", arena=Arena(pages=2, page=self.page))
        assert (s.writer_id == SENDER_ID) == self.keyring, s.writer_id
        s.lazy_init_peer_connection("", "R", f"127.0.0.1:{self.init_port}")
        s.arena.fill(0, seed=seed)
        return s

    def write(self, s, page: int) -> None:
        s.batched_write(_objs([0]), {"receiver_id": "R", "remote_indexes": [page]})

    def landed(self, s, page: int) -> bool:
        import kvbridge

        return _page_digest(self.receiver, page) == kvbridge.digest(s.arena.page_bytes(0))


def _impostor(monkeypatch, claimed: str, secret: str, page: int):
    """A peer that claims ``claimed`` with ``secret``: a plain channel and an arena of one
    page, filled with what it would plant."""
    import kvbridge

    monkeypatch.setenv("KVBRIDGE_SECRET", secret)
    monkeypatch.delenv("KVBRIDGE_PEER_KEY", raising=False)  # the sender's, not the impostor's
    ch = kvbridge.Channel(claimed)
    arena = Arena(pages=1, page=page)
    arena.fill(0, seed=99)
    region = ch.register(arena.t.data_ptr(), arena.t.numel(), page)
    return ch, region, arena


@pytest.mark.parametrize("keyring,own_key", [(True, "peer_key"), (True, "secret"), (False, None)])
def test_a_holder_of_the_shared_secret_cannot_claim_a_keyed_senders_id(tmp_path, procs, make, monkeypatch, keyring, own_key):  # noqa: F811
    import kvbridge

    t = _Setup(tmp_path, procs, make, monkeypatch, keyring, own_key)
    t.write(t.sender, t.pages[0])
    assert t.landed(t.sender, t.pages[0])
    before = _sessions(t.receiver)
    assert before["sessions"] == 1 and before["writers"] == [t.sender.writer_id], before

    # It learnt the sender's id (in clear in LMCache's AllocRequest) and holds the secret.
    ch, region, arena = _impostor(monkeypatch, t.sender.writer_id, SHARED, t.page)
    try:
        if not keyring:  # today's default: it replaces the sender's session and writes
            peer = ch.connect(f"127.0.0.1:{t.init_port}")
            rid = next(r.id for r in ch.peer_regions(peer) if r.page_size == t.page)
            ch.write_pages(peer, region, [0], rid, [t.pages[1]])
            assert _page_digest(t.receiver, t.pages[1]) == kvbridge.digest(arena.page_bytes(0))
            return
        with pytest.raises(kvbridge.Unauthenticated) as e:
            ch.connect(f"127.0.0.1:{t.init_port}")
        assert e.value.step, e.value
    finally:
        ch.close()
    after = _refused(t.receiver, before)
    assert after["auth_failed"] == before["auth_failed"] + 1, after
    assert after["sessions"] == 1 and after["writers"] == [SENDER_ID] and after["open"] == 2, after
    # the sender's session and windows are still its own: its next write lands
    t.sender.arena.fill(0, seed=82)
    t.write(t.sender, t.pages[1])
    assert t.landed(t.sender, t.pages[1])
    assert t.sender.write_refusals == 0


def test_a_peer_holding_another_ids_key_cannot_claim_the_senders_id(tmp_path, procs, make, monkeypatch):  # noqa: F811
    import kvbridge

    t = _Setup(tmp_path, procs, make, monkeypatch, keyring=True)
    before = _sessions(t.receiver)
    # prefill-b's key proves prefill-b, nothing else
    ch, _, _ = _impostor(monkeypatch, SENDER_ID, OTHER_KEY, t.page)
    try:
        with pytest.raises(kvbridge.Unauthenticated):
            ch.connect(f"127.0.0.1:{t.init_port}")
    finally:
        ch.close()
    after = _refused(t.receiver, before)
    assert after["auth_failed"] == before["auth_failed"] + 1, after
    assert after["sessions"] == 1 and after["writers"] == [SENDER_ID], after
    t.write(t.sender, t.pages[0])
    assert t.landed(t.sender, t.pages[0])


def test_the_sender_restarted_with_its_key_takes_its_id_back(tmp_path, procs, make, monkeypatch):  # noqa: F811
    """The legitimate restart: a new process (here a new channel) with the same id proves
    the same key, its session replaces the old one, and it writes the pages allocated to
    its id."""
    t = _Setup(tmp_path, procs, make, monkeypatch, keyring=True)
    t.write(t.sender, t.pages[0])
    t.sender.close()
    again = t.real_sender(seed=83)
    assert again.writer_id == SENDER_ID
    t.write(again, t.pages[1])
    assert t.landed(again, t.pages[1])
    now = _sessions(t.receiver)
    assert now["sessions"] == 1 and now["auth_failed"] == 0 and now["writers"] == [SENDER_ID], now


def test_a_template_no_keyring_could_name_fails_the_channel_naming_the_variable(make, monkeypatch):  # noqa: F811
    monkeypatch.setenv("KVBRIDGE_PEER_ID", "prefill-a-{role}")  # no rank: TP ranks would collide
    with pytest.raises(ValueError, match="KVBRIDGE_PEER_ID"):
        make("sender")
