"""Write windows in LMCache's PD backends: a receiver opens the pages it allocated for an
``AllocRequest`` to the sender that asked, and to no one else.

LMCache allocates a receiver's pages over its own ZMQ alloc socket, which the channel never
sees, and its ``AllocRequest`` does not name the sender. ``install()`` hooks both PD backends
(``PDBackend``, ``PDBackendAsync``) without editing LMCache:

* sender: ``_get_remote_alloc_request`` returns the request with one field more,
  ``kvbridge_writer`` (the sender channel's ``writer_id``, the kvbridge session id the
  receiver knows it by), under LMCache's own tag ``AllocRequest``. An LMCache without the
  hook decodes it and skips the field (msgspec ignores unknown fields), so the wire stays
  compatible both ways;
* receiver: the module's ``PDMsg`` decodes that field, and the allocation
  (``_allocate_and_put``, ``_async_allocate_and_put``) is followed, before LMCache answers,
  by ``KvbridgeChannel.grant_writes(writer, allocated pages)``: no-op unless the channel has
  ``write_windows``.

The name is not authenticated (LMCache's alloc socket is not): naming a session opens pages
to that session only, and only that session can write through its windows, so a false name
gives no one a write into pages not allocated to it. Whoever reaches the alloc socket can
still have pages allocated to itself: that is LMCache's control plane (docs/lmcache.md,
*Write windows*).
"""

from __future__ import annotations

import functools
import importlib
import logging
import typing
from typing import Any, Callable, Union

import msgspec

logger = logging.getLogger(__name__)

#: module -> (backend class, its allocation method, whether that method is a coroutine)
BACKENDS = {
    "lmcache.v1.storage_backend.pd_backend": ("PDBackend", "_allocate_and_put", False),
    "lmcache.v1.storage_backend.pd_backend_async": (
        "PDBackendAsync",
        "_async_allocate_and_put",
        True,
    ),
}
#: The field a hooked sender adds to its ``AllocRequest``.
WRITER_FIELD = "kvbridge_writer"

_unnamed_logged: set[int] = set()


def _hooked(fn: Any) -> bool:
    return bool(getattr(fn, "kvbridge_hook", False))


def _mark(fn: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    fn.__wrapped__ = original  # type: ignore[attr-defined]
    fn.kvbridge_hook = True  # type: ignore[attr-defined]
    return fn


def _kvbridge_channel(backend: Any) -> Any:
    from kvbridge.lmcache.channel import KvbridgeChannel

    ch = getattr(backend, "transfer_channel", None)
    return ch if isinstance(ch, KvbridgeChannel) else None


def _named_request(ext: type) -> Callable[..., Any]:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def _get_remote_alloc_request(self: Any, *args: Any, **kwargs: Any) -> Any:
            req = original(self, *args, **kwargs)
            ch = _kvbridge_channel(self)
            if ch is None:
                return req
            return ext(**msgspec.structs.asdict(req), **{WRITER_FIELD: ch.writer_id})

        return _mark(_get_remote_alloc_request, original)

    return wrap


def _grant(backend: Any, request: Any, response: Any) -> None:
    """Opens the pages LMCache just allocated to the writer the request names."""
    ch = _kvbridge_channel(backend)
    if ch is None or not ch.write_windows:
        return
    pages = [int(i) for i in getattr(response, "remote_indexes", []) if int(i) >= 0]
    writer = getattr(request, WRITER_FIELD, "")
    if not writer:
        if id(ch) not in _unnamed_logged:
            _unnamed_logged.add(id(ch))
            logger.error(
                "kvbridge: an AllocRequest names no kvbridge writer (a sender without "
                "kvbridge.lmcache.install()): with write windows on, its writes to the pages "
                "allocated for it (%s...) are refused",
                pages[:4],
            )
        return
    try:
        ch.grant_writes(writer, pages)
    except Exception:  # noqa: BLE001 - LMCache must still answer; the writes are refused
        logger.exception("kvbridge: could not open pages %s to %s", pages[:8], writer)


def _granting(original: Callable[..., Any], is_async: bool) -> Callable[..., Any]:
    if is_async:

        @functools.wraps(original)
        async def allocate_async(self: Any, request: Any) -> Any:
            response = await original(self, request)
            _grant(self, request, response)
            return response

        return _mark(allocate_async, original)

    @functools.wraps(original)
    def allocate(self: Any, request: Any) -> Any:
        response = original(self, request)
        _grant(self, request, response)
        return response

    return _mark(allocate, original)


def _extended(mod: Any) -> type:
    """The module's ``AllocRequest`` with ``kvbridge_writer``, under the same tag; its
    ``PDMsg`` rebound to decode it (LMCache's own code reads ``PDMsg`` at call time)."""
    base = mod.AllocRequest
    if getattr(base, "kvbridge_hook", False):
        return base
    ext = msgspec.defstruct(
        "AllocRequest",
        [(WRITER_FIELD, str, "")],
        bases=(base,),
        tag="AllocRequest",
        module=__name__,
    )
    ext.kvbridge_hook = True  # type: ignore[attr-defined]
    members = tuple(ext if t is base else t for t in typing.get_args(mod.PDMsg))
    mod.PDMsg = Union[members]  # type: ignore[valid-type]
    return ext


def install() -> list[str]:
    """Hooks each importable PD backend once; returns the modules hooked now or before."""
    done = []
    for name, (cls_name, alloc, is_async) in BACKENDS.items():
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            logger.debug("kvbridge: %s not importable, no write windows there: %s", name, e)
            continue
        cls = getattr(mod, cls_name)
        if not _hooked(getattr(cls, alloc)):
            ext = _extended(mod)
            cls._get_remote_alloc_request = _named_request(ext)(cls._get_remote_alloc_request)
            setattr(cls, alloc, _granting(getattr(cls, alloc), is_async))
        done.append(name)
    return done


def installed() -> list[str]:
    """The PD backend modules whose allocations open write windows."""
    import sys

    out = []
    for name, (cls_name, alloc, _) in BACKENDS.items():
        mod = sys.modules.get(name)
        cls = getattr(mod, cls_name, None) if mod is not None else None
        if cls is not None and _hooked(getattr(cls, alloc, None)):
            out.append(name)
    return out
