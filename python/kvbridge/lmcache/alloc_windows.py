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
  ``write_windows``;
* receiver: a page's window closes when LMCache frees the page (the allocator's ``free`` and
  ``batched_free``, wrapped on the instance: consumed, removed on a ``CancelNotif``, rolled
  back), and the page goes back to the allocator only once no write admitted through it can
  land; a ``CancelNotif`` (``PDBackendAsync._handle_alloc_request``) closes the windows of
  the pages its keys hold even when another request still holds them. Nothing here blocks
  LMCache's event loop: a wait for a write still landing runs on a thread.

The name is not authenticated (LMCache's alloc socket is not): naming a session opens pages
to that session only, and only that session can write through its windows, so a false name
gives no one a write into pages not allocated to it. Whoever reaches the alloc socket can
still have pages allocated to itself: that is LMCache's control plane (docs/lmcache.md,
*Write windows*).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import threading
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
    _hook_frees(backend, ch)
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


def _receiver_allocator(backend: Any, ch: Any) -> Any:
    """The paged allocator whose pages are the channel's arena (LMCache's CPU one)."""
    alloc = getattr(getattr(backend, "memory_allocator", None), "cpu_allocator", None)
    if alloc is None or int(getattr(alloc, "buffer_ptr", -1)) != ch._buffer_ptr:
        return None
    return alloc


def _hook_frees(backend: Any, ch: Any) -> None:
    """Closes a page's window when LMCache frees the page (the receiver consumed it,
    removed it on a ``CancelNotif``, or rolled back its allocation), and keeps the page
    out of the allocator until no write admitted through the window can land any more.

    Every free of a page ends in this allocator's ``free`` or ``batched_free`` (a memory
    object's ``ref_count_down`` calls ``parent_allocator.free``): both are wrapped on the
    allocator instance, once, when its channel opens its first window (no page has a
    window before). The wrapper never blocks: a page with a write still landing goes
    back to the allocator from the channel's drain thread
    (``KvbridgeChannel.release_when_written``)."""
    from kvbridge.lmcache.channel import DRAIN_THREAD

    alloc = _receiver_allocator(backend, ch)
    if alloc is None or getattr(alloc, "kvbridge_frees", None) is ch:
        return
    free, batched_free = alloc.free, alloc.batched_free

    def _release(objs: list[Any], give: Callable[[list[Any]], None]) -> None:
        by_page: dict[int, list[Any]] = {}
        for o in objs:
            by_page.setdefault(int(o.meta.address), []).append(o)

        def back(pages: list[int]) -> None:
            give([o for i in pages for o in by_page[i]])
            if threading.current_thread().name == DRAIN_THREAD:
                _wake_allocations(backend)

        ch.release_when_written(list(by_page), back)

    @functools.wraps(free)
    def free_hooked(memory_obj: Any, allocator_type: Any = None) -> None:
        if not memory_obj.is_valid():
            return free(memory_obj, allocator_type)
        _release([memory_obj], lambda objs: free(objs[0], allocator_type))

    @functools.wraps(batched_free)
    def batched_free_hooked(memory_objs: Any, allocator_type: Any = None, update_stats: bool = True) -> None:
        objs = [o for o in memory_objs or [] if o.is_valid()]
        if not objs:
            return batched_free(memory_objs, allocator_type, update_stats)

        def give(some: list[Any]) -> None:
            if len(some) == 1:
                free(some[0], allocator_type)  # free updates the stats of one page
            else:
                batched_free(some, allocator_type, update_stats)

        _release(objs, give)

    alloc.free = _mark(free_hooked, free)
    alloc.batched_free = _mark(batched_free_hooked, batched_free)
    alloc.kvbridge_frees = ch


def _wake_allocations(backend: Any) -> None:
    """Pages came back from the drain thread: wakes ``PDBackendAsync`` allocations waiting
    for a free page, as its ``remove()`` does after a free (they would otherwise find the
    page at their next poll, ``pd_condition_poll_interval_sec``)."""
    cond = getattr(backend, "_alloc_freed_condition", None)
    loop = getattr(backend, "_recv_loop", None)
    if cond is None or loop is None or not loop.is_running():
        return

    async def notify() -> None:
        async with cond:
            cond.notify_all()

    asyncio.run_coroutine_threadsafe(notify(), loop)


def _cancelled_pages(backend: Any, payload: bytes) -> list[int]:
    """The pages a ``CancelNotif`` releases: those its keys hold in the backend now."""
    mod = importlib.import_module(type(backend).__module__)
    cancel = getattr(mod, "CancelNotif", None)
    if cancel is None or b"CancelNotif" not in payload:
        return []
    try:
        msg = msgspec.msgpack.decode(payload, type=mod.PDMsg)
    except Exception:  # noqa: BLE001 - LMCache's handler answers the bad message
        return []
    if not isinstance(msg, cancel):
        return []
    from lmcache.utils import CacheEngineKey

    pages = []
    with backend.data_lock:
        for k in msg.keys:
            try:
                obj = backend.data.get(CacheEngineKey.from_string(k))
            except Exception:  # noqa: BLE001 - LMCache's handler logs a bad key
                continue
            if obj is not None:
                pages.append(int(obj.meta.address))
    return pages


def _closing_cancels(original: Callable[..., Any]) -> Callable[..., Any]:
    """``PDBackendAsync._handle_alloc_request``: a ``CancelNotif`` closes the windows of
    the pages its keys hold before LMCache removes them (a page another request still
    holds is not freed by the cancel, but the cancelled sender's window on it ends)."""

    @functools.wraps(original)
    async def _handle_alloc_request(self: Any, socket: Any, identity: bytes, payload: bytes) -> Any:
        ch = _kvbridge_channel(self)
        if ch is not None and ch.write_windows:
            pages = _cancelled_pages(self, payload)
            if pages:
                ch.close_writes(pages)
        return await original(self, socket, identity, payload)

    return _mark(_handle_alloc_request, original)


def _granting(original: Callable[..., Any], is_async: bool) -> Callable[..., Any]:
    if is_async:

        @functools.wraps(original)
        async def allocate_async(self: Any, request: Any) -> Any:
            response = await original(self, request)
            ch = _kvbridge_channel(self)
            if ch is not None and ch.write_windows and ch.has_writes(
                getattr(response, "remote_indexes", [])
            ):
                # A page handed out with a window still open or draining: waiting for its
                # writes must not hold LMCache's event loop (bounded by the op deadline).
                await asyncio.to_thread(_grant, self, request, response)
            else:
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
        handler = getattr(cls, "_handle_alloc_request", None)
        if is_async and handler is not None and not _hooked(handler):
            cls._handle_alloc_request = _closing_cancels(handler)
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
