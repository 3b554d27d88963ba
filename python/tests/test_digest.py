"""The integrity digest from Python: ``kvbridge.digest`` of a buffer and
``kvbridge.digest_ranges`` of raw ``(address, length)`` ranges, the same XXH3-64 the engine
computes (``kvbridge::digest``)."""

import sys
import threading
import time

import numpy as np
import pytest

import kvbridge

# XXH3-64, seed 0 (xxHash's reference values; the engine's unit test checks the same).
XXH3_EMPTY = 0x2D06800538D394C2
XXH3_A = 0xE6C632B61E964E1F


def test_known_vectors_of_the_chosen_hash():
    assert kvbridge.DIGEST_ALGORITHM == "xxh3-64"
    assert kvbridge.digest(b"") == XXH3_EMPTY
    assert kvbridge.digest(b"a") == XXH3_A


def test_ranges_equal_the_buffer_variant():
    block = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    addr = block.ctypes.data
    cuts = [(0, 4096), (4096, 65536), (0, 1 << 20), (12345, 1000)]
    got = kvbridge.digest_ranges([(addr + at, n) for at, n in cuts])
    assert got == [kvbridge.digest(block[at : at + n]) for at, n in cuts]
    assert got[2] == kvbridge.digest(block.tobytes()) == kvbridge.digest(bytearray(block))
    assert kvbridge.digest(memoryview(block)) == got[2]


def test_one_flipped_byte_changes_it():
    block = np.full(1 << 20, 0x5A, dtype=np.uint8)
    clean = kvbridge.digest(block)
    for at in (0, 4095, 1 << 19, (1 << 20) - 1):
        block[at] ^= 0x01
        assert kvbridge.digest(block) != clean, at
        assert kvbridge.digest_ranges([(block.ctypes.data, block.nbytes)]) != [clean], at
        block[at] ^= 0x01
    assert kvbridge.digest(block) == clean


def test_empty_ranges():
    assert kvbridge.digest_ranges([]) == []
    # length 0: no byte is read, whatever the address (null included)
    assert kvbridge.digest_ranges([(0, 0), (0xDEAD, 0)]) == [XXH3_EMPTY, XXH3_EMPTY]
    assert kvbridge.digest(np.zeros(0, dtype=np.uint8)) == XXH3_EMPTY


@pytest.mark.parametrize(
    "ranges, why",
    [
        ([(0, 4096)], "null address"),
        ([(2**64 - 4096, 8192)], "overflows"),
        ([(-1, 16)], "out of range"),
        ([(0x1000, -16)], "out of range"),
        ([(2**64, 16)], "out of range"),
    ],
)
def test_bad_ranges_are_refused_before_any_read(ranges, why):
    with pytest.raises(kvbridge.InvalidOp, match=why):
        kvbridge.digest_ranges(ranges)


@pytest.mark.parametrize("ranges", [b"ab", "ab", [(1,)], [(1, 2, 3)], [("0x10", 4)], [1], 7])
def test_malformed_ranges_are_type_errors(ranges):
    with pytest.raises(TypeError):
        kvbridge.digest_ranges(ranges)


@pytest.mark.parametrize("obj", [12, "text", object(), np.zeros((4, 4))[:, 1]])
def test_what_has_no_contiguous_bytes_is_refused(obj):
    with pytest.raises(kvbridge.InvalidOp):
        kvbridge.digest(obj)


def test_it_releases_the_gil():
    """Another Python thread runs while a long digest is being computed: a tick of it is
    stamped well inside the call (with the GIL held throughout, none could be)."""
    block = np.ones(256 << 20, dtype=np.uint8)
    ranges = [(block.ctypes.data, block.nbytes)]
    ticks = []
    done = threading.Event()

    def count():
        while not done.is_set():
            ticks.append(time.monotonic())

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # the caller's hand-over before the call is that short
    t = threading.Thread(target=count)
    t.start()
    inside = []
    try:
        for _ in range(5):
            t0 = time.monotonic()
            kvbridge.digest_ranges(ranges)
            t1 = time.monotonic()
            inside = [x for x in list(ticks) if t0 + 0.003 < x < t1 - 0.001]
            if inside:
                break
    finally:
        done.set()
        t.join()
        sys.setswitchinterval(old)
    assert inside, f"no other thread ran during a {1e3 * (t1 - t0):.1f} ms digest"
