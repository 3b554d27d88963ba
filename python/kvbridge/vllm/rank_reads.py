"""Which prefiller ranks a decoder rank reads a request from, what it reads from each, and
which ranks it tells when it is done. No I/O: the worker turns the answer into one batch of
reads per prefiller rank.

Two ways to read, chosen per prefiller engine from both ranks' layouts (layout.py):

- **translated**: both sides described a ``TpLayout``. kvbridge-pd's ``ReadPlanner`` gives
  the fewest ranged reads for any pair of TP sizes and block sizes; a decoder rank reads from
  the prefiller ranks that hold its heads (MLA: from one rank, never twice);
- **pages**: a side's layout is one kvbridge-pd does not describe (a device layout staged to
  host memory, say). Equal pages and equal TP sizes still move: rank ``r`` reads whole blocks
  from prefiller rank ``r``.

"Done" notices: every prefiller rank must hear from the decoder ranks that read from it
before it frees a request's blocks; a rank nobody reads from (MLA's replicas) hears from one
decoder rank, so that it frees them too instead of waiting out its lease. Each notice says
how many decoder ranks the prefiller rank waits for, as NixlConnector's does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import kvbridge


class Refused(ValueError):
    """Two ranks' layouts cannot be translated (names both)."""


@dataclass(frozen=True)
class RankReads:
    """A request's reads on one decoder rank: per prefiller rank, ``(src, dst, len)`` byte
    ranges of one plane, issued on every layer (``unit`` 1); or, reading pages, block runs
    ``(src block, dst block, count)`` (``unit`` 0: each layer's page size)."""

    by_rank: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    pages: bool = False


def synthetic_prefiller(decoder_tp: dict, prefiller_tp_size: int) -> str:
    """A prefiller layout with the decoder's own shape and the prefiller's TP size: which
    ranks hold which heads depends on the sizes alone, so this answers "which ranks" before
    any prefiller directory is read."""
    return json.dumps({**decoder_tp, "tp_rank": 0, "tp_size": prefiller_tp_size}, sort_keys=True)


def notice_ranks(planner: kvbridge.ReadPlanner, decoder_rank: int, decoder_tp: int, prefiller_tp: int) -> dict[int, int]:
    """The prefiller ranks ``decoder_rank`` tells it is done -> how many decoder ranks each
    of those waits for. Every decoder rank computes the same table."""
    out: dict[int, int] = {}
    for p in range(prefiller_tp):
        tellers = planner.readers_of(p) or [p % decoder_tp]
        if decoder_rank in tellers:
            out[p] = len(tellers)
    return out


def clip(reads: list[tuple[int, int, int, int]], skip: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """``reads`` (rank, src, dst, len) less the bytes that land in the ``skip`` ranges of the
    destination (``(start, end)``, disjoint): the blocks of the decoder's own prefix-cache
    hit, which are never written. A read is contiguous on both sides, so a piece keeps its
    offset on both."""
    if not skip:
        return reads
    skip = sorted(skip)
    out = []
    for rank, src, dst, n in reads:
        pieces = [(dst, dst + n)]
        for s0, s1 in skip:
            nxt = []
            for a, b in pieces:
                if s1 <= a or b <= s0:
                    nxt.append((a, b))
                    continue
                if a < s0:
                    nxt.append((a, s0))
                if s1 < b:
                    nxt.append((s1, b))
            pieces = nxt
        out.extend((rank, src + (a - dst), a, b - a) for a, b in pieces)
    return out


def translated(
    planner: kvbridge.ReadPlanner,
    block_bytes: int,
    prefiller_block_tokens: int,
    decoder_block_tokens: int,
    remote_blocks: list[int],
    hit_blocks: list[int],
    local_blocks: list[int],
    prompt_tokens: int,
) -> RankReads:
    """The reads that bring a request's prompt into ``local_blocks``, the decoder's blocks
    after its own prefix-cache hit ``hit_blocks``. Reads whole blocks where both sides'
    blocks allow (rows past the prompt are never read by attention), never into a hit
    block. :class:`Refused`-free: a request the prefiller's blocks do not cover raises
    ``ValueError`` (bad parameters)."""
    dst_all = hit_blocks + local_blocks
    have = len(remote_blocks) * prefiller_block_tokens
    if have < prompt_tokens:
        raise ValueError(
            f"the prefiller offers {len(remote_blocks)} blocks of {prefiller_block_tokens} tokens for a "
            f"{prompt_tokens}-token prompt"
        )
    # whole decoder blocks of the prompt where the prefiller's blocks reach that far
    whole = -(-prompt_tokens // decoder_block_tokens) * decoder_block_tokens
    tokens = min(have, len(dst_all) * decoder_block_tokens, whole)
    if tokens < prompt_tokens:
        raise ValueError(
            f"{len(dst_all)} decoder blocks of {decoder_block_tokens} tokens for a {prompt_tokens}-token prompt"
        )
    src = remote_blocks[: -(-tokens // prefiller_block_tokens)]
    dst = dst_all[: -(-tokens // decoder_block_tokens)]
    if tokens % decoder_block_tokens and prefiller_block_tokens == decoder_block_tokens:
        raise ValueError(f"{tokens} tokens do not fill whole blocks of {decoder_block_tokens}")
    reads, _planes = planner.plan(src, dst, tokens)
    reads = clip(reads, [(b * block_bytes, (b + 1) * block_bytes) for b in hit_blocks])
    by_rank: dict[int, list[tuple[int, int, int]]] = {}
    for rank, s, d, n in reads:
        by_rank.setdefault(rank, []).append((s, d, n))
    return RankReads(by_rank)


def whole_pages(rank: int, remote_blocks: list[int], hit: int, local_blocks: list[int]) -> RankReads:
    """Reading pages: block ``hit + i`` of the prefiller into ``local_blocks[i]``, adjacent
    blocks in one run."""
    if len(remote_blocks) < hit + len(local_blocks):
        raise ValueError(f"the prefiller offers {len(remote_blocks)} blocks for {hit + len(local_blocks)} here")
    remote = remote_blocks[hit : hit + len(local_blocks)]
    runs: list[tuple[int, int, int]] = []
    for lo, ro in zip(local_blocks, remote):
        if runs:
            r0, l0, n = runs[-1]
            if lo == l0 + n and ro == r0 + n:
                runs[-1] = (r0, l0, n + 1)
                continue
        runs.append((ro, lo, 1))
    return RankReads({rank: runs}, pages=True)
