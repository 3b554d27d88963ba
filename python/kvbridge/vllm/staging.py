"""Host staging for a KV cache in device memory (``kv_buffer_device: "cpu"``).

kvbridge moves host memory. When vLLM's KV cache lives on an accelerator, each layer gets a
host buffer with the device tensor's shape, and kvbridge registers the host buffer instead
of the device tensor, as NixlConnector does with ``kv_buffer_device: "cpu"``. The bytes move
between the two with the block copy op that vLLM's worker hands the connector
(``set_host_xfer_buffer_ops``; vLLM's ``copy_kv_blocks``, which calls the platform's
``swap_out_blocks_to_host`` / ``insert_blocks_to_device``): device to host on the
prefiller, after the forward pass that computed a request's prompt and before its blocks
are offered to decoders; host to device on the decoder, after the read and the lease check
and before the load is reported done.

vLLM 0.32's KV caches (and its platforms' copy ops) index blocks by the first dimension.
A host buffer is contiguous in the device tensor's shape, so one block is one contiguous
page, and two engines whose device tensors have the same shape and dtype get
byte-identical host pages whatever the device's physical layout. When the attention
kernel's block is smaller than vLLM's block (``num_blocks`` logical blocks, ``r *
num_blocks`` rows), kvbridge's page is one logical block (``r`` rows) and the copies move
rows ``r*b .. r*b+r-1`` for block ``b``, as NixlConnector's ``_logical_to_kernel_block_ids``.

No I/O and no kvbridge here: the worker registers :attr:`HostStaging.pages` and calls
:meth:`HostStaging.to_host` and :meth:`HostStaging.to_device`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: vLLM's ``CopyBlocksOp``: ``(src_caches, dst_caches, src_block_ids, dst_block_ids,
#: direction)`` with ``direction`` ``"d2h"`` or ``"h2d"``.
CopyBlocksOp = Callable[[dict[str, Any], dict[str, Any], list[int], list[int], str], None]

#: The ``kv_transfer_config`` value that asks for host staging.
HOST = "cpu"


class DeviceMemoryError(ValueError):
    """The KV cache is in device memory and host staging was not asked for (names the layer,
    the device and the setting to change)."""


class StagingError(RuntimeError):
    """A block copy between the KV cache and its host buffer failed (names the direction and
    the blocks)."""


def needs_staging(kv_caches: dict[str, Any], kv_buffer_device: str | None) -> bool:
    """True when the KV cache is in device memory and ``kv_buffer_device`` is ``"cpu"``;
    False when it is in host memory; :class:`DeviceMemoryError` otherwise."""
    off_host = [(name, t.device) for name, t in kv_caches.items() if t.device.type != "cpu"]
    if not off_host:
        return False
    if kv_buffer_device != HOST:
        name, device = off_host[0]
        raise DeviceMemoryError(
            f"layer {name}: KV cache on {device}, and kvbridge moves host memory only: set "
            f'"kv_buffer_device": "cpu" in --kv-transfer-config (host staging, as for NixlConnector); '
            f"it is {kv_buffer_device!r}"
        )
    return True


def rows_per_block(name: str, shape: tuple[int, ...], num_blocks: int | None) -> int:
    """How many rows (first-dimension entries) of the KV tensor make one of vLLM's blocks:
    1, or the kernel's blocks per logical block; 1 when ``num_blocks`` is unknown."""
    if num_blocks is None or num_blocks <= 0:
        return 1
    if not shape or shape[0] < num_blocks or shape[0] % num_blocks:
        raise DeviceMemoryError(
            f"layer {name}: KV cache of shape {tuple(shape)} for num_blocks={num_blocks}: its first "
            "dimension is not a whole number of blocks (a layout with blocks not first is not supported)"
        )
    return shape[0] // num_blocks


class HostStaging:
    """Host buffers for device KV caches, and the copies between them."""

    def __init__(self, device_caches: dict[str, Any], num_blocks: int | None = None):
        import torch

        self.device_caches = device_caches
        #: per layer, a contiguous host tensor of the device tensor's shape (what the copy op sees)
        self.host_caches: dict[str, Any] = {}
        #: per layer, the same memory with one of vLLM's blocks per row (what kvbridge registers)
        self.pages: dict[str, Any] = {}
        #: rows of the KV tensors per block (the same for every layer)
        self.rows = 1
        self._copy_op: CopyBlocksOp | None = None
        shared: dict[int, tuple[Any, Any]] = {}
        rows: set[int] = set()
        for name, t in device_caches.items():
            shape = tuple(t.shape)
            r = rows_per_block(name, shape, num_blocks)
            rows.add(r)
            key = t.data_ptr()
            if key not in shared:  # layers sharing one device cache share one host buffer
                host = torch.empty(shape, dtype=t.dtype, device="cpu", pin_memory=_pin(t.device))
                # one row per block: the tensor itself, so that its layout digest is the
                # same as a host KV cache of that shape (vLLM CPU's)
                pages = host if r == 1 else host.view(shape[0] // r, r, *shape[1:])
                shared[key] = (pages, host)
            self.pages[name], self.host_caches[name] = shared[key]
        if len(rows) > 1:
            raise DeviceMemoryError(f"KV layers with different rows per block {sorted(rows)} are not supported")
        self.rows = rows.pop() if rows else 1
        total = sum(h.numel() * h.element_size() for _, h in shared.values())
        log.info(
            "kvbridge: host staging for %d KV layers on %s: %.2f GiB of host buffers",
            len(device_caches),
            next(iter(device_caches.values())).device if device_caches else "?",
            total / 2**30,
        )

    def set_copy_op(self, op: CopyBlocksOp) -> None:
        self._copy_op = op

    def to_host(self, block_ids: list[int]) -> None:
        """Copies blocks device -> host; returns once they are in host memory."""
        self._copy(self.device_caches, self.host_caches, block_ids, "d2h")
        if block_ids:
            with _sync_allowed():
                _synchronize(next(iter(self.device_caches.values())).device)

    def to_device(self, block_ids: list[int]) -> None:
        """Copies blocks host -> device, on the calling thread's stream (vLLM's worker thread
        calls it between steps, so the next forward pass is ordered after it)."""
        self._copy(self.host_caches, self.device_caches, block_ids, "h2d")

    def _copy(self, src: dict[str, Any], dst: dict[str, Any], block_ids: list[int], direction: str) -> None:
        if not block_ids:
            return
        if self._copy_op is None:
            raise StagingError(
                f"{direction} copy of {len(block_ids)} blocks: no block copy op (vLLM did not call "
                "set_host_xfer_buffer_ops on the connector)"
            )
        r = self.rows
        ids = [b * r + i for b in block_ids for i in range(r)] if r > 1 else list(block_ids)
        try:
            with _sync_allowed():
                self._copy_op(src, dst, ids, ids, direction)
        except Exception as e:
            raise StagingError(
                f"{direction} copy of blocks {_span(ids)} failed: {type(e).__name__}: {e}"
            ) from e


def _sync_allowed():
    """vLLM's marker for a deliberate device sync (its sync debugging mode reports others)."""
    try:
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    except ImportError:
        import contextlib

        return contextlib.nullcontext()
    return gpu_sync_allowed()


def _pin(device: Any) -> bool:
    """Page-locked host buffers where the device copies from them asynchronously (CUDA)."""
    if getattr(device, "type", None) != "cuda":
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _synchronize(device: Any) -> None:
    """Waits for the device's queued work (the copy) to finish; nothing on the host."""
    if getattr(device, "type", "cpu") == "cpu":
        return
    import torch

    sync = getattr(getattr(torch, device.type, None), "synchronize", None)
    if sync is not None and getattr(getattr(torch, device.type, None), "is_available", lambda: False)():
        sync(device)


def _span(ids: list[int]) -> str:
    return str(ids) if len(ids) <= 8 else f"{ids[:8]} and {len(ids) - 8} more"
