"""Page arithmetic of the kvbridge transfer channel: which bytes a read moves, and which
addresses are refused before any byte moves."""

from __future__ import annotations

import pytest

from kvbridge.lmcache.distributed_pages import PagedArena, read_ops

LOCAL = PagedArena(region=1, length=4096, page_size=256)
REMOTE = PagedArena(region=2, length=8192, page_size=256)


def test_arena_from_l1_leaves_out_a_trailing_partial_page():
    arena = PagedArena.from_l1(7, 1000, 256)
    assert (arena.region, arena.length, arena.page_size) == (7, 768, 256)


@pytest.mark.parametrize("size, align", [(100, 256), (4096, 0), (4096, -1)])
def test_arena_from_l1_refuses_an_arena_without_a_page(size, align):
    with pytest.raises(ValueError):
        PagedArena.from_l1(1, size, align)


def test_one_object_moves_its_whole_pages():
    assert read_ops(LOCAL, REMOTE, [(512, 300)], [(1024, 300)]) == [(1, 512, 2, 1024, 512)]


def test_objects_contiguous_on_both_sides_become_one_op():
    ops = read_ops(LOCAL, REMOTE, [(0, 256), (256, 512), (768, 256)],
                   [(2048, 256), (2304, 512), (2816, 256)])
    assert ops == [(1, 0, 2, 2048, 1024)]


def test_objects_contiguous_on_one_side_only_stay_separate():
    ops = read_ops(LOCAL, REMOTE, [(0, 256), (256, 256)], [(512, 256), (0, 256)])
    assert ops == [(1, 0, 2, 512, 256), (1, 256, 2, 0, 256)]


def test_no_objects_no_ops():
    assert read_ops(LOCAL, REMOTE, [], []) == []


def test_lists_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="equal length"):
        read_ops(LOCAL, REMOTE, [(0, 256)], [(0, 256), (256, 256)])


@pytest.mark.parametrize(
    "local, remote, match",
    [
        ((128, 256), (0, 256), "not aligned"),
        ((0, 256), (64, 256), "not aligned"),
        ((4096, 256), (0, 256), "outside"),
        ((3840, 512), (0, 512), "outside"),
        ((0, 256), (8192 - 256, 512), "outside"),
        ((-256, 256), (0, 256), "outside"),
        ((0, 0), (0, 0), "outside"),
        ((0, 256), (0, 512), "spans 1 pages"),
    ],
)
def test_bad_addresses_are_refused(local, remote, match):
    with pytest.raises(ValueError, match=match):
        read_ops(LOCAL, REMOTE, [local], [remote])


def test_a_bad_address_anywhere_refuses_the_whole_batch():
    with pytest.raises(ValueError):
        read_ops(LOCAL, REMOTE, [(0, 256), (256, 256), (999, 256)], [(0, 256)] * 3)
