"""Makes ``transfer_channel: "kvbridge"`` work in an unmodified LMCache.

LMCache's legacy channel factory, ``lmcache.v1.transfer_channel.CreateTransferChannel``,
knows only ``"nixl"`` and ``"mock_memory"`` and has no registry. Its users import the function
by name (``from lmcache.v1.transfer_channel import CreateTransferChannel``), so ``install()``
rebinds that name in the factory's module and in every module that imported it, to a wrapper
that builds a ``KvbridgeChannel`` for ``"kvbridge"`` and calls the original for anything else.
It also hooks the PD backends' allocations so that a receiver with write windows opens the
pages it allocates to the sender that asked (``kvbridge.lmcache.alloc_windows``), and registers
kvbridge in LMCache's newer (distributed) channel registry when that part of
``kvbridge.lmcache`` is present.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import threading
import warnings
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

#: The name a user writes in LMCache's config (``transfer_channel: "kvbridge"``).
CHANNEL_NAME = "kvbridge"
#: LMCache releases this adapter was tested against (it patches LMCache internals).
TESTED_LMCACHE_VERSIONS = ("0.5.6",)
#: Modules that import ``CreateTransferChannel`` by name (the factory's own module first).
FACTORY_USERS = (
    "lmcache.v1.transfer_channel",
    "lmcache.v1.storage_backend.pd_backend",
    "lmcache.v1.storage_backend.pd_backend_async",
    "lmcache.v1.storage_backend.p2p_backend",
)

_lock = threading.Lock()
_original: Optional[Callable[..., Any]] = None
_patched: dict[str, Callable[..., Any]] = {}


class UntestedLMCacheVersion(UserWarning):
    """LMCache is a release this adapter was not tested against."""


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def CreateTransferChannel(channel_type: str, *args: Any, **kwargs: Any) -> Any:
        if channel_type == CHANNEL_NAME:
            return _create_kvbridge(*args, **kwargs)
        return original(channel_type, *args, **kwargs)

    CreateTransferChannel.__doc__ = (
        f"LMCache's CreateTransferChannel, plus channel_type={CHANNEL_NAME!r} (kvbridge)."
    )
    CreateTransferChannel.__wrapped__ = original  # type: ignore[attr-defined]
    CreateTransferChannel.kvbridge_hook = True  # type: ignore[attr-defined]
    return CreateTransferChannel


def _create_kvbridge(
    async_mode: bool,
    role: str,
    buffer_ptr: int,
    buffer_size: int,
    align_bytes: int,
    tp_rank: int,
    peer_init_url: Optional[str],
    device: Optional[str] = None,
    **kwargs: Any,
) -> Any:
    from kvbridge.lmcache.channel import KvbridgeChannel

    return KvbridgeChannel(
        async_mode=async_mode,
        role=role,
        buffer_ptr=buffer_ptr,
        buffer_size=buffer_size,
        align_bytes=align_bytes,
        tp_rank=tp_rank,
        peer_init_url=peer_init_url,
        device=device,
        **kwargs,
    )


def check_version(version: str) -> bool:
    """Whether ``version`` is a tested LMCache release; warns loudly when it is not."""
    if version in TESTED_LMCACHE_VERSIONS:
        return True
    msg = (
        f"kvbridge.lmcache was tested with LMCache {', '.join(TESTED_LMCACHE_VERSIONS)} but "
        f"LMCache {version} is installed: its hooks patch LMCache internals "
        "(CreateTransferChannel), which may have changed. Run kvbridge's LMCache tests "
        "(scripts/test.sh) against this version before relying on it."
    )
    warnings.warn(msg, UntestedLMCacheVersion, stacklevel=3)
    logger.warning(msg)
    return False


def install() -> None:
    """Adds ``transfer_channel: "kvbridge"`` to LMCache. Idempotent and thread-safe.

    Raises ``ImportError`` when LMCache is not installed.
    """
    global _original
    with _lock:
        import lmcache

        check_version(getattr(lmcache, "__version__", "unknown"))
        factory_mod = importlib.import_module(FACTORY_USERS[0])
        current = factory_mod.CreateTransferChannel
        if _original is None:
            _original = getattr(current, "__wrapped__", current) if _is_hook(current) else current
        hook = _wrap(_original)
        for name in FACTORY_USERS:
            try:
                mod = importlib.import_module(name)
            except ImportError as e:
                # p2p_backend (and, in other releases, others) may be absent or need extras.
                logger.debug("kvbridge: %s not importable, not patched: %s", name, e)
                continue
            if not hasattr(mod, "CreateTransferChannel"):
                continue
            if _is_hook(mod.CreateTransferChannel):
                continue
            if mod.CreateTransferChannel is not _original:
                # Someone else replaced it (a test's mock, another plugin): leave theirs.
                logger.warning("kvbridge: %s.CreateTransferChannel is not LMCache's; left as is", name)
                continue
            mod.CreateTransferChannel = hook
            _patched[name] = hook
        from kvbridge.lmcache import alloc_windows

        alloc_windows.install()
        _register_distributed()


def _is_hook(fn: Any) -> bool:
    return bool(getattr(fn, "kvbridge_hook", False))


def installed() -> list[str]:
    """The modules whose ``CreateTransferChannel`` currently builds kvbridge channels."""
    out = []
    for name in FACTORY_USERS:
        mod = sys.modules.get(name)
        if mod is not None and _is_hook(getattr(mod, "CreateTransferChannel", None)):
            out.append(name)
    return out


def _register_distributed() -> None:
    # The distributed layer's context is a separate part of this package: when it cannot
    # register (an LMCache without that layer), the legacy channel still works, and the
    # reason is logged loudly.
    if importlib.util.find_spec("kvbridge.lmcache.distributed") is None:
        return
    try:
        distributed = importlib.import_module("kvbridge.lmcache.distributed")
        register = getattr(distributed, "register", None)
        if register is not None:
            register()
    except Exception:  # noqa: BLE001 - see above
        logger.warning(
            "kvbridge: not registered in LMCache's distributed channel registry", exc_info=True
        )
