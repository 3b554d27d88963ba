"""A rank's KV cache description (layout.py) and the "done" notices (done_notices.py): what
each side derives and what a hostile or broken peer's bytes do to them."""

from __future__ import annotations

import pytest

from kvbridge.vllm.done_notices import MAX_RANKS, DoneCounts, Notice, decode, encode
from kvbridge.vllm.layout import ModelFacts, describe

FACTS = ModelFacts(model="tiny", total_kv_heads=4, head_size=32, mla=False, block_size=16)


def cpu_layer(heads: int, tokens: int = 16, head: int = 32, dtype: str = "torch.bfloat16", pad: int = 0):
    shape = (heads, tokens, 2 * head)
    return ("l0", shape, dtype, heads * tokens * 2 * head * 2 + pad)


@pytest.mark.parametrize("tp_size,heads", [(1, 4), (2, 2), (4, 1), (8, 1)])
def test_vllm_cpu_layout_is_described_per_rank(tp_size, heads):
    got = describe([cpu_layer(heads)], FACTS, tp_size - 1, tp_size)
    assert got.tp is not None, got.why_not
    assert got.tp["block_order"] == ["head", "token", "kv"] and got.tp["total_kv_heads"] == 4
    assert (got.tp["tp_rank"], got.tp["tp_size"], got.tp["block_tokens"]) == (tp_size - 1, tp_size, 16)
    assert got.dtype == "torch.bfloat16" and "tp=" in got.pages


def test_mla_layout_is_one_latent_per_token():
    facts = ModelFacts(model="ds", total_kv_heads=1, head_size=576, mla=True, block_size=16)
    got = describe([("l0", (16, 576), "torch.bfloat16", 16 * 576 * 2)], facts, 0, 2)
    assert got.tp is not None and got.tp["mla"] and got.tp["total_kv_heads"] == 1


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


def test_a_notice_round_trips_and_malformed_ones_are_ignored():
    assert decode(encode(3, 2, "req with spaces")) == Notice(3, 2, "req with spaces")
    for bad in [
        b"kvbridge-vllm/2 done ",
        b"kvbridge-vllm/2 done 1 2 ",
        b"kvbridge-vllm/2 done x 2 r",
        b"kvbridge-vllm/2 done 1 0 r",  # waits for no rank
        b"kvbridge-vllm/2 done -1 1 r",
        b"kvbridge-vllm/2 done 1 " + str(MAX_RANKS + 1).encode() + b" r",
        b"kvbridge-vllm/2 done " + b"9" * 10_000 + b" 1 r",
        b"kvbridge-vllm/1 done r",  # the previous protocol's
        b"\xff" * 64,
    ]:
        assert decode(bad) is None, bad


def test_done_counts_wait_for_every_expected_rank_and_are_bounded():
    c = DoneCounts(keep_s=10.0, max_early=3)
    c.add(Notice(0, 2, "a"), now=0.0)
    c.add(Notice(0, 2, "a"), now=0.1)  # the same rank twice counts once
    assert not c.complete("a")
    c.add(Notice(1, 2, "a"), now=0.2)
    assert c.complete("a")
    # a flood of notices for requests never held keeps at most max_early, oldest dropped
    for i in range(10):
        c.add(Notice(0, 1, f"x{i}"), now=1.0)
    assert len(c) == 3 and not c.complete("a") and c.complete("x9")
    c.expire(now=11.5)
    assert len(c) == 0


def test_pipeline_parallelism_is_refused_at_startup():
    from kvbridge.vllm.config import ConfigError, settings_from
    from vllm_helpers import vllm_config

    cfg = vllm_config("kv_consumer")
    cfg.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        settings_from(cfg)
