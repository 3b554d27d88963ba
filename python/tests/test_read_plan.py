"""``kvbridge.ReadPlanner``: kvbridge-pd's layout translation through the binding. The
planner's own properties (every wanted byte once, nothing else, fewest reads) are proven by
kvbridge-pd's property tests; these prove the binding: layouts in, reads out that move the
right bytes of vLLM CPU's layout between different TP, and typed refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvbridge

HEADS, HEAD_DIM, BLOCK, BLOCKS = 2, 4, 8, 6
ELEMENT = 2  # bf16


def layout(tp_rank: int, tp_size: int, **over) -> str:
    # vLLM CPU: each layer its own tensor [blocks, heads, block_size, 2 * head_size]: a
    # plane per layer, heads outermost in a block, then tokens, then K and V
    doc = dict(
        model="tiny", layers=2, total_kv_heads=HEADS, head_dim=HEAD_DIM, mla=False, dtype="bf16",
        block_tokens=BLOCK, block_order=["head", "token", "kv"], tp_rank=tp_rank, tp_size=tp_size,
    )  # fmt: skip
    doc.update(over)
    return json.dumps(doc)


def cache(heads: int, seed: int | None) -> np.ndarray:
    shape = (BLOCKS, heads, BLOCK, 2 * HEAD_DIM * ELEMENT)
    if seed is None:
        return np.zeros(shape, np.uint8)
    return np.random.default_rng(seed).integers(1, 255, shape, dtype=np.uint8)


def apply(reads, sources: dict[int, np.ndarray], dst: np.ndarray) -> None:
    flat = dst.reshape(-1)
    for rank, src_off, dst_off, n in reads:
        flat[dst_off : dst_off + n] = sources[rank].reshape(-1)[src_off : src_off + n]


def test_a_decoder_rank_of_tp_2_reads_its_head_from_a_tp_1_prefiller():
    planner = kvbridge.ReadPlanner(layout(0, 1), layout(1, 2))
    assert planner.source_ranks() == [0] and planner.readers_of(0) == [0, 1]
    prefiller, decoder = cache(HEADS, seed=1), cache(1, seed=None)
    reads, planes = planner.plan([4, 1], [0, 3], 2 * BLOCK)
    assert planes == 2 and len(reads) == 2  # each layer a plane: one read per block and layer
    apply(reads, {0: prefiller}, decoder)
    assert (decoder[0, 0] == prefiller[4, 1]).all() and (decoder[3, 0] == prefiller[1, 1]).all()
    assert not decoder[[1, 2, 4, 5]].any()
    assert sum(n for *_, n in reads) * planes == planner.wanted_bytes(2 * BLOCK)


def test_a_tp_1_decoder_reads_each_head_from_its_tp_2_prefiller_rank():
    planner = kvbridge.ReadPlanner(layout(0, 2), layout(0, 1))
    assert planner.source_ranks() == [0, 1]
    ranks = {0: cache(1, seed=2), 1: cache(1, seed=3)}
    decoder = cache(HEADS, seed=None)
    reads, _ = planner.plan([2], [5], BLOCK)
    apply(reads, ranks, decoder)
    assert (decoder[5, 0] == ranks[0][2, 0]).all() and (decoder[5, 1] == ranks[1][2, 0]).all()


def test_layouts_that_cannot_be_translated_are_refused_by_name():
    with pytest.raises(kvbridge.Incompatible) as e:
        kvbridge.ReadPlanner(layout(0, 1), layout(0, 1, head_dim=8))
    assert "head" in str(e.value) and "tp rank 0 of 1" in str(e.value) and e.value.step == "layout"
    with pytest.raises(ValueError, match="decoder layout"):
        kvbridge.ReadPlanner(layout(0, 1), "{")
    with pytest.raises(ValueError):
        kvbridge.ReadPlanner(layout(0, 1), layout(2, 2))  # a rank past the engine's size
    planner = kvbridge.ReadPlanner(layout(0, 1), layout(0, 1))
    with pytest.raises(ValueError):
        planner.plan([1], [1, 2], BLOCK)  # two decoder blocks for one block of tokens
