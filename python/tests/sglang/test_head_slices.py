"""MHA KV between attention TP sizes, planned (head_slices.py) and held against SGLang's own
code: its rank mapping (``CommonKVManager._resolve_rank_mapping``) and the head slices its
Mooncake backend writes (``compute_head_slice_params``); and the refusals, each a
``kvbridge.Incompatible`` naming both sides."""

import itertools
from types import SimpleNamespace

import pytest
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.common.staging_buffer import compute_head_slice_params

import kvbridge
from kvbridge.sglang.head_slices import HeadSlices, RankPool, prefill_ranks_of

PAGE = 4
HEAD = 16  # bytes of one head of one token
TP_PAIRS = [(p, d) for p, d in itertools.product((1, 2, 4, 8), repeat=2) if p != d]
HEADS = (1, 2, 4, 8)


def sglang_targets(prefill_tp, decode_tp, decode_rank):
    """SGLang's own rank mapping for an MHA decode rank, run on its code."""
    mgr = SimpleNamespace(
        is_mla_backend=False, is_hybrid_mla_backend=False, attn_tp_size=decode_tp, attn_cp_size=1, attn_cp_rank=0,
        pp_size=1, pp_rank=0, kv_args=SimpleNamespace(engine_rank=decode_rank), enable_all_cp_ranks_for_transfer=False,
    )  # fmt: skip
    info = SimpleNamespace(
        attn_tp_size=prefill_tp, attn_cp_size=1, pp_size=1, enable_kv_cache_sharding=False,
        enable_dsa_cache_layer_split=False,
    )  # fmt: skip
    CommonKVManager._resolve_rank_mapping(mgr, info)
    return info.target_tp_ranks, info.required_prefill_response_num


def pool(rank, tp, heads, head=HEAD, buffers=4, dtype="float16"):
    per = max(1, heads // tp)
    return RankPool(rank, tp, (PAGE * per * head,) * buffers, PAGE, dtype)


def test_the_prefill_ranks_of_a_decode_rank_are_sglangs():
    for ptp, dtp in TP_PAIRS + [(1, 1), (4, 4)]:
        for d in range(dtp):
            targets, responses = sglang_targets(ptp, dtp, d)
            assert prefill_ranks_of(d, dtp, ptp) == targets, (ptp, dtp, d)
            assert responses == len(targets)  # every one of them reports


def token_blocks(ptp, dtp, heads, p, d):
    """Prefill rank p's writes of one page (5 -> 9) of one buffer into decode rank d, as
    ``(token, first source head, first destination head, heads)`` per token."""
    row_p, row_d = max(1, heads // ptp) * HEAD, max(1, heads // dtp) * HEAD
    s = HeadSlices(pool(p, ptp, heads), pool(d, dtp, heads), heads, "decode-x")
    out = set()
    for _, src, _, dst, n in s.ops([5], [9], [100], [200]):
        src, dst = src - 5 * PAGE * row_p, dst - 9 * PAGE * row_d
        if n == PAGE * row_p == PAGE * row_d:  # whole rows, the page in one op
            out |= {(t, 0, 0, row_p // HEAD) for t in range(PAGE)}
            continue
        assert n % HEAD == 0 and n < PAGE * min(row_p, row_d), n  # a part of a row: one token
        (ts, hs), (td, hd) = divmod(src, row_p), divmod(dst, row_d)
        assert ts == td and hs % HEAD == 0 and hd % HEAD == 0
        out.add((ts, hs // HEAD, hd // HEAD, n // HEAD))
    return out


@pytest.mark.parametrize("ptp,dtp", TP_PAIRS)
def test_each_head_lands_where_sglangs_mooncake_backend_puts_it_once(ptp, dtp):
    for heads, d in itertools.product(HEADS, range(dtp)):
        covered = []
        for p in prefill_ranks_of(d, dtp, ptp):
            got = token_blocks(ptp, dtp, heads, p, d)
            if not got:
                continue  # a replica of heads another prefill rank writes
            src_head, count, dst_head, _ = compute_head_slice_params(ptp, dtp, p, d, heads)
            assert got == {(t, src_head, dst_head, count) for t in range(PAGE)}, (heads, p, d, got)
            covered += range(dst_head, dst_head + count)
        # every head of the decode rank's row, each from one prefill rank
        assert sorted(covered) == list(range(max(1, heads // dtp))), (heads, d, covered)


def test_ops_are_one_per_token_and_buffer_not_per_head():
    s = HeadSlices(pool(0, 1, 8), pool(1, 2, 8), 8, "decode-x")
    ops = s.ops([1, 2, 3], [7, 8, 9], [10, 11, 12, 13], [20, 21, 22, 23])
    assert len(ops) == 3 * PAGE * 4  # pages * tokens * buffers: 4 heads a token in one op
    assert {n for *_, n in ops} == {4 * HEAD}
    same = HeadSlices(pool(0, 4, 2), pool(0, 2, 2), 2, "decode-x")  # one head a rank on both sides
    assert len(same.ops([1, 2, 3], [7, 8, 9], [10], [20])) == 1  # whole rows: one run of pages


@pytest.mark.parametrize(
    "prefill,decode,heads,why",
    [
        (pool(0, 2, 6), pool(0, 3, 6), 6, "one TP size divides the other"),
        (pool(0, 1, 4), pool(0, 2, 4, head=2 * HEAD), 4, "a decode page of 256 bytes is not 4 tokens of 2 heads of 16 bytes"),
        (pool(0, 1, 4), pool(0, 2, 4, buffers=6), 4, "4 KV buffers here, 6 on the decode"),
        (RankPool(0, 1, (256, 256, 128, 128), PAGE, "float16"), pool(0, 2, 4), 4, "different page sizes"),
        (pool(0, 1, 4), RankPool(0, 2, (256,) * 4, 8, "float16"), 4, "pages of 4 tokens here, 8"),
        (pool(0, 1, 4), pool(0, 2, 4), 0, "KV head count is unknown"),
    ],
)
def test_what_cannot_be_translated_is_refused_naming_both_sides(prefill, decode, heads, why):
    with pytest.raises(kvbridge.Incompatible) as e:
        HeadSlices(prefill, decode, heads, "decode-x")
    text = str(e.value)
    assert why in text and "decode decode-x (attention TP rank" in text and "this prefill (rank 0 of" in text, text
    assert e.value.step == "layout"
