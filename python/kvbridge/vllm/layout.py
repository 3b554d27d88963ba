"""What one TP rank's KV cache looks like, as the two sides exchange it in the directory.

Two descriptions travel: the ``pages`` string (every layer's block shape, dtype and page
size, equal on two ranks exactly when their pages are byte for byte the same), and, where
the attention backend's layout is one kvbridge-pd can translate, the rank's ``TpLayout``
(model, layers, KV heads, head size, dtype, tokens per block, the order of the dimensions
inside a block, TP rank and size). With both sides' ``TpLayout`` a decoder rank plans
ranged reads across different TP sizes and block sizes (``kvbridge.ReadPlanner``); with
only ``pages`` it reads whole pages from the prefiller rank of its own number, which needs
the same TP size and equal pages.

Layouts translated (each layer one tensor, blocks first, contiguous):

- vLLM CPU's attention (``CPU_ATTN``): ``[blocks, kv_heads, block_size, 2 * head_size]``,
  which the kernel reads as ``[blocks, kv_heads, 2 * block_size, head_size]``: per head, the
  block's K and then its V. Inside K the head size runs outside the tokens (K is stored
  transposed, tiled by the CPU's instruction set; V is plain on some), so a block's tokens
  are not rows a ranged read can cut: heads translate (each head's K and V are one
  contiguous range), block sizes do not (``token_rows`` False). Order ``head, kv, token``;
- MLA (``CPU_MLA`` and the MLA backends): one latent (``kv_lora_rank + qk_rope_head_dim``)
  per token, replicated on every rank: order ``kv, token, head`` with one of each. vLLM 0.32
  hands every layer over as its ``[blocks, heads, tokens, content]`` view, so MLA's block is
  ``[1, block_size, latent]`` (an older ``[block_size, latent]`` is read the same). vLLM
  CPU's MLA writes a token's latent as one row (``CPUMLAImpl.do_kv_cache_update``), but it
  forces blocks of 16 tokens on both sides, so block sizes never differ there and are not
  translated (``token_rows`` stays False).

No I/O here: the worker calls :func:`describe` once its KV caches are registered.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

#: torch dtype name -> kvbridge-pd's ``Dtype`` and its bytes per element.
DTYPES = {
    "torch.float32": ("fp32", 4),
    "torch.float16": ("fp16", 2),
    "torch.bfloat16": ("bf16", 2),
    "torch.float8_e4m3fn": ("fp8", 1),
    "torch.float8_e5m2": ("fp8", 1),
}


@dataclass(frozen=True)
class ModelFacts:
    """What vLLM's model config says about the KV cache, per engine."""

    model: str
    total_kv_heads: int
    head_size: int
    mla: bool
    block_size: int  # vLLM's (logical) block, in tokens

    @staticmethod
    def of(vllm_config: Any) -> ModelFacts:
        mc = vllm_config.model_config
        return ModelFacts(
            model=str(getattr(mc, "model", "?")),
            total_kv_heads=int(mc.get_total_num_kv_heads()),
            head_size=int(mc.get_head_size()),
            mla=bool(getattr(mc, "use_mla", False)),
            block_size=int(vllm_config.cache_config.block_size),
        )


@dataclass(frozen=True)
class RankLayout:
    """One rank's description: ``pages`` always, ``tp`` (a ``TpLayout`` as a dict) when the
    cache's layout is one kvbridge-pd translates, else ``why_not`` says what is not."""

    pages: str
    tp: dict | None
    why_not: str = ""
    # torch's name of the element type: kvbridge-pd's ``fp8`` covers two of them
    dtype: str = ""
    # a block's tokens are rows that ranged reads may cut, so blocks of another size
    # translate (none of vLLM CPU's layouts: see the module's docs)
    token_rows: bool = False

    def tp_json(self) -> str | None:
        return None if self.tp is None else json.dumps(self.tp, sort_keys=True)


def pages_description(layers: list[tuple[str, tuple, str, int]], block_size: int, model: str, tp: int) -> str:
    """Equal on two ranks exactly when their blocks are byte for byte the same pages."""
    detail = json.dumps([list(x) for x in layers], separators=(",", ":"))
    digest = hashlib.sha256(detail.encode()).hexdigest()[:16]
    page_bytes = sorted({x[3] for x in layers})
    return (
        f"model={model} block_size={block_size} tp={tp} layers={len(layers)} "
        f"page_bytes={page_bytes} layout={digest}"
    )


def heads_on_rank(total: int, tp_size: int) -> int:
    """KV heads one rank holds, as vLLM splits them (replicated when ranks outnumber them)."""
    return max(1, total // tp_size)


def describe(
    layers: list[tuple[str, tuple, str, int]], facts: ModelFacts, tp_rank: int, tp_size: int
) -> RankLayout:
    """``layers``: ``(name, block shape, dtype, page bytes)`` per KV layer, as registered."""
    pages = pages_description(layers, facts.block_size, facts.model, tp_size)
    tp, why_not = _tp_layout(layers, facts, tp_rank, tp_size)
    dtypes = sorted({dtype for _, _, dtype, _ in layers})
    return RankLayout(pages, tp, why_not, ",".join(dtypes))


def _tp_layout(
    layers: list[tuple[str, tuple, str, int]], facts: ModelFacts, tp_rank: int, tp_size: int
) -> tuple[dict | None, str]:
    if not layers:
        return None, "no KV layers"
    shapes = {(shape, dtype, page) for _, shape, dtype, page in layers}
    if len(shapes) != 1:
        return None, f"the layers' blocks differ ({len(shapes)} shapes)"
    ((shape, dtype, page),) = shapes
    if dtype not in DTYPES:
        return None, f"dtype {dtype} is not one kvbridge-pd names"
    name, element = DTYPES[dtype]
    if facts.mla:
        # [1, block_size, latent] (vLLM 0.32's [heads, tokens, content] view of a block, one
        # head) or [block_size, latent]
        latent = shape[1:] if len(shape) == 3 and shape[0] == 1 else shape
        if len(latent) != 2 or latent[1] != facts.head_size:
            return None, f"MLA block shape {shape} is not [1, tokens, {facts.head_size}]"
        tokens, order, heads = latent[0], ["kv", "token", "head"], 1
    else:
        local = heads_on_rank(facts.total_kv_heads, tp_size)
        if len(shape) != 3 or shape[0] != local or shape[2] != 2 * facts.head_size:
            return None, (
                f"block shape {shape} is not vLLM CPU's [kv_heads={local}, tokens, 2 * head_size="
                f"{2 * facts.head_size}]"
            )
        tokens, order, heads = shape[1], ["head", "kv", "token"], facts.total_kv_heads
    if tokens != facts.block_size:
        return None, f"the kernel's block ({tokens} tokens) is not vLLM's block ({facts.block_size})"
    elements = 1
    for n in shape:
        elements *= n
    if page != elements * element:
        return None, f"a page of {page} bytes holds a block of {elements * element} bytes (padded blocks)"
    return (
        dict(
            model=facts.model,
            layers=len(layers),
            total_kv_heads=heads,
            head_dim=facts.head_size,
            mla=facts.mla,
            dtype=name,
            block_tokens=tokens,
            block_order=order,
            tp_rank=tp_rank,
            tp_size=tp_size,
        ),
        "",
    )
