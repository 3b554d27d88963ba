"""End-to-end integrity of the KV a decoder loads: digests computed on the prefiller over
the blocks it holds for a decoder, compared on the decoder over the bytes that landed.

A transport that hands over wrong bytes (a flipped bit in a NIC, a faulty copy, a bad
mapping) is otherwise silent: the load completes and the decode runs on garbage. With
digests such a load fails with cause ``integrity`` and vLLM's ``kv_load_failure_policy``
applies (``recompute`` computes the prompt instead).

The unit is a *chunk*: the prefiller's contiguous bytes of one KV head in one block (vLLM
CPU's layout keeps each head's K and V together), or the whole block where there are no
heads to cut (MLA, and caches read as whole pages). Every read of the decoder's plan covers
whole chunks of the prefiller's blocks, so each chunk read is checked whatever the two TP
sizes. A chunk's digest covers every KV layer: XXH3-64 (``kvbridge.digest``) of the
little-endian 64-bit digests of the chunk on each layer, the layers in the order of their
names.

The prefiller's table holds one 64-bit digest per chunk of its cache, row ``k`` for the
chunk at byte ``k * chunk_bytes`` of a layer's region. It writes a request's rows before it
marks the request held in its lease table (lease_table.py). A decoder reads the rows of the
chunks it reads in the same batch as the chunks (no extra round trip), and compares them
once its lease check found the request held. Rows read before the mark may still be those
of a block's previous request: a chunk that differs is read again, after the mark, and only
a second difference fails the load.

No I/O here: the worker registers :attr:`DigestTable.memory` and reads the rows.
"""

from __future__ import annotations

import array
import ctypes
import struct
import sys
from dataclasses import dataclass, field

import kvbridge

ROW_BYTES = 8
_ROW = struct.Struct("<Q")


def _address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) if buf else 0


def over_layers(per_layer: list[int], layers: int) -> list[int]:
    """Each chunk's digest over the layers, from ``layers`` consecutive per-layer digests
    per chunk."""
    if not per_layer:
        return []
    packed = array.array("Q", per_layer)
    if sys.byteorder != "little":
        packed.byteswap()
    buf = bytearray(packed.tobytes())
    step = layers * ROW_BYTES
    base = _address(buf)
    return kvbridge.digest_ranges([(base + i * step, step) for i in range(len(per_layer) // layers)])


def chunk_digests(bases: list[int], offsets: list[int], chunk_bytes: int) -> list[int]:
    """The digest over every layer (``bases``: each layer's first byte, in the order of
    the layers' names) of the chunk at each of ``offsets`` in a layer."""
    ranges = [(base + off, chunk_bytes) for off in offsets for base in bases]
    return over_layers(kvbridge.digest_ranges(ranges), len(bases))


def chunks_per_block(layout_tp: dict | None, block_shape: tuple) -> int:
    """Chunks in a block: its KV heads in a layout translated per head (vLLM CPU's), else 1."""
    if layout_tp is None or layout_tp.get("mla"):
        return 1
    return max(1, int(block_shape[0]))


class DigestTable:
    """The prefiller's rows. One owner: the worker thread that runs vLLM's steps."""

    def __init__(self, blocks: int, chunks: int, page_bytes: int):
        if chunks < 1 or page_bytes % chunks:
            raise ValueError(f"{chunks} chunks do not divide a {page_bytes}-byte block")
        self.blocks = blocks
        self.chunks = chunks
        self.chunk_bytes = page_bytes // chunks
        self.memory = bytearray(max(1, blocks * chunks) * ROW_BYTES)

    def record(self, bases: list[int], block_ids: list[int]) -> None:
        """Writes the rows of every chunk of ``block_ids`` (call before the request is
        marked held; blocks outside the cache raise ``ValueError``)."""
        blocks = sorted(set(block_ids))
        if blocks and not (0 <= blocks[0] and blocks[-1] < self.blocks):
            raise ValueError(f"block ids {blocks[0]}..{blocks[-1]} outside a cache of {self.blocks} blocks")
        rows = [b * self.chunks + c for b in blocks for c in range(self.chunks)]
        for k, d in zip(rows, chunk_digests(bases, [k * self.chunk_bytes for k in rows], self.chunk_bytes)):
            _ROW.pack_into(self.memory, k * ROW_BYTES, d)


@dataclass
class RankCheck:
    """What a decoder checks of one prefiller rank's reads: runs of chunks ``(first row,
    count, where the first lands in a local layer)`` and where their rows land in the
    scratch (``rows_at``: byte offset of the first run's first row)."""

    runs: list[tuple[int, int, int]] = field(default_factory=list)
    rows_at: int = 0
    # reads that do not cover whole chunks of the prefiller's blocks: not checked
    partial: int = 0

    @property
    def rows(self) -> int:
        return sum(n for _, n, _ in self.runs)


def plan(reads: list[tuple[int, int, int]], unit: int, chunk_bytes: int, rows_at: int) -> RankCheck:
    """The check of a rank's ``reads`` (``(src, dst, len)`` in units of ``unit`` bytes, the
    same on every layer) against chunks of ``chunk_bytes``."""
    check = RankCheck(rows_at=rows_at)
    for src, dst, n in reads:
        s, d, length = src * unit, dst * unit, n * unit
        if s % chunk_bytes or length % chunk_bytes:
            check.partial += 1
            continue
        check.runs.append((s // chunk_bytes, length // chunk_bytes, d))
    return check


def row_ops(check: RankCheck, scratch_region: int, remote_rows: int) -> list[tuple[int, int, int, int, int]]:
    """The reads that bring the rows of ``check``'s chunks into the scratch."""
    ops = []
    at = check.rows_at
    for first, n, _ in check.runs:
        ops.append((scratch_region, at, remote_rows, first * ROW_BYTES, n * ROW_BYTES))
        at += n * ROW_BYTES
    return ops


def differing(check: RankCheck, bases: list[int], chunk_bytes: int, scratch: bytes | bytearray) -> list[int]:
    """The rows of ``check`` whose chunk, as it landed (``bases``: each local layer's first
    byte, in the order of the layers' names), differs from the digest read."""
    offsets = [d + i * chunk_bytes for _, n, d in check.runs for i in range(n)]
    got = chunk_digests(bases, offsets, chunk_bytes)
    rows = [first + i for first, n, _ in check.runs for i in range(n)]
    out = []
    for i, (row, digest) in enumerate(zip(rows, got)):
        (want,) = _ROW.unpack_from(scratch, check.rows_at + i * ROW_BYTES)
        if want != digest:
            out.append(row)
    return out
