"""What a peer may do with a region: the ``access`` of ``register``/``register_buffer``."""

import numpy as np
import pytest

import kvbridge
from conftest import PAGE, channel


@pytest.fixture
def owner_and_peer():
    # TCP only: the owner does every copy, so it is the one that enforces the mode (over
    # shared memory and cross-memory attach the peer copies by itself)
    owner = channel("owner", "127.0.0.1:0", transport="tcp")
    peer = channel("peer", transport="tcp")
    yield owner, peer
    peer.close()
    owner.close()


def test_a_read_only_region_is_read_and_never_written(owner_and_peer):
    owner, peer = owner_and_peer
    kv = np.arange(4 * PAGE, dtype=np.uint64).astype(np.uint8)
    rid = owner.register_buffer(kv, PAGE, access="read")
    before = kv.copy()
    to = peer.connect(owner.local_addr)
    out = np.zeros(PAGE, dtype=np.uint8)
    mine = peer.register_buffer(out, PAGE)
    peer.read_pages(to, mine, [0], rid, [2])
    assert np.array_equal(out, kv[2 * PAGE : 3 * PAGE])
    out[:] = 0xEE
    with pytest.raises(kvbridge.KvbridgeError) as e:
        peer.write_pages(to, mine, [0], rid, [1])
    assert "access" in str(e.value).lower() or e.value.code == "AccessDenied", e.value
    assert np.array_equal(kv, before), "a refused write changed the owner's memory"


def test_a_write_only_region_is_never_read(owner_and_peer):
    owner, peer = owner_and_peer
    inbox = np.full(2 * PAGE, 7, dtype=np.uint8)
    rid = owner.register_buffer(inbox, PAGE, access="write")
    to = peer.connect(owner.local_addr)
    out = np.zeros(PAGE, dtype=np.uint8)
    mine = peer.register_buffer(out, PAGE)
    with pytest.raises(kvbridge.KvbridgeError):
        peer.read_pages(to, mine, [0], rid, [0])
    assert not out.any(), "a refused read delivered the owner's bytes"


def test_access_is_checked_at_registration():
    ch = channel("owner", "127.0.0.1:0")
    try:
        with pytest.raises(kvbridge.InvalidOp):
            ch.register_buffer(bytearray(PAGE), PAGE, access="everything")
        ro = memoryview(bytes(PAGE))
        # read-only memory: fine when no peer can write it, refused when one could
        ch.register_buffer(ro, PAGE, access="read")
        with pytest.raises(kvbridge.InvalidOp):
            ch.register_buffer(ro, PAGE)
        with pytest.raises(kvbridge.InvalidOp):
            ch.register_buffer(ro, PAGE, access="read", direct_copies=True)
    finally:
        ch.close()
