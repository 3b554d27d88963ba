"""Close, use after close, unreachable and refusing peers: typed errors within deadlines."""

import socket
import time

import numpy as np
import pytest

import kvbridge
from conftest import DEADLINES, PAGE, channel


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


def test_transport_says_what_the_channel_was_opened_with(monkeypatch):
    with channel("t-default") as c:
        assert c.transport == "auto"
    assert c.transport is None
    with channel("t-tcp", transport="tcp") as c:
        assert c.transport == "tcp"
    monkeypatch.setenv("KVBRIDGE_TRANSPORT", "shm")
    with kvbridge.Channel("t-env", deadlines=DEADLINES) as c:  # use_env: the variable decides
        assert c.transport == "shm"


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


RIGHT = b"the right secret, 32 bytes long."
WRONG = "a wrong secret of 32 bytes, too."


def test_secret_mismatch_is_unauthenticated():
    with channel("decode-0", "127.0.0.1:0", secret=RIGHT) as d:
        with channel("prefill-0", secret=WRONG) as p:
            with pytest.raises(kvbridge.Unauthenticated) as e:
                p.connect(d.local_addr)
            assert e.value.step is not None and e.value.peer is not None
            assert isinstance(e.value, kvbridge.PeerError)
        with channel("prefill-1") as p:
            with pytest.raises(kvbridge.Unauthenticated):
                p.connect(d.local_addr)
        with channel("prefill-2", secret=RIGHT) as p:
            assert p.connect(d.local_addr) == "decode-0"


def test_a_short_secret_is_refused_naming_its_length():
    with pytest.raises(kvbridge.LocalError, match="5 bytes; at least 16"):
        channel("decode-0", "127.0.0.1:0", secret=b"right")


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


def test_a_forked_child_refuses_the_parents_channel_and_makes_its_own(pair):
    """A channel's tasks live in the process that made it: in a fork child a call fails
    typed (instead of waiting for ever), exit does not hang, and new channels work."""
    import os

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        code = 1
        try:
            try:
                pair.prefiller.stats()
                msg = b"no error"
            except kvbridge.LocalError as e:
                msg = b"ok" if b"fork" in str(e).encode() else str(e).encode()
            if msg == b"ok":
                with channel("child-listener", "127.0.0.1:0") as d:
                    kv = np.zeros(PAGE, dtype=np.uint8)
                    kr = d.register_buffer(kv, PAGE)
                    with channel("child") as c:
                        src = np.full(PAGE, 3, dtype=np.uint8)
                        sr = c.register_buffer(src, PAGE)
                        c.write_pages(c.connect(d.local_addr), sr, [0], kr, [0])
                    msg = b"ok" if (kv == 3).all() else b"bad bytes"
                pair.prefiller.close()  # leaves the parent's sessions alone
            os.write(w, msg)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    import select

    if not select.select([r], [], [], 30)[0]:  # the child writes, or exits, within 30 s
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    _, status = os.waitpid(pid, 0)
    msg = os.read(r, 1000)
    os.close(r)
    assert msg == b"ok" and os.WEXITSTATUS(status) == 0
    # The parent's channel is untouched.
    pair.prefiller.write_pages(pair.peer, pair.staging_region, [0], pair.kv_region, [0])
    assert np.array_equal(pair.kv_page(0), pair.staging_page(0))


def test_tls_on_the_control_connection(tmp_path):
    """A listener with a certificate, an initiator that pins it; a plaintext initiator is
    refused typed."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2",
         "-subj", "/CN=kvbridge-test", "-addext", "subjectAltName=IP:127.0.0.1",
         "-addext", "basicConstraints=critical,CA:FALSE"],
        check=True, capture_output=True,
    )
    with channel("decode-0", "127.0.0.1:0", tls_cert=str(cert), tls_key=str(key)) as d:
        kv = np.zeros(PAGE, dtype=np.uint8)
        kr = d.register_buffer(kv, PAGE)
        with channel("prefill-0", tls_ca=str(cert)) as p:
            src = np.full(PAGE, 8, dtype=np.uint8)
            sr = p.register_buffer(src, PAGE)
            peer = p.connect(d.local_addr)
            p.write_pages(peer, sr, [0], kr, [0])
            assert (kv == 8).all()
        with channel("prefill-1") as plain:
            with pytest.raises(kvbridge.Incompatible, match="TLS"):
                plain.connect(d.local_addr)
        with channel("prefill-2", tls_ca=str(cert), tls_server_name="other.example") as wrong:
            with pytest.raises(kvbridge.KvbridgeError) as e:
                wrong.connect(d.local_addr)
            assert e.value.step == "tls-handshake"
