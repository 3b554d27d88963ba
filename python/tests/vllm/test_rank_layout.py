"""A rank's KV cache description (layout.py) and the "done" notices (done_notices.py): what
each side derives and what a hostile or broken peer's bytes do to them."""

from __future__ import annotations

import pytest

from kvbridge.vllm.done_notices import MAX_GRANTS, MAX_RANKS, DoneCounts, Notice, decode, encode
from kvbridge.vllm.layout import ModelFacts, describe

FACTS = ModelFacts(model="tiny", total_kv_heads=4, head_size=32, mla=False, block_size=16)


def cpu_layer(heads: int, tokens: int = 16, head: int = 32, dtype: str = "torch.bfloat16", pad: int = 0):
    shape = (heads, tokens, 2 * head)
    return ("l0", shape, dtype, heads * tokens * 2 * head * 2 + pad)


@pytest.mark.parametrize("tp_size,heads", [(1, 4), (2, 2), (4, 1), (8, 1)])
def test_vllm_cpu_layout_is_described_per_rank(tp_size, heads):
    got = describe([cpu_layer(heads)], FACTS, tp_size - 1, tp_size)
    assert got.tp is not None, got.why_not
    assert got.tp["block_order"] == ["head", "kv", "token"] and got.tp["total_kv_heads"] == 4
    assert not got.token_rows  # K is stored transposed inside a block
    assert (got.tp["tp_rank"], got.tp["tp_size"], got.tp["block_tokens"]) == (tp_size - 1, tp_size, 16)
    assert got.dtype == "torch.bfloat16" and "tp=" in got.pages


MLA_FACTS = ModelFacts(model="ds", total_kv_heads=1, head_size=576, mla=True, block_size=16)


@pytest.mark.parametrize("block", [(1, 16, 576), (16, 576)], ids=["vllm-0.32-view", "3d"])
def test_mla_layout_is_one_latent_per_token(block):
    """vLLM 0.32 CPU registers MLA's cache as [blocks, 1, 16, 576] (its [B, H, N, C] view,
    one head): read as one latent per token, translated, not whole pages."""
    got = describe([("l0", block, "torch.bfloat16", 16 * 576 * 2)], MLA_FACTS, 0, 2)
    assert got.tp is not None, got.why_not
    assert got.tp["mla"] and got.tp["total_kv_heads"] == 1 and got.tp["head_dim"] == 576
    assert (got.tp["block_tokens"], got.tp["block_order"]) == (16, ["kv", "token", "head"])


@pytest.mark.parametrize("block", [(2, 16, 576), (1, 16, 512), (16, 1, 576)])
def test_an_mla_block_of_another_shape_is_read_as_whole_pages_naming_it(block):
    got = describe([("l0", block, "torch.bfloat16", 2 * 16 * 576 * 2)], MLA_FACTS, 0, 1)
    assert got.tp is None and f"MLA block shape {block}" in got.why_not


@pytest.mark.parametrize(
    "layer,why",
    [
        (cpu_layer(2), "kv_heads=4"),  # heads that are not this rank's share
        (cpu_layer(4, tokens=32), "kernel's block"),  # a kernel block inside vLLM's block
        (cpu_layer(4, pad=64), "padded"),
        (cpu_layer(4, dtype="torch.int8"), "dtype"),
        (("l0", (2, 16, 4, 32), "torch.bfloat16", 8192), "not vLLM CPU's"),  # flash-attention's
    ],
)
def test_layouts_kvbridge_pd_cannot_translate_fall_back_to_whole_pages_with_a_reason(layer, why):
    got = describe([layer], FACTS, 0, 1)
    assert got.tp is None and why in got.why_not and got.pages


def test_layers_of_different_shapes_are_not_translated():
    got = describe([cpu_layer(4), ("l1", (4, 16, 128), "torch.bfloat16", 16384)], FACTS, 0, 1)
    assert got.tp is None and "differ" in got.why_not


G = "0123456789abcdef" * 2
FORGED = "f" * 32


def test_a_notice_round_trips_and_malformed_ones_are_ignored():
    assert decode(encode(3, 2, G, "req with spaces")) == Notice(3, 2, G, "req with spaces")
    g = G.encode()
    for bad in [
        b"kvbridge-vllm/3 done ",
        b"kvbridge-vllm/3 done 1 2 ",
        b"kvbridge-vllm/3 done 1 2 " + g + b" ",
        b"kvbridge-vllm/3 done x 2 " + g + b" r",
        b"kvbridge-vllm/3 done 1 0 " + g + b" r",  # waits for no rank
        b"kvbridge-vllm/3 done -1 1 " + g + b" r",
        b"kvbridge-vllm/3 done 1 " + str(MAX_RANKS + 1).encode() + b" " + g + b" r",
        b"kvbridge-vllm/3 done " + b"9" * 10_000 + b" 1 " + g + b" r",
        b"kvbridge-vllm/3 done 1 1 " + g.upper() + b" r",  # not the grant's form
        b"kvbridge-vllm/3 done 1 1 " + g[:31] + b" r",
        b"kvbridge-vllm/3 done 1 1 r",  # no grant
        b"kvbridge-vllm/2 done 1 1 r",  # the previous protocol's
        b"\xff" * 64,
    ]:
        assert decode(bad) is None, bad


def test_done_counts_wait_for_every_expected_rank_and_are_bounded():
    c = DoneCounts(keep_s=10.0, max_early=3)
    c.add(Notice(0, 2, G, "a"), now=0.0)
    c.add(Notice(0, 2, G, "a"), now=0.1)  # the same rank twice counts once
    assert not c.complete("a", G)
    c.add(Notice(1, 2, G, "a"), now=0.2)
    assert c.complete("a", G) and not c.complete("a", None)
    # a flood of notices for requests never held keeps at most max_early, oldest dropped
    for i in range(10):
        c.add(Notice(0, 1, G, f"x{i}"), now=1.0)
    assert len(c) == 3 and not c.complete("a", G) and c.complete("x9", G)
    c.expire(now=11.5)
    assert len(c) == 0


def test_a_notice_under_another_grant_frees_nothing():
    # an insider: it holds the deployment's secret and knows the request id, not its grant
    c = DoneCounts(keep_s=10.0)
    c.add(Notice(0, 1, FORGED, "a"), now=0.0)
    assert not c.complete("a", G)
    # nor can it make the true notices wait for more ranks than they say
    c.add(Notice(1, 9, FORGED, "a"), now=0.0)
    c.add(Notice(0, 1, G, "a"), now=0.0)
    assert c.complete("a", G)
    # forged grants beyond MAX_GRANTS are dropped, not kept
    for i in range(100):
        c.add(Notice(0, 1, f"{i:032x}", "b"), now=0.0)
    assert len(c._counts["b"].by_grant) == MAX_GRANTS


def test_pipeline_parallelism_is_refused_at_startup():
    from kvbridge.vllm.config import ConfigError, settings_from
    from vllm_helpers import vllm_config

    cfg = vllm_config("kv_consumer")
    cfg.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        settings_from(cfg)


@pytest.mark.parametrize("block", [32, 64])
def test_vllm_cpu_keeps_each_heads_k_and_v_in_one_range_of_a_block_but_k_transposed(block):
    """What layout.py says of CPU_ATTN, checked against vLLM's own kernel that writes the
    cache: head h's K and V fill one contiguous range of each block (so TP translation by
    head ranges is exact), and K is not stored as one row per token (so blocks of another
    size cannot be translated by cutting rows). Checked for the instruction set vLLM picks
    on this host, and for every other one its kernel runs here."""
    torch = pytest.importorskip("torch")
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    heads, head_size, tokens = 2, 32, 5
    chosen = _get_attn_isa(torch.bfloat16, block, head_size)
    checked = []
    for isa in dict.fromkeys([chosen, "vec", "vec16", "amx"]):
        cache = torch.zeros((3, heads, block, 2 * head_size), dtype=torch.bfloat16)
        k_cache, v_cache = cache.view((3, heads, 2 * block, head_size)).chunk(2, dim=2)
        # every value names its head: 1..100 for head 0, 101..200 for head 1
        key = torch.stack([torch.arange(1, 1 + tokens * head_size).reshape(tokens, head_size) % 100 + 1 + 100 * h
                           for h in range(heads)], dim=1).to(torch.bfloat16)  # fmt: skip
        slots = torch.arange(block, block + tokens, dtype=torch.int64)  # block 1, rows 0..4
        try:
            ops.cpu_attn_reshape_and_cache(key, -key, k_cache, v_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                           kv_cache_dtype="auto")  # fmt: skip
        except (RuntimeError, NotImplementedError):
            assert isa != chosen, f"vLLM's own choice {isa} does not run"
            continue  # an instruction set vLLM never picks on this host
        per_head = block * 2 * head_size
        flat = cache[1].reshape(-1).float()
        for h in range(heads):
            mine = flat[h * per_head : (h + 1) * per_head].abs()
            in_range = (mine == 0) | ((mine > 100 * h) & (mine <= 100 * (h + 1)))
            assert in_range.all(), f"{isa}: head {h}'s range holds another head"
            assert (mine > 0).sum() == 2 * tokens * head_size, f"{isa}: head {h}'s K and V are not all in its range"
        plain_k = all(torch.equal(k_cache[1, h, t], key[t, h]) for h in range(heads) for t in range(tokens))
        assert not plain_k, f"{isa}: K is one row per token now: layout.py's token_rows may become True"
        checked.append(isa)
    assert chosen in checked
