"""Page arithmetic of one registered L1 arena, for the distributed transfer channel.

LMCache's distributed layer describes an object as ``(offset, size)`` bytes into the L1
arena that its ``L1MemoryDesc`` names; the arena is allocated in pages of
``align_bytes``. A read moves whole pages (an object's last page is moved whole, as NIXL's
page-granular descriptor lists do), and a batch becomes kvbridge byte ops
``(local_region, local_offset, remote_region, remote_offset, length)``, with runs of
objects that are contiguous on both sides merged into one op.

Everything here is pure arithmetic: it raises ``ValueError`` for an address the arena
cannot hold, before any byte moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class PagedArena:
    """One registered arena as a transfer sees it: a region id, its pages and their size."""

    region: int
    """The kvbridge region id of the arena (on the channel that registered it)."""

    length: int
    """Registered bytes: a whole number of pages."""

    page_size: int
    """Bytes per page (LMCache's ``align_bytes``)."""

    @classmethod
    def from_l1(cls, region: int, size: int, align_bytes: int) -> "PagedArena":
        """The arena an ``L1MemoryDesc`` of ``size`` bytes in ``align_bytes`` pages gives.

        A trailing partial page is left out: no object can start in it.
        """
        if align_bytes <= 0:
            raise ValueError(f"align_bytes must be positive, got {align_bytes}")
        pages = size // align_bytes
        if pages <= 0:
            raise ValueError(
                f"L1 arena of {size} bytes holds no whole page of {align_bytes} bytes"
            )
        return cls(region=region, length=pages * align_bytes, page_size=align_bytes)

    def check_object(self, offset: int, size: int, side: str) -> None:
        """Raise ``ValueError`` unless ``[offset, offset + size)`` lies in the arena."""
        if offset < 0 or size <= 0 or offset + size > self.length:
            raise ValueError(
                f"{side} object [{offset:#x}, {offset + size:#x}) is outside the "
                f"registered L1 region [0x0, {self.length:#x})"
            )

    def span(self, offset: int, size: int, side: str) -> tuple[int, int]:
        """``(offset, bytes)`` of the whole pages that hold an object.

        Raises ``ValueError`` if the object does not start on a page or leaves the arena.
        """
        self.check_object(offset, size, side)
        if offset % self.page_size != 0:
            raise ValueError(
                f"{side} object offset {offset:#x} is not aligned to the page size "
                f"{self.page_size}"
            )
        pages = -(-size // self.page_size)
        nbytes = pages * self.page_size
        # the object fits, so its last page does too: the arena is whole pages
        return offset, nbytes


def read_ops(
    local: PagedArena,
    remote: PagedArena,
    local_objects: Sequence[tuple[int, int]],
    remote_objects: Sequence[tuple[int, int]],
) -> list[tuple[int, int, int, int, int]]:
    """kvbridge ops that read each remote object into the local object at the same index.

    Both lists hold ``(offset, size)`` pairs. Raises ``ValueError`` if their lengths
    differ, if an object is not page-aligned or leaves its arena, or if a pair spans a
    different number of pages on each side.
    """
    if len(local_objects) != len(remote_objects):
        raise ValueError(
            "local_addresses and remote_addresses must have equal length "
            f"({len(local_objects)} != {len(remote_objects)})"
        )
    spans = []
    for (l_off, l_size), (r_off, r_size) in zip(local_objects, remote_objects):
        l_start, l_len = local.span(l_off, l_size, "local")
        r_start, r_len = remote.span(r_off, r_size, "remote")
        if l_len != r_len:
            raise ValueError(
                f"local object at {l_off:#x} spans {l_len // local.page_size} pages, "
                f"remote object at {r_off:#x} spans {r_len // remote.page_size}"
            )
        spans.append((l_start, r_start, l_len))
    return _merged(local.region, remote.region, spans)


def _merged(
    local_region: int, remote_region: int, spans: Iterable[tuple[int, int, int]]
) -> list[tuple[int, int, int, int, int]]:
    """One op per run of spans contiguous on both sides (in the caller's order)."""
    ops: list[list[int]] = []
    for l_start, r_start, nbytes in spans:
        if ops:
            last = ops[-1]
            if last[1] + last[4] == l_start and last[3] + last[4] == r_start:
                last[4] += nbytes
                continue
        ops.append([local_region, l_start, remote_region, r_start, nbytes])
    return [tuple(op) for op in ops]  # type: ignore[misc]
