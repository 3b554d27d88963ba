"""Page runs and the write ops of one chunk (no I/O)."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np


def page_runs(pages: np.ndarray) -> List[Tuple[int, int]]:
    """``(first, count)`` of each run of adjacent page ids, ascending, duplicates merged."""
    out: List[Tuple[int, int]] = []
    for p in sorted(set(int(x) for x in pages)):
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


def pair_runs(src: np.ndarray, dst: np.ndarray) -> List[Tuple[int, int, int]]:
    """``(src_first, dst_first, count)`` runs where both sides advance by one page."""
    out: List[Tuple[int, int, int]] = []
    for s, d in zip(src.tolist(), dst.tolist()):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def write_ops(
    src: np.ndarray,
    dst: np.ndarray,
    src_regions: Sequence[int],
    dst_regions: Sequence[int],
    item_lens: Sequence[int],
) -> List[Tuple[int, int, int, int, int]]:
    """One op per buffer and run: ``(src_region, src_off, dst_region, dst_off, len)``."""
    runs = pair_runs(src, dst)
    ops = []
    for s_reg, d_reg, item in zip(src_regions, dst_regions, item_lens):
        for s, d, n in runs:
            ops.append((s_reg, s * item, d_reg, d * item, n * item))
    return ops
