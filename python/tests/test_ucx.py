"""kvbridge's UCX transport from Python: a peer in another process over UCX's same-user
transports, the refusal of transports others can reach unless declared trusted, and a killed
peer's writes failing at once."""

import os
import subprocess
import sys

import numpy as np
import pytest

import kvbridge
from conftest import channel
from test_processes import finish, read_write_digest, readline, write_kill_write

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = 64 << 10
# What runs without KVBRIDGE_UCX_TRUSTED_FABRIC: only this user's processes on this host
# reach these (docs/ucx.md, "Who can reach a UCX worker").
SAME_USER = "posix,cma,self"

if "ucx" not in kvbridge.TRANSPORTS:
    # scripts/test.sh builds the package with UCX; CI must not pass without it.
    if os.environ.get("CI"):
        raise RuntimeError("the installed kvbridge package has no UCX transport (TRANSPORTS = %r)" % (kvbridge.TRANSPORTS,))
    pytest.skip("this kvbridge package was built without UCX", allow_module_level=True)


def spawn_listener():
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "peer_process.py"), "listen", "0", "ucx"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
    )


def stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_peer_in_another_process_over_ucx_byte_exact(monkeypatch):
    monkeypatch.setenv("UCX_TLS", SAME_USER)
    proc = spawn_listener()
    try:
        addr, region = readline(proc).split()
        with channel("prefill-main", transport="ucx") as ch:
            peer = ch.connect(addr)
            assert ch.peer_transport(peer) == "ucx"
            read_write_digest(ch, peer, int(region), seed=5)
            # Both batches went over UCX, none over TCP or kvbridge's own shared memory.
            stats = ch.stats()
            assert (stats["ucx_batches"], stats["shm_batches"], stats["cma_batches"]) == (2, 0, 0), stats
        _, err = finish(proc)
        assert proc.returncode == 0, err
    finally:
        stop(proc)


def test_transports_others_reach_are_refused_by_name_unless_declared_trusted(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.delenv("KVBRIDGE_UCX_TRUSTED_FABRIC", raising=False)
    with pytest.raises(kvbridge.LocalError) as e:
        channel("decode-0", "127.0.0.1:0", transport="ucx")
    assert "tcp" in str(e.value) and "KVBRIDGE_UCX_TRUSTED_FABRIC" in str(e.value), e.value
    # The environment's declaration counts with use_env (the default of kvbridge.Channel)...
    monkeypatch.setenv("KVBRIDGE_UCX_TRUSTED_FABRIC", "1")
    kvbridge.Channel("decode-0", "127.0.0.1:0", transport="ucx", deadlines={"close": 2.0}).close()
    # ...and not without it: a caller that ignores the environment must declare it itself.
    with pytest.raises(kvbridge.LocalError):
        channel("decode-0", "127.0.0.1:0", transport="ucx")
    monkeypatch.delenv("KVBRIDGE_UCX_TRUSTED_FABRIC")
    # Declared by argument: UCX over tcp carries the pages.
    with channel("decode-0", "127.0.0.1:0", transport="ucx", ucx_trusted_fabric=True) as dec, channel(
        "prefill-0", transport="ucx", ucx_trusted_fabric=True
    ) as pre:
        kv = np.zeros(4 * PAGE, dtype=np.uint8)
        kv_region = dec.register_buffer(kv, PAGE)
        src = np.full(PAGE, 9, dtype=np.uint8)
        src_region = pre.register_buffer(src, PAGE)
        peer = pre.connect(dec.local_addr)
        assert pre.peer_transport(peer) == "ucx"
        pre.write_pages(peer, src_region, [0], kv_region, [2])
        assert (kv[2 * PAGE : 3 * PAGE] == 9).all() and not kv[: 2 * PAGE].any()
        assert pre.stats()["ucx_batches"] == 1


def test_a_killed_ucx_peer_fails_the_next_write_at_once(monkeypatch):
    monkeypatch.setenv("UCX_TLS", SAME_USER)
    proc = spawn_listener()
    op = 20.0
    try:
        addr, region = readline(proc).split()
        with channel("prefill-main", transport="ucx", deadlines={"op": op, "connect": 2.0, "handshake_step": 2.0}) as ch:
            peer = ch.connect(addr)
            assert ch.peer_transport(peer) == "ucx"
            error, took = write_kill_write(ch, proc, peer, int(region))
            # The session ends with the peer's control connection; a write posted on UCX's
            # shared memory to the dead process would not end by itself (the engine's own
            # a_peer_seen_dead_has_its_batches_answered_at_once covers that case).
            assert took < op / 4, took
            assert error.peer in ("decode-sub", addr)
            assert not isinstance(error, (kvbridge.Closed, kvbridge.Timeout)), error
    finally:
        stop(proc)
