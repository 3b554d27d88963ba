"""A stand-in for an accelerator's KV cache, for the host staging tests on a CPU-only host.

Only the accelerator is mocked: :class:`StandInDeviceTensor` is ordinary host memory that
reports ``cuda:0`` as its device, so that the connector treats it as a GPU's KV cache (it
refuses it without ``kv_buffer_device: "cpu"``, stages it otherwise, and never registers
it with kvbridge). :func:`copy_blocks` stands in for vLLM's ``copy_kv_blocks`` with the
CUDA platform's ops (``dst[dst_ids] = src[src_ids]`` per layer, blocks on the first
dimension): it really copies between the stand-in tensors and the host buffers, and is the
only way bytes move between them. Everything else (channels, loopback, lease table) is real.
"""

from __future__ import annotations

import torch

from vllm_helpers import LAYERS, NUM_BLOCKS, BLOCK_SIZE

STAND_IN = torch.device("cuda", 0)


class StandInDeviceTensor(torch.Tensor):
    """Host memory that says it lives on ``cuda:0`` (see the module's docstring)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return STAND_IN


def plain(t: torch.Tensor) -> torch.Tensor:
    """The same memory as an ordinary CPU tensor."""
    return t.as_subclass(torch.Tensor)


def device_caches(seed: int | None, *, rows: int = NUM_BLOCKS, heads: int = 2, head_size: int = 32):
    """Per-layer stand-in device KV caches, ``[rows, heads, block_size, 2 * head_size]``."""
    out = {}
    for i, name in enumerate(LAYERS):
        shape = (rows, heads, BLOCK_SIZE, 2 * head_size)
        if seed is None:
            t = torch.zeros(shape, dtype=torch.bfloat16)
        else:
            t = torch.randn(shape, generator=torch.Generator().manual_seed(seed + i)).to(torch.bfloat16)
        out[name] = t.as_subclass(StandInDeviceTensor)
    return out


class CopyOps:
    """vLLM's block copy op for the stand-in device, with a record of its calls and a
    switch to make one direction fail."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []
        self.fail: str | None = None  # "d2h" or "h2d"

    def __call__(self, src, dst, src_ids, dst_ids, direction) -> None:
        self.calls.append((direction, list(src_ids)))
        if direction == self.fail:
            raise RuntimeError(f"stand-in {direction} copy refused")
        if not src_ids or len(src_ids) != len(dst_ids):
            return
        si = torch.tensor(src_ids, dtype=torch.int64)
        di = torch.tensor(dst_ids, dtype=torch.int64)
        for name in src:
            plain(dst[name])[di] = plain(src[name])[si]
