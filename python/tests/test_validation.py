"""Bad pointers, sizes, pages and buffers are refused with InvalidOp before any byte moves."""

import numpy as np
import pytest

import kvbridge
from conftest import PAGE, channel


@pytest.fixture
def ch():
    c = channel("validator")
    yield c
    c.close()


@pytest.mark.parametrize(
    "ptr, length, page_size, why",
    [
        (0, 4096, 4096, "null pointer"),
        (0x1000, 0, 4096, "length is 0"),
        (0x1000, 4096, 0, "page size is 0"),
        (0x1000, 4096, 3000, "does not divide"),
        (2**64 - 4096, 8192, 4096, "overflows"),
        (-1, 4096, 4096, "out of range"),
        (0x1000, -4096, 4096, "out of range"),
        (2**64, 4096, 4096, "out of range"),
    ],
)
def test_bad_raw_registration_is_refused(ch, ptr, length, page_size, why):
    with pytest.raises(kvbridge.InvalidOp, match=why):
        ch.register(ptr, length, page_size)
    assert ch.stats()["regions"] == 0


def test_non_integer_arguments_are_type_errors(ch):
    with pytest.raises(TypeError):
        ch.register("0x1000", 4096, 4096)


def test_buffer_registration_checks(ch):
    with pytest.raises(kvbridge.InvalidOp, match="length is 0"):
        ch.register_buffer(bytearray(), 4096)
    with pytest.raises(kvbridge.InvalidOp, match="does not divide"):
        ch.register_buffer(bytearray(10000), 4096)
    with pytest.raises(kvbridge.InvalidOp, match="C-contiguous"):
        ch.register_buffer(np.zeros((64, 64), dtype=np.uint8)[:, ::2], 32)
    with pytest.raises(kvbridge.InvalidOp):
        ch.register_buffer(object(), 4096)
    assert ch.stats()["regions"] == 0


def test_read_only_buffer_is_refused_where_a_peer_may_write(ch):
    with pytest.raises(kvbridge.InvalidOp, match="read-only"):
        ch.register_buffer(bytes(8192), 4096)
    with pytest.raises(kvbridge.InvalidOp, match="read-only"):
        ch.register_buffer(bytes(8192), 4096, peers=["decode-0"])
    ro = np.zeros(8192, dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(kvbridge.InvalidOp, match="read-only"):
        ch.register_buffer(ro, 4096)
    # Granted to no peer it can be the source of writes.
    ch.register_buffer(bytes(8192), 4096, peers=[])


def test_registered_bytearray_cannot_be_resized():
    with channel("holder") as c:
        buf = bytearray(8192)
        rid = c.register_buffer(buf, 4096)
        with pytest.raises(BufferError):
            buf.extend(b"x" * 10)
        c.deregister(rid)
        buf.extend(b"x" * 10)  # released by deregister


def test_out_of_range_pages_move_nothing(pair):
    s, k = pair.staging_region, pair.kv_region
    good_then_bad = [
        # (local_pages, remote_pages, page_len, message)
        ([0, 8], [0, 1], None, "local page 8"),
        ([0, 1], [0, 32], None, "remote page 32"),
        ([0, 1], [0, 2**62], None, "remote page"),
        ([0, 7], [0, 1], PAGE + 1, "local page 7"),
        ([0, 1], [0, 31], PAGE + 1, "remote page 31"),
        ([0, 1], [0], None, "2 local pages but 1 remote"),
        ([0, -1], [0, 1], None, "out of range"),
    ]
    for local, remote, page_len, msg in good_then_bad:
        for call in (pair.prefiller.write_pages, pair.prefiller.read_pages):
            with pytest.raises(kvbridge.InvalidOp, match=msg) as e:
                call(pair.peer, s, local, k, remote, page_len)
            if "out of range" not in msg:
                assert e.value.peer == "decode-0" and "decode-0" in str(e.value)
    assert not pair.kv.any(), "a refused batch moved bytes"
    with pytest.raises(kvbridge.InvalidOp, match="page_len is 0"):
        pair.prefiller.write_pages(pair.peer, s, [0], k, [0], page_len=0)


def test_out_of_range_byte_ops_move_nothing(pair):
    s, k = pair.staging_region, pair.kv_region
    bad = [
        [(s, 0, k, 0, PAGE), (s, 8 * PAGE - 10, k, PAGE, 11)],  # local end past the region
        [(s, 0, k, 0, PAGE), (s, 0, k, 32 * PAGE - 10, 11)],  # remote end past the region
        [(s, 0, k, 0, PAGE), (s, 0, k, 0, 0)],  # length 0
        [(s, 0, k, 0, PAGE), (s, 0, k + 1, 0, 16)],  # remote region unknown
        [(s, 0, k, 0, PAGE), (s + 1, 0, k, 0, 16)],  # local region unknown
        [(s, 0, k, 0, PAGE), (s, 0, k, 2**64 - 8, 16)],  # remote offset overflows
        [(s, 0, k, 0, PAGE), (s, 0, k)],  # not 5 fields
    ]
    for ops in bad:
        with pytest.raises(kvbridge.InvalidOp):
            pair.prefiller.write(pair.peer, ops)
    assert not pair.kv.any(), "a refused batch moved bytes"


def test_unknown_regions_and_peers(pair):
    with pytest.raises(kvbridge.InvalidOp, match="grants no region"):
        pair.prefiller.write_pages(pair.peer, pair.staging_region, [0], pair.kv_region + 1, [0])
    with pytest.raises(kvbridge.InvalidOp, match="not registered"):
        pair.prefiller.write_pages(pair.peer, pair.staging_region + 1, [0], pair.kv_region, [0])
    with pytest.raises(kvbridge.UnknownPeer) as e:
        pair.prefiller.write_pages("nobody", pair.staging_region, [0], pair.kv_region, [0])
    assert e.value.peer == "nobody"
    with pytest.raises(kvbridge.InvalidOp, match="not registered"):
        pair.prefiller.deregister(pair.staging_region + 1)


def test_read_into_a_read_only_region_is_refused(pair):
    ro = bytes(PAGE)
    rid = pair.prefiller.register_buffer(ro, PAGE, peers=[])
    pair.kv[:PAGE] = 1
    with pytest.raises(kvbridge.InvalidOp, match="read-only"):
        pair.prefiller.read_pages(pair.peer, rid, [0], pair.kv_region, [0])
    with pytest.raises(kvbridge.InvalidOp, match="read-only"):
        pair.prefiller.read(pair.peer, [(rid, 0, pair.kv_region, 0, 16)])
    assert ro == bytes(PAGE)
    # As a source it works.
    pair.kv[:PAGE] = 1
    pair.prefiller.write_pages(pair.peer, rid, [0], pair.kv_region, [0])
    assert not pair.kv[:PAGE].any()


def test_a_deregistered_region_cannot_be_used(pair):
    out = np.zeros(PAGE, dtype=np.uint8)
    rid = pair.prefiller.register_buffer(out, PAGE)
    pair.prefiller.deregister(rid)
    with pytest.raises(kvbridge.InvalidOp, match="not registered"):
        pair.prefiller.read_pages(pair.peer, rid, [0], pair.kv_region, [0])


def test_bad_channel_arguments():
    with pytest.raises(kvbridge.InvalidOp, match="transport"):
        channel("x", transport="carrier-pigeon")
    with pytest.raises(kvbridge.InvalidOp, match="deadline"):
        channel("x", deadlines={"forever": 1.0})
    with pytest.raises(kvbridge.InvalidOp, match="deadline"):
        channel("x", deadlines={"op": -1.0})
    with pytest.raises(kvbridge.InvalidOp, match="secret"):
        channel("x", secret=b"")
    with pytest.raises(kvbridge.LocalError):
        channel("x", "256.0.0.1:0")
