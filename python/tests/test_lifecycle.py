"""Close, use after close, unreachable and refusing peers: typed errors within deadlines."""

import socket
import time

import numpy as np
import pytest

import kvbridge
from conftest import PAGE, channel


def test_every_call_after_close_raises_closed(pair):
    p, s, k, peer = pair.prefiller, pair.staging_region, pair.kv_region, pair.peer
    p.close()
    p.close()  # idempotent
    assert p.closed
    calls = [
        lambda: p.register(0x1000, 4096, 4096),
        lambda: p.register_buffer(bytearray(4096), 4096),
        lambda: p.deregister(s),
        lambda: p.connect(pair.decoder.local_addr),
        lambda: p.peer_regions(peer),
        lambda: p.write_pages(peer, s, [0], k, [0]),
        lambda: p.read_pages(peer, s, [0], k, [0]),
        lambda: p.write(peer, [(s, 0, k, 0, 16)]),
        lambda: p.read(peer, [(s, 0, k, 0, 16)]),
        lambda: p.submit_write_pages(peer, s, [0], k, [0]),
        lambda: p.submit_read(peer, [(s, 0, k, 0, 16)]),
        lambda: p.notify(peer, b"x"),
        lambda: p.recv_notification(0),
        lambda: p.get_new_notifs(),
        lambda: p.stats(),
    ]
    for call in calls:
        with pytest.raises(kvbridge.Closed):
            call()
    assert not pair.kv.any()


def test_context_manager_closes():
    with channel("ctx", "127.0.0.1:0") as c:
        assert c.local_addr.startswith("127.0.0.1:")
    assert c.closed
    with pytest.raises(kvbridge.Closed):
        c.stats()


def test_peer_close_fails_writes_typed(pair):
    pair.decoder.close()
    with pytest.raises(kvbridge.KvbridgeError) as e:
        pair.prefiller.write_pages(pair.peer, pair.staging_region, [0], pair.kv_region, [0])
    assert e.value.peer == "decode-0" and "decode-0" in str(e.value)
    assert not isinstance(e.value, kvbridge.Closed)


def test_connection_refused_is_typed_and_prompt():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    addr = "127.0.0.1:%d" % s.getsockname()[1]
    s.close()  # nothing listens there now
    with channel("dialer") as c:
        t0 = time.monotonic()
        with pytest.raises(kvbridge.ConnectionLost) as e:
            c.connect(addr)
        assert time.monotonic() - t0 < 2.5
        assert e.value.peer == addr and e.value.step == "connect"
        assert addr in str(e.value) and "connect" in str(e.value)


def test_silent_peer_times_out_within_its_deadline():
    """A socket that accepts but never answers: the handshake step's deadline ends it."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    addr = "127.0.0.1:%d" % silent.getsockname()[1]
    try:
        with channel("dialer", deadlines={"connect": 1.0, "handshake_step": 0.5}) as c:
            t0 = time.monotonic()
            with pytest.raises(kvbridge.Timeout) as e:
                c.connect(addr)
            elapsed = time.monotonic() - t0
            assert 0.4 < elapsed < 3.0, elapsed
            assert e.value.peer == addr and e.value.step == "welcome"
            assert isinstance(e.value, TimeoutError)
            assert c.stats()["sessions"] == 0
    finally:
        silent.close()


def test_secret_mismatch_is_unauthenticated():
    with channel("decode-0", "127.0.0.1:0", secret=b"right") as d:
        with channel("prefill-0", secret="wrong") as p:
            with pytest.raises(kvbridge.Unauthenticated) as e:
                p.connect(d.local_addr)
            assert e.value.step is not None and e.value.peer is not None
            assert isinstance(e.value, kvbridge.PeerError)
        with channel("prefill-1") as p:
            with pytest.raises(kvbridge.Unauthenticated):
                p.connect(d.local_addr)
        with channel("prefill-2", secret=b"right") as p:
            assert p.connect(d.local_addr) == "decode-0"


def test_compat_mismatch_is_incompatible():
    with channel("decode-0", "127.0.0.1:0", compat="llama fp16 tp2") as d:
        with channel("prefill-0", compat="llama bf16 tp2") as p:
            with pytest.raises(kvbridge.Incompatible) as e:
                p.connect(d.local_addr)
            assert "fp16" in str(e.value) and "bf16" in str(e.value)


def test_grant_limits_which_peers_see_a_region():
    with channel("decode-0", "127.0.0.1:0") as d:
        kv = np.zeros(4 * PAGE, dtype=np.uint8)
        d.register_buffer(kv, PAGE, peers=["prefill-1"])
        with channel("prefill-0") as p:
            peer = p.connect(d.local_addr)
            assert p.peer_regions(peer) == []


def test_exceptions_pickle_with_peer_and_step():
    import pickle

    e = kvbridge.Timeout("peer x: step write passed its deadline", "x", "write")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is kvbridge.Timeout
    assert (back.peer, back.step, str(back)) == ("x", "write", str(e))
    assert issubclass(kvbridge.LimitExceeded, kvbridge.Rejected)
    assert issubclass(kvbridge.InvalidOp, ValueError)
    for name in kvbridge.__all__:
        obj = getattr(kvbridge, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, kvbridge.KvbridgeError)
