"""The prefiller's lease table as a decoder reads it, without channels."""

from __future__ import annotations

import pytest

from kvbridge.vllm.lease_table import GROUP_SLOTS, PAGE_BYTES, LeaseState, LeaseTable, state, tag, where


def page(table: LeaseTable, req: str) -> bytes:
    g = where(req)
    return bytes(table.memory[g * PAGE_BYTES : (g + 1) * PAGE_BYTES])


def same_group(n: int) -> list[str]:
    """`n` request ids that all live in one group."""
    want = where("r-0")
    out = [f"r-{i}" for i in range(200_000) if where(f"r-{i}") == want]
    assert len(out) >= n
    return out[:n]


def test_held_then_ended():
    t = LeaseTable()
    assert state("a", page(t, "a")) is LeaseState.UNKNOWN
    assert t.hold("a")
    assert state("a", page(t, "a")) is LeaseState.HELD
    t.end("a")
    assert state("a", page(t, "a")) is LeaseState.ENDED
    assert t.held() == 0


def test_a_request_never_held_reads_ended_once_freed():
    # freed before the prefiller's step marked it (a decoder's early notice)
    t = LeaseTable()
    t.end("early")
    assert state("early", page(t, "early")) is LeaseState.ENDED


def test_requests_of_one_group_do_not_mistake_each_other():
    t = LeaseTable()
    a, b, c = same_group(3)
    t.hold(a)
    t.hold(b)
    t.end(a)
    p = page(t, a)
    assert state(a, p) is LeaseState.ENDED
    assert state(b, p) is LeaseState.HELD
    assert state(c, p) is LeaseState.UNKNOWN


def test_a_full_group_leaves_the_request_unmarked_and_an_ended_slot_is_reused():
    t = LeaseTable()
    reqs = same_group(GROUP_SLOTS + 1)
    for r in reqs[:GROUP_SLOTS]:
        assert t.hold(r)
    assert not t.hold(reqs[-1])
    # unmarked: its decoder never finds it held, so never takes its blocks
    assert state(reqs[-1], page(t, reqs[-1])) is LeaseState.UNKNOWN
    t.end(reqs[0])
    assert t.hold(reqs[-1])
    p = page(t, reqs[-1])
    assert state(reqs[-1], p) is LeaseState.HELD
    # the reused slot held the first one's tombstone: a late decoder of it finds nothing
    assert state(reqs[0], p) is LeaseState.UNKNOWN


def test_tags_and_tombstones_are_never_empty():
    for i in range(1000):
        t = tag(f"x{i}")
        assert t & 3 == 3 and t & ~1 != 0


def test_a_page_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError):
        state("a", bytes(PAGE_BYTES - 1))
