"""kvbridge as a transfer channel of LMCache's distributed layer (``"kvbridge"``).

LMCache's ``lmcache.v1.distributed.transfer_channel`` reads objects out of a peer's L1
arena: a process-wide context owns the transport and the arena's registration, one server
accepts peers, and one client per peer (keyed by the peer's ``advertise_url``) submits
reads and is polled for them. This module implements that contract on one
``kvbridge.Channel`` per context:

* the channel listens on ``listen_url``, and the whole L1 arena is one region whose page
  is LMCache's ``align_bytes``;
* a client is a kvbridge session to the peer plus the peer's arena; ``submit_read`` turns
  ``(offset, size)`` addresses into byte ops over whole pages
  (:mod:`kvbridge.lmcache.distributed_pages`) and ``Channel.submit_read``; the task's
  state is the transfer's ``poll()``;
* the server is the thread that receives the channel's notifications: a peer that dials
  us introduces its arena with a ``Hello`` (:mod:`kvbridge.lmcache.distributed_handshake`),
  and we keep a passive reverse client for it before we answer, so either side may read
  from the other over the one session, as with NIXL.

Run ``register()`` (``kvbridge.lmcache.install()`` does) before LMCache creates a
context; then ``--transfer-channel-type kvbridge`` (benchmark) or
``--p2p-transfer-engine kvbridge`` (MP server) selects it. The peers' channel settings
(secret, TLS, transport) come from the ``KVBRIDGE_*`` environment variables, or from the
factory's keyword arguments of the same names.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import uuid
import weakref
from typing import Any, Optional

import kvbridge
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.transfer_channel import factory as _factory
from lmcache.v1.distributed.transfer_channel.abstract import (
    TransferChannelClient,
    TransferChannelContext,
    TransferChannelServer,
)
from lmcache.v1.distributed.transfer_channel.api import (
    TransferChannelAddress,
    TransferChannelReadResult,
)
from lmcache.v1.mp_observability.errors import LMCacheTimeoutError

from kvbridge.lmcache import distributed_handshake as handshake
from kvbridge.lmcache.distributed_pages import PagedArena, read_ops

logger = logging.getLogger(__name__)

CHANNEL_TYPE = "kvbridge"
"""The name LMCache's factory knows this channel by."""

HANDSHAKE_TIMEOUT_S = 30.0
"""How long a dialer waits for the peer's ``Welcome`` after the session is up."""

QUERY_WAIT_S = 0.001
"""How long ``query_read_status`` waits (GIL released) for a read in flight to end before
it reports it unfinished. Callers poll in a tight loop (LMCache's benchmark does); parked
here instead of spinning, they leave the CPU to kvbridge's data threads, and a read that
ends wakes them at once. 0 never waits."""

_NOTIFICATION_POLL_S = 0.2
"""How often the server's loop wakes to see whether it should stop."""

_open_contexts: "weakref.WeakSet[KvbridgeTransferChannelContext]" = weakref.WeakSet()
"""Contexts not closed yet; closed at interpreter exit, because a kvbridge thread still
blocked in the channel while the interpreter finalizes aborts the process."""

_CHANNEL_OPTIONS = ("secret", "transport", "tls_cert", "tls_key", "tls_ca", "tls_server_name")
"""Factory keyword arguments forwarded to ``kvbridge.Channel``."""


def _host_port(url: str) -> str:
    """``host:port`` of a ``host:port`` or ``tcp://host:port`` url."""
    stripped = url.split("://", 1)[-1]
    host, _, port = stripped.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"Invalid transfer channel url: {url!r} (expected host:port)")
    return f"{host}:{port}"


############################################################
# Client
############################################################
class KvbridgeTransferChannelClient(TransferChannelClient):
    """Reads from one peer's L1 arena over the context's kvbridge session with it."""

    def __init__(
        self,
        context: "KvbridgeTransferChannelContext",
        peer_id: str,
        remote_arena: PagedArena,
    ) -> None:
        self._ctx = context
        self._peer = peer_id
        self._remote = remote_arena
        self._lock = threading.Lock()
        self._next_task = 0
        # task id -> (transfer, object count); a transfer of None moved nothing
        self._tasks: dict[int, tuple[Optional[Any], int]] = {}
        self._closed = False

    @property
    def peer_id(self) -> str:
        """The kvbridge peer id of the session this client reads over."""
        return self._peer

    def submit_read(
        self,
        local_addresses: list[TransferChannelAddress],
        remote_addresses: list[TransferChannelAddress],
    ) -> int:
        """Start reading each remote object into the local object at the same index.

        Raises ``ValueError`` before any byte moves if the lists differ in length or an
        address is unaligned, outside its arena or of a different page count than its
        pair; a ``kvbridge.KvbridgeError`` if the session refuses the batch.
        """
        ops = read_ops(
            self._ctx.arena,
            self._remote,
            [(a.offset, a.size) for a in local_addresses],
            [(a.offset, a.size) for a in remote_addresses],
        )
        with self._lock:
            if self._closed:
                raise RuntimeError(f"transfer channel client for {self._peer} is closed")
        transfer = self._ctx.channel.submit_read(self._peer, ops) if ops else None
        with self._lock:
            task_id = self._next_task
            self._next_task += 1
            self._tasks[task_id] = (transfer, len(remote_addresses))
        return task_id

    def query_read_status(self, task_id: int) -> TransferChannelReadResult:
        """The task's state; a finished task is forgotten (``KeyError`` if asked again)."""
        with self._lock:
            if task_id not in self._tasks:
                raise KeyError(f"Unknown read task id: {task_id}")
            transfer, count = self._tasks[task_id]
        state = "DONE" if transfer is None else transfer.poll()
        if state == "PROC" and self._ctx.query_wait_s > 0:
            try:
                transfer.wait(self._ctx.query_wait_s)
            except (TimeoutError, kvbridge.KvbridgeError):
                pass  # still in flight, or failed: poll() tells which
            state = transfer.poll()
        if state == "PROC":
            return TransferChannelReadResult(finished=False, succeeded_mask=[])
        with self._lock:
            self._tasks.pop(task_id, None)
        if state == "DONE":
            return TransferChannelReadResult(finished=True, succeeded_mask=[True] * count)
        logger.error(
            "kvbridge read of %d objects from %s failed: %s", count, self._peer, transfer.error
        )
        return TransferChannelReadResult(finished=True, succeeded_mask=[False] * count)

    def close(self) -> None:
        """Cancel and forget the pending tasks; the session stays (the context owns it).
        Returns once none of their bytes can land in the local objects any more (a cancel
        returns once the engine let go of its read), except over UCX, where a cancel ends
        the session and a read's bytes may land until its teardown ended: then, and when a
        cancel was not confirmed, the session is ended here and waited for."""
        with self._lock:
            self._closed = True
            tasks = list(self._tasks.values())
            self._tasks.clear()
        cancelled = [t for t, _ in tasks if t is not None and not t.done]
        confirmed = all([t.cancel() for t in cancelled])
        if cancelled and (not confirmed or self._ctx.channel.transport == "ucx"):
            try:
                self._ctx.channel.disconnect(self._peer, "transfer channel client closed")
            except kvbridge.UnknownPeer:
                pass  # that session already ended, its readers with it
            except kvbridge.KvbridgeError as e:
                logger.error(
                    "kvbridge transfer channel: ending the session with %s after cancelled "
                    "reads failed: %s; their bytes may still land",
                    self._peer,
                    e,
                )


############################################################
# Server
############################################################
class KvbridgeTransferChannelServer(TransferChannelServer):
    """The thread that receives the context's notifications: peers' ``Hello`` and the
    ``Welcome`` answers to our own dials."""

    def __init__(
        self,
        listen_url: str,
        advertise_url: str,
        l1_memory_desc: L1MemoryDesc,
        context: "KvbridgeTransferChannelContext",
    ) -> None:
        self._ctx = context
        self.listen_url = listen_url
        self.advertise_url = advertise_url
        self._l1_memory_desc = l1_memory_desc
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve_loop, name="tc-kvbridge-server", daemon=True
        )
        self._thread.start()

    def _serve_loop(self) -> None:
        channel = self._ctx.channel
        while not self._stop.is_set():
            try:
                item = channel.recv_notification(timeout=_NOTIFICATION_POLL_S)
            except kvbridge.Closed:
                return
            except kvbridge.KvbridgeError:
                if not self._stop.is_set():
                    logger.exception("kvbridge transfer channel: receiving a notification failed")
                continue
            if item is None:
                continue
            peer, data = item
            try:
                self._handle(peer, data)
            except Exception:  # noqa: BLE001 - one bad peer must not stop the server
                if not self._stop.is_set():
                    logger.exception("kvbridge transfer channel: handshake with %s failed", peer)

    def _handle(self, peer: str, data: bytes) -> None:
        try:
            msg = handshake.decode(data)
        except handshake.MalformedMessage as err:
            logger.warning("kvbridge transfer channel: ignoring %s's notification: %s", peer, err)
            return
        if msg is None:
            logger.debug("kvbridge transfer channel: ignoring a foreign notification from %s", peer)
        elif isinstance(msg, handshake.Hello):
            self._ctx.accept_hello(peer, msg)
        elif not self._ctx.pending.deliver(peer, msg):
            logger.warning(
                "kvbridge transfer channel: %s answered a handshake nobody waits for", peer
            )

    def close(self) -> None:
        """Stop the loop (it wakes within ``_NOTIFICATION_POLL_S``)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


############################################################
# Context
############################################################
class KvbridgeTransferChannelContext(TransferChannelContext):
    """Owns the kvbridge channel, the L1 arena's registration, the server and the clients.

    The constructor matches NIXL's context (``l1_memory_desc, listen_url,
    advertise_url, backends``); ``backends`` is NIXL's and ignored. The other keyword
    arguments are ``kvbridge.Channel``'s (``secret``, ``transport``, ``tls_*``),
    ``handshake_timeout`` and ``query_wait`` (seconds; see ``QUERY_WAIT_S``).
    """

    def __init__(
        self,
        l1_memory_desc: L1MemoryDesc,
        listen_url: str,
        advertise_url: str,
        backends: Optional[list[str]] = None,
        *,
        handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
        query_wait: float = QUERY_WAIT_S,
        **channel_options: Any,
    ) -> None:
        unknown = set(channel_options) - set(_CHANNEL_OPTIONS)
        if unknown:
            raise TypeError(f"unknown kvbridge transfer channel options: {sorted(unknown)}")
        del backends  # NIXL's; kvbridge picks its transport itself
        self.listen_url = listen_url
        self.advertise_url = advertise_url
        self._l1_memory_desc = l1_memory_desc
        self._handshake_timeout = handshake_timeout
        if not query_wait >= 0:
            raise ValueError(f"query_wait must be >= 0 seconds, got {query_wait}")
        self.query_wait_s = query_wait
        self._lock = threading.Lock()
        self._clients: dict[str, TransferChannelClient] = {}
        self._closed = False
        self.pending = handshake.PendingWelcomes()

        arena = PagedArena.from_l1(0, l1_memory_desc.size, l1_memory_desc.align_bytes)
        self.channel = kvbridge.Channel(
            f"lmcache-tc/{advertise_url}/{uuid.uuid4().hex[:8]}",
            _host_port(listen_url),
            **channel_options,
        )
        try:
            region = self.channel.register(
                l1_memory_desc.ptr, arena.length, arena.page_size
            )
            self.arena = PagedArena(region, arena.length, arena.page_size)
            self._server = KvbridgeTransferChannelServer(
                listen_url=listen_url,
                advertise_url=advertise_url,
                l1_memory_desc=l1_memory_desc,
                context=self,
            )
        except BaseException:
            self.channel.close()
            raise
        _open_contexts.add(self)

    def _arena_info(self) -> handshake.ArenaInfo:
        return handshake.ArenaInfo.of(self.arena.region, self.arena.length, self.arena.page_size)

    ############################################################
    # Address translation
    ############################################################
    def get_transfer_channel_address(
        self,
        lmcache_addresses: list[tuple[int, int]],
    ) -> list[TransferChannelAddress]:
        """The addresses of ``(offset, size)`` objects; ``ValueError`` for one that
        leaves the registered arena."""
        out = []
        for offset, size in lmcache_addresses:
            self.arena.check_object(offset, size, "local")
            out.append(TransferChannelAddress(offset=offset, size=size))
        return out

    ############################################################
    # Server / client management
    ############################################################
    def get_transfer_channel_server(self) -> KvbridgeTransferChannelServer:
        return self._server

    def get_transfer_channel_client(self, peer_advertise_url: str) -> TransferChannelClient:
        """The client for the peer at ``peer_advertise_url``; dials it if there is none.

        Dialing returns once the peer holds its reverse client for us. Raises a
        ``kvbridge.KvbridgeError`` if the session cannot be made and
        ``LMCacheTimeoutError`` if the peer does not answer the handshake in time.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("kvbridge transfer channel context is closed")
            client = self._clients.get(peer_advertise_url)
            if client is not None:
                return client
        return self.register_client(peer_advertise_url, self._connect(peer_advertise_url))

    def get_num_connected_clients(self) -> int:
        with self._lock:
            return len(self._clients)

    def register_client(self, key: str, client: TransferChannelClient) -> TransferChannelClient:
        """Keep ``client`` for ``key`` unless one is kept already; then close ``client``
        (our dial and the peer's raced) and return the kept one."""
        with self._lock:
            existing = self._clients.get(key)
            if existing is None:
                self._clients[key] = client
                return client
            if existing is client:
                return client
        try:
            client.close()
        except Exception:  # noqa: BLE001 - the duplicate is discarded either way
            logger.exception("closing a duplicate transfer channel client for %s", key)
        return existing

    def remove_transfer_channel_client(self, peer_advertise_url: str) -> None:
        """Close and forget the client for ``peer_advertise_url`` (no-op if none)."""
        with self._lock:
            client = self._clients.pop(peer_advertise_url, None)
        if client is None:
            return
        try:
            client.close()
        except Exception:  # noqa: BLE001 - it is forgotten either way
            logger.exception("closing the transfer channel client for %s", peer_advertise_url)

    def accept_hello(self, peer: str, hello: handshake.Hello) -> None:
        """A peer dialed us: keep a reverse client for its url, then answer ``Welcome``
        (in that order: the dialer returns on the Welcome and may count our clients)."""
        client = KvbridgeTransferChannelClient(
            self, peer, PagedArena(hello.arena.region_id, hello.arena.length, hello.arena.page_size)
        )
        with self._lock:
            if self._closed:
                return
            existing = self._clients.get(hello.advertise_url)
            if (
                isinstance(existing, KvbridgeTransferChannelClient)
                and existing.peer_id != peer
            ):
                # the url's previous owner restarted (a new channel id): its session is
                # gone, so its client could only fail
                del self._clients[hello.advertise_url]
            else:
                existing = None
        if existing is not None:
            existing.close()
        kept = self.register_client(hello.advertise_url, client)
        welcome = handshake.Welcome(
            nonce=hello.nonce, advertise_url=self.advertise_url, arena=self._arena_info()
        )
        try:
            self.channel.notify(peer, handshake.encode(welcome))
        except BaseException:
            # the dialer never learns of this client: do not keep one it did not get
            if kept is client:
                with self._lock:
                    if self._clients.get(hello.advertise_url) is client:
                        del self._clients[hello.advertise_url]
                client.close()
            raise

    def _connect(self, peer_advertise_url: str) -> KvbridgeTransferChannelClient:
        peer = self.channel.connect(_host_port(peer_advertise_url))
        nonce = self.pending.open(peer)
        deadline = time.monotonic() + self._handshake_timeout
        hello = handshake.Hello(
            nonce=nonce, advertise_url=self.advertise_url, arena=self._arena_info()
        )
        try:
            self.channel.notify(peer, handshake.encode(hello))
        except BaseException:
            self.pending.wait(nonce, 0.0)  # closes the slot
            raise
        welcome = self.pending.wait(nonce, deadline)
        if welcome is None:
            with self._lock:
                closed = self._closed
            if closed:
                raise RuntimeError(
                    f"kvbridge transfer channel context closed while dialing {peer_advertise_url}"
                )
            raise LMCacheTimeoutError(
                f"kvbridge transfer channel: {peer} at {peer_advertise_url!r} did not answer "
                f"the arena handshake within {self._handshake_timeout:.0f}s"
            )
        arena = welcome.arena
        return KvbridgeTransferChannelClient(
            self, peer, PagedArena(arena.region_id, arena.length, arena.page_size)
        )

    ############################################################
    # Cleanup
    ############################################################
    def stats(self) -> dict[str, int]:
        """The channel's counters (``kvbridge.Channel.stats``)."""
        return self.channel.stats()

    def close(self) -> None:
        """Stop the server, close every client, deregister the arena (waiting for reads
        in flight on it) and close the channel. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            clients = list(self._clients.values())
            self._clients.clear()
        _open_contexts.discard(self)
        self._server.close()
        self.pending.fail_all()
        for client in clients:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing the rest matters more
                logger.exception("closing a transfer channel client")
        try:
            self.channel.deregister(self.arena.region)
        except kvbridge.KvbridgeError:
            logger.exception("kvbridge transfer channel: deregistering the L1 arena failed")
        self.channel.close()


############################################################
# Factory registration
############################################################
def create_kvbridge_transfer_channel_context(
    l1_memory_desc: L1MemoryDesc,
    listen_url: str,
    advertise_url: str,
    **kwargs: Any,
) -> KvbridgeTransferChannelContext:
    """LMCache's factory for ``"kvbridge"``: ``backends`` (NIXL's) is ignored, the
    ``kvbridge.Channel`` options, ``handshake_timeout`` and ``query_wait`` are passed on."""
    return KvbridgeTransferChannelContext(
        l1_memory_desc=l1_memory_desc,
        listen_url=listen_url,
        advertise_url=advertise_url,
        **kwargs,
    )


@atexit.register
def _close_open_contexts() -> None:
    for ctx in list(_open_contexts):
        try:
            ctx.close()
        except Exception:  # noqa: BLE001 - the process is exiting
            logger.exception("closing a kvbridge transfer channel context at exit")


_register_lock = threading.Lock()


def register() -> None:
    """Register ``"kvbridge"`` with LMCache's transfer channel factory. Idempotent.

    Raises ``ValueError`` if another factory already holds the name.
    """
    with _register_lock:
        registry = getattr(_factory, "_TRANSFER_CHANNEL_FACTORY_REGISTRY", None)
        if registry is not None and _is_ours(registry.get(CHANNEL_TYPE)):
            return
        _factory.register_transfer_channel_factory(
            CHANNEL_TYPE, create_kvbridge_transfer_channel_context
        )


def _is_ours(factory: Any) -> bool:
    """Whether ``factory`` is this module's (also across a reload of this module)."""
    return (
        getattr(factory, "__module__", None) == __name__
        and getattr(factory, "__qualname__", None)
        == create_kvbridge_transfer_channel_context.__qualname__
    )
