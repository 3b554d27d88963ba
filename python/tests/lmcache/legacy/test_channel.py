"""KvbridgeChannel against LMCache's BaseTransferChannel contract, two channels in one process.

The objects are LMCache ``MemoryObj`` stand-ins (``MagicMock(spec=MemoryObj)`` with
``meta.address``, as LMCache's own PD tests build them); the memory is real.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest

from pdproc import free_ports

PAGE = 4096
PAGES = 64


def _objs(indices):
    from lmcache.v1.memory_management import MemoryObj

    out = []
    for i in indices:
        o = MagicMock(spec=MemoryObj)
        o.meta = SimpleNamespace(address=i)
        out.append(o)
    return out


class Arena:
    def __init__(self, pages=PAGES, page=PAGE):
        import torch

        self.t = torch.zeros(pages * page, dtype=torch.uint8)
        self.page = page

    def fill(self, i, seed):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.t[i * self.page : (i + 1) * self.page] = torch.randint(0, 256, (self.page,), generator=g, dtype=torch.uint8)

    def page_bytes(self, i):
        return bytes(self.t[i * self.page : (i + 1) * self.page].numpy())


@pytest.fixture
def make():
    made = []

    def _make(role, listen=None, arena=None, **kw):
        from kvbridge.lmcache.channel import KvbridgeChannel

        arena = arena or Arena()
        ch = KvbridgeChannel(
            async_mode=False,
            role=role,
            buffer_ptr=arena.t.data_ptr(),
            buffer_size=arena.t.numel(),
            align_bytes=arena.page,
            tp_rank=0,
            peer_init_url=listen,
            backends=["UCX"],
            **{"device": "cpu", **kw},
        )
        made.append(ch)
        ch.arena = arena
        return ch

    yield _make
    for ch in made:
        ch.close()


def _url():
    return f"127.0.0.1:{free_ports(1)[0]}"


def _relisten(make, url):
    """A new listener on the address a closed channel of this process listened on.

    ``Channel.close()`` returns once its listening socket is dropped; the short retry only
    guards against another process taking the freed port in between.
    """
    import kvbridge

    deadline = time.monotonic() + 5
    while True:
        try:
            return make("receiver", url)
        except kvbridge.LocalError as e:
            if "Address already in use" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def test_write_returns_once_the_bytes_landed_in_the_receivers_pages(make):
    url = _url()
    recv = make("receiver", url)
    send = make("sender")
    assert send.lazy_init_peer_connection("S", "R", url) is None
    assert send.remote_xfer_handler_exists("R")
    for i in (3, 4, 9):
        send.arena.fill(i, seed=i)
    n = send.batched_write(_objs([3, 4, 9]), {"receiver_id": "R", "remote_indexes": [10, 0, 63]})
    assert n == 3
    for src, dst in ((3, 10), (4, 0), (9, 63)):
        assert recv.arena.page_bytes(dst) == send.arena.page_bytes(src)
    assert recv.arena.page_bytes(1) == bytes(PAGE)


def test_async_write_and_read_on_the_event_loop(make):
    url = _url()
    recv = make("receiver", url)
    send = make("sender")
    recv.arena.fill(7, seed=70)
    send.arena.fill(1, seed=10)

    async def go():
        await send.async_lazy_init_peer_connection("S", "R", url)
        await send.async_batched_write(_objs([1]), {"receiver_id": "R", "remote_indexes": [2]})
        await send.async_batched_read(_objs([5]), {"sender_id": "R", "remote_indexes": [7]})

    asyncio.run(go())
    assert recv.arena.page_bytes(2) == send.arena.page_bytes(1)
    assert send.arena.page_bytes(5) == recv.arena.page_bytes(7)


def test_listener_knows_the_dialer_by_its_local_id_when_the_dial_returns(make):
    # role "both" / P2P: the listener writes into the dialer's arena, addressed by local_id.
    url = _url()
    listener = make("both", url)
    dialer = make("both")
    dialer.lazy_init_peer_connection("dialer-local-id", "L", url)
    assert listener.remote_xfer_handler_exists("dialer-local-id")
    listener.arena.fill(0, seed=5)
    listener.batched_write(_objs([0]), {"receiver_id": "dialer-local-id", "remote_indexes": [33]})
    assert dialer.arena.page_bytes(33) == listener.arena.page_bytes(0)


def test_p2p_side_message_is_answered_by_the_listener(make):
    from lmcache.v1.transfer_channel.transfer_utils import P2PInitSideMsg, P2PInitSideRetMsg

    url = _url()
    make("both", url, peer_lookup_url="127.0.0.1:7777")
    dialer = make("both")
    ret = dialer.lazy_init_peer_connection("D", "L", url, init_side_msg=P2PInitSideMsg())
    assert ret == P2PInitSideRetMsg(peer_lookup_url="127.0.0.1:7777")


def test_dial_waits_for_a_listener_that_comes_up_late(make):
    url = _url()
    send = make("sender", connect_timeout=20)
    recv_arena = Arena()
    box = {}

    def late():
        time.sleep(1.5)
        box["recv"] = make("receiver", url, arena=recv_arena)

    t = threading.Thread(target=late)
    t0 = time.monotonic()
    t.start()
    send.lazy_init_peer_connection("S", "R", url)
    waited = time.monotonic() - t0
    t.join()
    assert waited >= 1.4
    send.arena.fill(0, seed=1)
    send.batched_write(_objs([0]), {"receiver_id": "R", "remote_indexes": [0]})
    assert recv_arena.page_bytes(0) == send.arena.page_bytes(0)


def test_no_listener_fails_with_connection_lost_within_the_deadline(make):
    import kvbridge

    url = _url()
    send = make("sender", connect_timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(kvbridge.ConnectionLost) as e:
        send.lazy_init_peer_connection("S", "R", url)
    assert time.monotonic() - t0 < 5
    assert e.value.step == "connect"
    assert any("did not answer within 1 s" in n for n in getattr(e.value, "__notes__", []))
    assert not send.remote_xfer_handler_exists("R")


def test_restarted_receiver_is_reached_and_the_old_incarnation_never(make):
    url = _url()
    first = make("receiver", url)
    send = make("sender")
    send.lazy_init_peer_connection("S", "R", url)
    old_peer = send._peers["R"].kb_peer
    first.close()
    # Nobody listens: the write fails with a typed error at once, no hang.
    send.arena.fill(2, seed=2)
    t0 = time.monotonic()
    with pytest.raises(Exception) as e:
        send.batched_write(_objs([2]), {"receiver_id": "R", "remote_indexes": [4]})
    import kvbridge

    assert isinstance(e.value, kvbridge.KvbridgeError), repr(e.value)
    assert time.monotonic() - t0 < 10
    # It comes back on the same address: the next write reaches the new incarnation.
    second = _relisten(make, url)
    send.batched_write(_objs([2]), {"receiver_id": "R", "remote_indexes": [4]})
    assert second.arena.page_bytes(4) == send.arena.page_bytes(2)
    assert send._peers["R"].kb_peer != old_peer


def test_misuse_is_refused_with_clear_errors(make):
    import kvbridge

    with pytest.raises(ValueError, match="pd_buffer_device: cpu"):
        make("sender", device="cuda:0")
    url = _url()
    make("receiver", url)
    send = make("sender")
    send.lazy_init_peer_connection("S", "R", url)
    with pytest.raises(KeyError, match="no connection to LMCache peer 'nobody'"):
        send.batched_write(_objs([0]), {"receiver_id": "nobody", "remote_indexes": [0]})
    with pytest.raises(ValueError, match="2 objects but 1 remote_indexes"):
        send.batched_write(_objs([0, 1]), {"receiver_id": "R", "remote_indexes": [0]})
    with pytest.raises(NotImplementedError):
        send.batched_write([b"raw"], {"receiver_id": "R", "remote_indexes": [0]})
    with pytest.raises(kvbridge.InvalidOp):
        send.batched_write(_objs([0]), {"receiver_id": "R", "remote_indexes": [PAGES]})
    with pytest.raises(kvbridge.InvalidOp):
        send.batched_write(_objs([PAGES]), {"receiver_id": "R", "remote_indexes": [0]})
    with pytest.raises(NotImplementedError):
        send.batched_send(_objs([0]))
    with pytest.raises(NotImplementedError):
        asyncio.run(send.async_batched_recv(_objs([0])))
    assert send.batched_write([], {"receiver_id": "R", "remote_indexes": []}) == 0
    send.close()
    send.close()


def test_peers_with_different_chunk_sizes_are_refused_at_connect(make):
    url = _url()
    make("receiver", url, arena=Arena(pages=32, page=8192))
    send = make("sender")
    with pytest.raises(ValueError, match="same KV chunk shape"):
        send.lazy_init_peer_connection("S", "R", url)


def test_receiver_restarted_while_idle_gets_the_next_write(make):
    url = _url()
    first = make("receiver", url)
    send = make("sender")
    send.lazy_init_peer_connection("S", "R", url)
    old_peer = send._peers["R"].kb_peer
    first.close()
    second = _relisten(make, url)
    send.arena.fill(6, seed=6)
    # The old incarnation's session is gone: the write dials once and reaches the new one.
    send.batched_write(_objs([6]), {"receiver_id": "R", "remote_indexes": [1]})
    assert second.arena.page_bytes(1) == send.arena.page_bytes(6)
    assert send._peers["R"].kb_peer != old_peer


@pytest.mark.parametrize("mode", ["blocking", "asyncio"])
def test_an_unacknowledged_announcement_leaves_no_session(make, mode):
    """A peer that takes the kvbridge connection but never answers LMCache's announcement
    (a plain kvbridge channel, not an LMCache one) fails the init with ``Timeout`` and the
    half-built session is ended on both sides, not left connected with nothing using it."""
    import kvbridge

    url = _url()
    buf = bytearray(PAGES * PAGE)
    with kvbridge.Channel("not-lmcache", url, use_env=False) as other:
        other.register_buffer(buf, PAGE)
        send = make("sender")
        send.hello_timeout = 0.3
        with pytest.raises(kvbridge.Timeout) as err:
            if mode == "blocking":
                send.lazy_init_peer_connection("S", "R", url)
            else:
                asyncio.run(send.async_lazy_init_peer_connection("S", "R", url))
        assert err.value.step == "lmcache-init"
        assert send.kvbridge_channel.stats()["established"] == 0
        assert not send.remote_xfer_handler_exists("R")
        deadline = time.monotonic() + 5
        while other.stats()["established"] != 0:
            assert time.monotonic() < deadline, "the listener kept the abandoned session"
            time.sleep(0.02)


def test_write_and_read_over_ucx_when_the_environment_asks_for_it(make, monkeypatch):
    # KvbridgeChannel takes kvbridge's transport from KVBRIDGE_TRANSPORT, as a deployment
    # sets it; UCX's same-user transports need no KVBRIDGE_UCX_TRUSTED_FABRIC (docs/ucx.md).
    import kvbridge

    if "ucx" not in kvbridge.TRANSPORTS:
        pytest.skip("this kvbridge package was built without UCX")
    monkeypatch.setenv("KVBRIDGE_TRANSPORT", "ucx")
    monkeypatch.setenv("UCX_TLS", "posix,cma,self")
    url = _url()
    recv = make("receiver", url)
    send = make("sender")
    assert send.lazy_init_peer_connection("S", "R", url) is None
    for i in (2, 5):
        send.arena.fill(i, seed=i + 100)
    recv.arena.fill(40, seed=140)
    assert send.batched_write(_objs([2, 5]), {"receiver_id": "R", "remote_indexes": [33, 1]}) == 2
    assert send.batched_read(_objs([7]), {"sender_id": "R", "remote_indexes": [40]}) == 1
    assert recv.arena.page_bytes(33) == send.arena.page_bytes(2)
    assert recv.arena.page_bytes(1) == send.arena.page_bytes(5)
    assert send.arena.page_bytes(7) == recv.arena.page_bytes(40)
    stats = send._ch.stats()
    assert stats["ucx_batches"] == 2 and stats["shm_batches"] == stats["cma_batches"] == 0, stats


def test_a_peer_with_the_secret_cannot_take_another_peers_lmcache_id(make):
    # An insider: it holds the secret and announces the id of a live peer, to receive the
    # writes the listener addresses to that id. The id stays with the session that
    # announced it first; the insider's announcement is refused, and the listener's writes
    # still reach the first peer.
    url = _url()
    listener = make("both", url)
    honest = make("both")
    insider = make("both")
    honest.lazy_init_peer_connection("decoder-0", "L", url)
    with pytest.raises(kvbridge_rejected()) as e:
        insider.lazy_init_peer_connection("decoder-0", "L", url)
    assert "belongs to another live session" in str(e.value)
    assert listener.identity_refusals == 1
    listener.arena.fill(0, seed=9)
    listener.batched_write(_objs([0]), {"receiver_id": "decoder-0", "remote_indexes": [5]})
    assert honest.arena.page_bytes(5) == listener.arena.page_bytes(0)
    assert insider.arena.page_bytes(5) == bytes(PAGE)
    # one id per session: the honest session cannot claim a second id either
    with pytest.raises(kvbridge_rejected()):
        honest.lazy_init_peer_connection("decoder-1", "L", url)


def test_a_restarted_peer_takes_its_lmcache_id_back(make):
    url = _url()
    listener = make("both", url)
    first = make("both")
    first.lazy_init_peer_connection("decoder-0", "L", url)
    first.close()
    deadline = time.monotonic() + 10
    second = make("both")
    while True:  # the listener learns of the first session's end by itself
        try:
            second.lazy_init_peer_connection("decoder-0", "L", url)
            break
        except kvbridge_rejected():
            assert time.monotonic() < deadline, "the dead session kept its id"
            time.sleep(0.05)
    listener.arena.fill(1, seed=3)
    listener.batched_write(_objs([1]), {"receiver_id": "decoder-0", "remote_indexes": [7]})
    assert second.arena.page_bytes(7) == listener.arena.page_bytes(1)


def kvbridge_rejected():
    import kvbridge

    return kvbridge.Rejected
