"""MHA KV between a prefill rank and a decode rank of different attention TP sizes: which
prefill ranks serve which decode rank, and the writes that move exactly the heads a decode
rank holds (no I/O; SGLang is not imported).

SGLang's MHA pool keeps one buffer per layer for K and one for V (the K buffers first); a
buffer is an array of pages of ``[page_size, heads of this rank, head_dim]`` (NHD: SGLang's
pool refuses PD with any other order). The heads split over attention TP ranks as SGLang
loads them: with ``tp <= total`` rank ``r`` holds heads ``r*h .. (r+1)*h``, ``h = total /
tp``; with more ranks than heads it holds head ``r * total / tp``, replicated (SGLang's
``compute_head_slice_params`` reads the same split).

Which prefill ranks a decode rank hears from is SGLang's own rank mapping
(``CommonKVManager._resolve_rank_mapping``, what its Mooncake backend uses): with the same
TP, rank ``r`` of each; decode TP ``k`` times the prefill's, decode rank ``r`` from prefill
rank ``r // k`` (one prefill rank writes ``k`` decode ranks, and frees its KV once all ``k``
were written); prefill TP ``k`` times the decode's, decode rank ``r`` from prefill ranks
``r*k .. (r+1)*k``, each of which reports its own status. The bytes are planned by
kvbridge-pd's planner (``kvbridge.ReadPlanner``, the one vLLM's heterogeneous TP reads
use), once per decode rank at its registration and per request from the page lists: each
head from exactly one prefill rank (a head replicated on several prefill ranks is written
by one of them; the others write only the metadata and report), and the fewest ranged ops
that move exactly the wanted heads: a token's heads are one op (they are adjacent in its
row), so a slice of a row is one op per token and buffer, and whole rows (the same heads on
both sides) one op per run of pages. Never one op per head.

Refused at the registration, with ``kvbridge.Incompatible`` naming both sides (step
``layout``): TP sizes of which neither divides the other (SGLang's mapping needs it), KV
buffers that differ in number, that are not all of one size (a draft model's KV beside the
target's), or whose pages do not split into the model's KV heads on either side; and what
kvbridge-pd's planner refuses (``kvbridge.ReadPlanner``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import kvbridge

# SGLang's --kv-cache-dtype names -> kvbridge-pd's element types; any other (``auto`` and
# the like) is described as bytes ("fp8", one byte an element): the planner moves bytes,
# and SGLang itself refuses prefill and decode servers of different KV dtypes.
_DTYPES = {"float32": ("fp32", 4), "float16": ("fp16", 2), "half": ("fp16", 2), "bfloat16": ("bf16", 2)}


@dataclass(frozen=True)
class RankPool:
    """What one rank's MHA KV pool holds, as far as slicing it needs."""

    tp_rank: int
    tp_size: int
    item_lens: Tuple[int, ...]  # bytes per page, one per KV buffer (K buffers, then V)
    page_size: int
    dtype: str  # SGLang's kv_cache_dtype string


def heads_per_rank(total_heads: int, tp_size: int) -> int:
    return max(1, total_heads // tp_size)


def prefill_ranks_of(decode_rank: int, decode_tp: int, prefill_tp: int) -> List[int]:
    """The prefill ranks decode rank ``decode_rank`` registers with and hears from
    (SGLang's rank mapping for MHA); ``ValueError`` when neither TP divides the other."""
    if decode_tp % prefill_tp and prefill_tp % decode_tp:
        raise ValueError(
            f"prefill TP {prefill_tp} and decode TP {decode_tp}: SGLang pairs ranks only when one TP size "
            "divides the other"
        )
    r = decode_rank % decode_tp
    if decode_tp >= prefill_tp:
        return [r // (decode_tp // prefill_tp)]
    k = prefill_tp // decode_tp
    return list(range(r * k, (r + 1) * k))


class HeadSlices:
    """The writes of one prefill rank into one decode rank's pages, for MHA KV of
    different TP. Made once per decode rank (its registration); raises
    ``kvbridge.Incompatible`` (step ``layout``) naming both sides when the pair cannot be
    translated."""

    def __init__(self, prefill: RankPool, decode: RankPool, total_heads: int, decode_peer: str):
        self.prefill, self.decode = prefill, decode
        self.what = (
            f"decode {decode_peer} (attention TP rank {decode.tp_rank} of {decode.tp_size}, KV pages of "
            f"{_sizes(decode.item_lens)} bytes) and this prefill (rank {prefill.tp_rank} of {prefill.tp_size}, "
            f"{_sizes(prefill.item_lens)} bytes; {total_heads} KV heads)"
        )
        try:
            self.targets = prefill_ranks_of(decode.tp_rank, decode.tp_size, prefill.tp_size)
        except ValueError as e:
            raise self._refuse(str(e)) from None
        head_bytes = self._head_bytes(total_heads)
        self.planner = self._planner(total_heads, head_bytes)
        sources = list(self.planner.source_ranks())
        if not set(sources) <= set(self.targets):
            raise self._refuse(f"its heads come from prefill ranks {sources}, SGLang pairs it with {self.targets}")
        self.writes_kv = prefill.tp_rank in sources

    def _refuse(self, why: str) -> kvbridge.Incompatible:
        return kvbridge.Incompatible(f"{self.what} cannot be paired: {why}", step="layout")

    def _head_bytes(self, total_heads: int) -> int:
        p, d = self.prefill, self.decode
        if len(p.item_lens) != len(d.item_lens) or len(p.item_lens) % 2:
            raise self._refuse(
                f"{len(p.item_lens)} KV buffers here, {len(d.item_lens)} on the decode (a K and a V buffer per layer)"
            )
        if len(set(p.item_lens)) != 1 or len(set(d.item_lens)) != 1:
            raise self._refuse("KV buffers of different page sizes (a draft model's KV beside the target's)")
        if p.page_size != d.page_size:
            raise self._refuse(f"pages of {p.page_size} tokens here, {d.page_size} on the decode")
        if total_heads <= 0:
            raise self._refuse("the prefill's KV head count is unknown (KVArgs.total_kv_head_num)")
        sides = ((p, "prefill"), (d, "decode"))
        per_token = {name: side.item_lens[0] // side.page_size for side, name in sides}
        heads = {name: heads_per_rank(total_heads, side.tp_size) for side, name in sides}
        head_bytes = per_token["prefill"] // heads["prefill"]
        for side, name in sides:
            if side.item_lens[0] != side.page_size * heads[name] * head_bytes:
                raise self._refuse(
                    f"a {name} page of {side.item_lens[0]} bytes is not {side.page_size} tokens of "
                    f"{heads[name]} heads of {head_bytes} bytes"
                )
        return head_bytes

    def _planner(self, total_heads: int, head_bytes: int) -> kvbridge.ReadPlanner:
        name, size = _DTYPES.get(self.prefill.dtype, ("fp8", 1))
        if head_bytes % size:
            name, size = "fp8", 1

        def layout(side: RankPool) -> str:
            return json.dumps(
                dict(
                    model="sglang-mha",
                    layers=len(side.item_lens) // 2,
                    total_kv_heads=total_heads,
                    head_dim=head_bytes // size,
                    mla=False,
                    dtype=name,
                    block_tokens=side.page_size,
                    block_order=["token", "head"],  # layer and K/V: one buffer each
                    tp_rank=side.tp_rank,
                    tp_size=side.tp_size,
                )
            )

        try:
            return kvbridge.ReadPlanner(layout(self.prefill), layout(self.decode))
        except (kvbridge.Incompatible, ValueError) as e:
            raise self._refuse(f"{type(e).__name__}: {e}") from None

    def ops(
        self,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        src_regions: Sequence[int],
        dst_regions: Sequence[int],
    ) -> List[Tuple[int, int, int, int, int]]:
        """This prefill rank's writes of one chunk, ``(src_region, src_off, dst_region,
        dst_off, len)``: the pages ``src_pages`` (whole pages, as SGLang sends them) into
        the decode's ``dst_pages``, the heads the decode rank holds that this rank supplies,
        in every KV buffer. Empty for a rank whose heads another one supplies."""
        if not self.writes_kv or not len(src_pages):
            return []
        tokens = len(src_pages) * self.prefill.page_size
        reads, _planes = self.planner.plan([int(x) for x in src_pages], [int(x) for x in dst_pages], tokens)
        mine = [(s, d, n) for rank, s, d, n in reads if rank == self.prefill.tp_rank]
        return [(sr, s, dr, d, n) for sr, dr in zip(src_regions, dst_regions) for s, d, n in mine]


def _sizes(item_lens: Sequence[int]) -> str:
    return "/".join(str(x) for x in sorted(set(item_lens))) or "no"
