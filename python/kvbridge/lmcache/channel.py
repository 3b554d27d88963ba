"""kvbridge as a transfer channel of LMCache's legacy layer (the PD and P2P backends).

LMCache's PD backend hands its channel one arena (``buffer_ptr``, ``buffer_size``,
``align_bytes``: one page is one KV chunk) and then writes pages named by index:
``transfer_spec = {"receiver_id", "remote_indexes"}`` for a write, ``{"sender_id",
"remote_indexes"}`` for a read. ``KvbridgeChannel`` registers that arena with a
``kvbridge.Channel``, listens on ``peer_init_url`` (kvbridge's handshake replaces NIXL's ZMQ
init socket) and moves pages one-sided. LMCache's own control plane (ZMQ alloc requests,
``ProxyNotif``) is untouched.

Peers: ``lazy_init_peer_connection`` dials the listener (retrying a refused or lost dial until
``connect_timeout``, so a receiver that comes up late is waited for), learns the arena the
peer granted, and announces LMCache's ``local_id`` so that the listener can address the dialer
back (``role: both`` and P2P reads); the announcement is acknowledged by the listener, so when
the call returns both sides know each other.

Identity: this channel's kvbridge peer id is random per start (``lmcache-{role}-tp{rank}-
{pid}-{8 hex}``) unless ``peer_id``/``KVBRIDGE_PEER_ID`` names a template
(``kvbridge.identity``): a stable id that a listener's keyring (``KVBRIDGE_PEER_KEYS``) binds to
the key this side holds as its ``KVBRIDGE_PEER_KEY`` (or as its ``KVBRIDGE_SECRET``), so that a
holder of the shared secret cannot claim it (and write through the windows a receiver opened to it). A restarted sender
with the same id proves the key again and its new session replaces the old one.

A peer's restart: a peer's arena is a region whose id is random per registration, so a write
addressed to one incarnation of a peer can never land in the next one (stable peer id or
not: the next one refuses the unknown region). A write that fails while bytes move
raises kvbridge's typed error and marks the peer lost; a write that finds the peer lost, or
its session gone before any byte moved, dials once and, if a new incarnation answers, writes
there (LMCache never re-runs ``lazy_init_peer_connection``). LMCache allocates the peer's
pages over its own ZMQ socket, so which incarnation allocated them is not ours to see:
docs/lmcache.md, *Failures*.

Integrity (``integrity=True`` or ``KVBRIDGE_LMCACHE_INTEGRITY=1`` on both sides; off by
default, docs/lmcache.md says why): the writer digests each page it writes
(``kvbridge.digest_ranges``), and once the write has landed sends the digests in a
``_Landed`` notification on the same session; the receiver digests what landed in those
pages and answers ``_Verdict``. A page that differs fails the write with
``kvbridge.IntegrityError`` (``.cause == "integrity"``) before it returns, so LMCache never
sends the ``ProxyNotif`` that would let the decoder use it. Both sides say in the
announcement whether they check; a peer that does not (an older one) is written to
unchecked.

Write windows (``write_windows=True`` or ``KVBRIDGE_LMCACHE_WRITE_WINDOWS=1`` on the
receiver; off by default): the arena is registered with peers' writes confined to windows,
and the receiver's PD backend (hooked by ``kvbridge.lmcache.install``) opens one per page it
allocates for an ``AllocRequest``, to the sender's session only (``grant_writes``), closed
when LMCache frees the page (consumed, cancelled, rolled back), which gets the page back only
once no write admitted before the close can land (``release_when_written``; a page whose
writes did not end by the op deadline is withheld: ``pages_withheld``). A write outside the writer's windows
is refused by the receiver's engine (``kvbridge.Rejected``, code ``AccessDenied``), counted
in ``write_refusals`` on both sides and logged once per peer. The owner checks only what it
copies itself: TCP, and UCX between hosts; docs/lmcache.md, *Write windows*.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import ipaddress
import itertools
import logging
import os
import queue
import socket
import threading
import time
import uuid
import weakref
from typing import Any, Optional, Union

import msgspec

import kvbridge
from kvbridge import identity
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.transfer_channel.abstract import BaseTransferChannel
from lmcache.v1.transfer_channel.transfer_utils import (
    InitSideMsgBase,
    InitSideRetMsgBase,
    SideMsg,
)

logger = logging.getLogger(__name__)

#: Seconds a first dial to a peer keeps retrying while the peer's listener is not up yet.
DEFAULT_CONNECT_TIMEOUT = 30.0
#: Seconds the dialer waits for the listener to acknowledge its announcement.
DEFAULT_HELLO_TIMEOUT = 10.0
#: Whether written pages are digested and checked where they land, unless the channel or
#: ``KVBRIDGE_LMCACHE_INTEGRITY`` says otherwise. Off: checked writes of 1 MiB pages cost
#: more than the issue's 3% (docs/lmcache.md, *Integrity*).
DEFAULT_INTEGRITY = False
_CONNECT_TIMEOUT_ENV = "KVBRIDGE_LMCACHE_CONNECT_TIMEOUT"
_INTEGRITY_ENV = "KVBRIDGE_LMCACHE_INTEGRITY"
#: Whether the receiver confines peers' writes to the pages allocated to them, unless the
#: channel or ``KVBRIDGE_LMCACHE_WRITE_WINDOWS`` says otherwise. Off: confined writes go
#: over TCP only (docs/lmcache.md, *Write windows*).
DEFAULT_WRITE_WINDOWS = False
_WRITE_WINDOWS_ENV = "KVBRIDGE_LMCACHE_WRITE_WINDOWS"
#: The thread that gives freed pages back once no write into them can land.
DRAIN_THREAD = "kvbridge-lmcache-drain"
# A dial refused or cut short is retried; a peer that is incompatible, unauthenticated or
# refuses us is not (waiting would not change its answer).
_RETRYABLE = (kvbridge.ConnectionLost, kvbridge.Timeout, kvbridge.PeerClosed)
# After these a session is gone: the next write to the peer dials again.
_SESSION_ENDED = (
    kvbridge.ConnectionLost,
    kvbridge.Timeout,
    kvbridge.PeerClosed,
    kvbridge.PeerRestarted,
    kvbridge.Disconnected,
    kvbridge.UnknownPeer,
)
_NOTIF_MAGIC = b"kvbridge.lmcache/1\0"

# Channels still open at interpreter exit are closed first: their notification thread must
# not be inside kvbridge when Python ends daemon threads (the process would abort).
_open_channels: "weakref.WeakSet[KvbridgeChannel]" = weakref.WeakSet()


@atexit.register
def _close_open_channels() -> None:
    for ch in list(_open_channels):
        try:
            ch.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


class _Hello(msgspec.Struct, tag=True):
    """The dialer's announcement: its LMCache id and an optional LMCache side message.
    ``integrity``: the dialer digests what it writes and checks what lands (absent from
    peers older than the check, which decode as ``False``; they ignore the field)."""

    nonce: int
    local_id: str
    side_msg: bytes = b""
    integrity: bool = False


class _HelloAck(msgspec.Struct, tag=True):
    """The listener's answer: the side message's reply, or why it failed; ``integrity`` as
    in ``_Hello``, for the listener."""

    nonce: int
    side_ret: bytes = b""
    error: str = ""
    integrity: bool = False


class _Landed(msgspec.Struct, tag=True):
    """Writer -> receiver, after a write landed: the digest of each page as written, by the
    receiver's page index. Sent only to a peer that announced ``integrity``."""

    nonce: int
    pages: list[int]
    digests: list[int]


class _Verdict(msgspec.Struct, tag=True):
    """Receiver -> writer: the pages of the ``_Landed`` with the same nonce whose landed
    bytes differ from their digest (none: all arrived as written); ``unchecked`` when the
    receiver does not check (its setting is off), ``error`` why it could not."""

    nonce: int
    bad: list[int] = []
    error: str = ""
    unchecked: bool = False


_Notif = Union[_Hello, _HelloAck, _Landed, _Verdict]


@dataclasses.dataclass
class _Peer:
    """One LMCache peer as this channel reaches it."""

    kb_peer: str  # kvbridge peer id (names one incarnation of the peer)
    region: int  # the peer's arena region id
    addr: Optional[str]  # where to dial it again; None for a peer that dialed us
    lost: bool = False  # its session ended; the next write dials again
    integrity: bool = False  # it checks what we write into it (it said so)


def _resolve(url: str) -> str:
    """``host:port`` with the host resolved to an IP address (kvbridge takes addresses)."""
    host, sep, port = url.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"kvbridge: peer url {url!r} is not host:port")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        ip = host
    except ValueError:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        if not infos:
            raise ValueError(f"kvbridge: cannot resolve {host!r} of {url!r}") from None
        ip = infos[0][4][0]
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _connect_timeout(explicit: Optional[float]) -> float:
    if explicit is not None:
        return float(explicit)
    env = os.environ.get(_CONNECT_TIMEOUT_ENV)
    if env:
        try:
            return float(env)
        except ValueError:
            raise ValueError(f"{_CONNECT_TIMEOUT_ENV}={env!r} is not a number of seconds") from None
    return DEFAULT_CONNECT_TIMEOUT


def _flag(explicit: Optional[bool], name: str, default: bool) -> bool:
    if explicit is not None:
        return bool(explicit)
    env = os.environ.get(name)
    if env is None or env == "":
        return default
    if env.lower() in ("1", "true", "yes", "on"):
        return True
    if env.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={env!r} is not 1/0 (true/false, yes/no, on/off)")


def _integrity(explicit: Optional[bool]) -> bool:
    return _flag(explicit, _INTEGRITY_ENV, DEFAULT_INTEGRITY)


def _write_windows(explicit: Optional[bool]) -> bool:
    return _flag(explicit, _WRITE_WINDOWS_ENV, DEFAULT_WRITE_WINDOWS)


def _access_denied(e: BaseException) -> bool:
    return isinstance(e, kvbridge.Rejected) and e.code == "AccessDenied"


def _landed_digests(ranges: list[tuple[int, int]]) -> list[int]:
    """The digests of the pages that landed, as the receiver computes them before its
    verdict (one function, so that a test can change a byte of what landed first)."""
    return kvbridge.digest_ranges(ranges)


def _note(err: BaseException, text: str) -> None:
    if hasattr(err, "add_note"):
        err.add_note(text)


class KvbridgeChannel(BaseTransferChannel):
    """LMCache transfer channel over kvbridge (``transfer_channel: "kvbridge"``).

    Takes LMCache's constructor keywords (``async_mode, role, buffer_ptr, buffer_size,
    align_bytes, tp_rank, peer_init_url, device, event_loop, backends, peer_lookup_url``);
    ``backends`` (NIXL's) is ignored. kvbridge moves host memory: ``device`` must be ``cpu``
    (``pd_buffer_device: cpu``; LMCache copies between GPU and that arena itself). kvbridge's
    own settings (secret, TLS, transport) come from the ``KVBRIDGE_*`` environment variables;
    ``connect_timeout`` (or ``KVBRIDGE_LMCACHE_CONNECT_TIMEOUT``, default 30 s) bounds how long
    a first dial waits for a peer's listener. ``integrity`` (or
    ``KVBRIDGE_LMCACHE_INTEGRITY``, default off) digests each page written to a peer that
    checks too and has the peer check what landed; a page that differs fails the write with
    ``kvbridge.IntegrityError``. ``write_windows`` (or ``KVBRIDGE_LMCACHE_WRITE_WINDOWS``,
    default off), on a receiver: peers write only the pages ``grant_writes`` opened to them.
    ``peer_id`` (or ``KVBRIDGE_PEER_ID``): the template of this channel's kvbridge peer id
    (``{role}``, ``{tp_rank}``; ``kvbridge.identity``), so that a listener's keyring can bind
    it; default a random id per start, which no keyring can hold.
    """

    def __init__(
        self,
        async_mode: bool = False,
        device: Optional[str] = None,
        *,
        role: str,
        buffer_ptr: int,
        buffer_size: int,
        align_bytes: int,
        tp_rank: int,
        peer_init_url: Optional[str],
        event_loop: Optional[asyncio.AbstractEventLoop] = None,
        peer_lookup_url: Optional[str] = None,
        connect_timeout: Optional[float] = None,
        integrity: Optional[bool] = None,
        write_windows: Optional[bool] = None,
        peer_id: Optional[str] = None,
        **_ignored: Any,
    ):
        if device is not None and str(device).split(":")[0] != "cpu":
            raise ValueError(
                f"kvbridge moves host memory only, but LMCache gave it a {device!r} buffer: "
                "set `pd_buffer_device: cpu` (LMCache then copies between the GPU and a "
                "host arena itself)"
            )
        if align_bytes <= 0 or buffer_size < align_bytes:
            raise ValueError(
                f"kvbridge: arena of {buffer_size} bytes cannot hold pages of {align_bytes} bytes"
            )
        self.async_mode = async_mode
        self.role = role
        self.tp_rank = tp_rank
        self.peer_init_url = peer_init_url
        self.peer_lookup_url = peer_lookup_url  # P2P: handed to dialers in a side message
        self.event_loop = event_loop
        self.page_size = int(align_bytes)
        self.connect_timeout = _connect_timeout(connect_timeout)
        self.hello_timeout = DEFAULT_HELLO_TIMEOUT
        self.integrity = _integrity(integrity)
        self.write_windows = _write_windows(write_windows)
        self._buffer_ptr = int(buffer_ptr)

        listen = _resolve(peer_init_url) if peer_init_url else None
        peer_id = identity.peer_id(
            f"lmcache-{role}-tp{tp_rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            role=role,
            rank=tp_rank,
            template=peer_id,
        )
        self._ch = kvbridge.Channel(peer_id, listen)
        try:
            # Pages past the last whole page are never named by LMCache.
            length = buffer_size // self.page_size * self.page_size
            self._arena_len = length
            self._region = self._ch.register(
                int(buffer_ptr),
                length,
                self.page_size,
                windows="write" if self.write_windows else None,
            )
        except BaseException:
            self._ch.close()
            raise

        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._acks: dict[int, concurrent.futures.Future] = {}
        # LMCache ids whose theft was refused and logged (once each), and how many times
        self._refused_ids: set[str] = set()
        self.identity_refusals = 0
        # Pages checked where they landed, and those that differed from their digest
        # (counted by the receiver that checked them and the writer told of them); the
        # peers whose first mismatch was logged.
        self.integrity_checks = 0
        self.integrity_failures = 0
        self._integrity_logged: set[str] = set()
        # Write windows: page -> (window id, the session it is open to); this channel's
        # writes a peer refused, and the peers whose first refusal was logged.
        self._windows: dict[int, tuple[int, str]] = {}
        # Closed windows whose admitted writes may still be landing; pages waiting for
        # that before LMCache's allocator gets them back (release_when_written), the
        # thread that waits, and the pages it gave up on.
        self._closing: dict[int, tuple[int, str]] = {}
        self._drains: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._drainer: Optional[threading.Thread] = None
        self.pages_withheld = 0
        self._own_write_refusals = 0
        self._refusal_logged: set[str] = set()
        self._verdicts: dict[int, concurrent.futures.Future] = {}
        self._nonces = itertools.count(1)
        self._closed = threading.Event()
        self._dispatcher = threading.Thread(
            target=self._dispatch_loop, name=f"kvbridge-lmcache-tp{tp_rank}", daemon=True
        )
        self._dispatcher.start()
        _open_channels.add(self)
        logger.info(
            "kvbridge channel %s (%s) registered %d bytes in pages of %d%s",
            peer_id,
            role,
            length,
            self.page_size,
            f", listening on {self._ch.local_addr}" if listen else "",
        )
        if self.write_windows:
            logger.info("kvbridge channel %s: peers write only the pages allocated to them", peer_id)

    @property
    def kvbridge_channel(self) -> "kvbridge.Channel":
        """The underlying ``kvbridge.Channel`` (for stats and tests)."""
        return self._ch

    ############################################################
    # Peers
    ############################################################

    def lazy_init_peer_connection(
        self,
        local_id: str,
        peer_id: str,
        peer_init_url: str,
        init_side_msg: Optional[InitSideMsgBase] = None,
    ) -> Optional[InitSideRetMsgBase]:
        addr = _resolve(peer_init_url)
        deadline = time.monotonic() + self.connect_timeout
        kb_peer = self._dial_until(addr, deadline, peer_id)
        try:
            region = self._arena_of(kb_peer, peer_id)
            hello, fut = self._hello(local_id, init_side_msg)
            self._ch.notify(kb_peer, hello)
            try:
                ack = fut.result(timeout=self.hello_timeout)
            except concurrent.futures.TimeoutError:
                raise self._hello_timeout(peer_id, addr) from None
            finally:
                self._forget_ack(fut)
            return self._adopt(peer_id, kb_peer, region, addr, ack)
        except BaseException:
            self._drop_session(kb_peer, peer_id)
            raise

    async def async_lazy_init_peer_connection(
        self,
        local_id: str,
        peer_id: str,
        peer_init_url: str,
        init_side_msg: Optional[InitSideMsgBase] = None,
    ) -> Optional[InitSideRetMsgBase]:
        addr = _resolve(peer_init_url)
        deadline = time.monotonic() + self.connect_timeout
        kb_peer = await self._async_dial_until(addr, deadline, peer_id)
        try:
            region = self._arena_of(kb_peer, peer_id)
            hello, fut = self._hello(local_id, init_side_msg)
            await self._ch.notify_async(kb_peer, hello)
            try:
                ack = await asyncio.wait_for(asyncio.wrap_future(fut), self.hello_timeout)
            except asyncio.TimeoutError:
                raise self._hello_timeout(peer_id, addr) from None
            finally:
                self._forget_ack(fut)
            return self._adopt(peer_id, kb_peer, region, addr, ack)
        except BaseException:
            self._drop_session(kb_peer, peer_id)
            raise

    def remote_xfer_handler_exists(self, receiver_or_sender_id: str) -> bool:
        with self._lock:
            return receiver_or_sender_id in self._peers

    def _dial_until(self, addr: str, deadline: float, peer_id: str) -> str:
        attempt, backoff = 0, 0.05
        while True:
            attempt += 1
            try:
                return self._ch.connect(addr)
            except _RETRYABLE as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._give_up(e, addr, peer_id, attempt)
                    raise
                time.sleep(min(backoff, left))
                backoff = min(backoff * 2, 1.0)

    async def _async_dial_until(self, addr: str, deadline: float, peer_id: str) -> str:
        attempt, backoff = 0, 0.05
        while True:
            attempt += 1
            try:
                return await self._ch.connect_async(addr)
            except _RETRYABLE as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._give_up(e, addr, peer_id, attempt)
                    raise
                await asyncio.sleep(min(backoff, left))
                backoff = min(backoff * 2, 1.0)

    def _drop_session(self, kb_peer: str, peer_id: str) -> None:
        """Ends the kvbridge session of an LMCache handshake that failed half-way.

        Without this a peer that never acknowledged (or refused) our announcement would keep
        a connected session, with its data streams and memory mappings, that nothing uses.
        """
        try:
            self._ch.disconnect(kb_peer, "lmcache-init failed")
        except kvbridge.KvbridgeError as e:
            logger.warning("kvbridge: ending the half-built session with %s: %s", peer_id, e)

    def _give_up(self, e: BaseException, addr: str, peer_id: str, attempts: int) -> None:
        _note(
            e,
            f"kvbridge.lmcache: LMCache peer {peer_id!r} at {addr} did not answer within "
            f"{self.connect_timeout:g} s ({attempts} dials; {_CONNECT_TIMEOUT_ENV})",
        )
        logger.error("kvbridge: giving up on %s at %s: %s", peer_id, addr, e)

    def _hello(
        self, local_id: str, side: Optional[InitSideMsgBase]
    ) -> tuple[bytes, concurrent.futures.Future]:
        nonce = next(self._nonces)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._acks[nonce] = fut
        side_bytes = msgspec.msgpack.encode(side) if side is not None else b""
        msg = _Hello(nonce=nonce, local_id=local_id, side_msg=side_bytes, integrity=self.integrity)
        return _NOTIF_MAGIC + msgspec.msgpack.encode(msg), fut

    def _forget_ack(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            for k, v in list(self._acks.items()):
                if v is fut:
                    del self._acks[k]

    def _hello_timeout(self, peer_id: str, addr: str) -> Exception:
        return kvbridge.Timeout(
            f"kvbridge.lmcache: LMCache peer {peer_id!r} at {addr} did not acknowledge our "
            f"announcement within {self.hello_timeout:g} s (is it a kvbridge channel?)",
            peer=addr,
            step="lmcache-init",
        )

    def _adopt(
        self, peer_id: str, kb_peer: str, region: int, addr: str, ack: _HelloAck
    ) -> Optional[InitSideRetMsgBase]:
        if ack.error:
            raise kvbridge.Rejected(
                f"kvbridge.lmcache: LMCache peer {peer_id!r} at {addr} refused our "
                f"announcement: {ack.error}",
                peer=kb_peer,
                step="lmcache-init",
            )
        with self._lock:
            self._peers[peer_id] = _Peer(
                kb_peer=kb_peer, region=region, addr=addr, integrity=ack.integrity
            )
        logger.info("kvbridge: LMCache peer %s is %s at %s (region %d)", peer_id, kb_peer, addr, region)
        if ack.side_ret:
            return msgspec.msgpack.decode(ack.side_ret, type=SideMsg)
        return None

    def _arena_of(self, kb_peer: str, peer_id: str) -> int:
        regions = self._ch.peer_regions(kb_peer)
        same = [r for r in regions if r.page_size == self.page_size]
        if not same:
            seen = ", ".join(f"{r.id}: {r.length} B in pages of {r.page_size}" for r in regions)
            raise ValueError(
                f"kvbridge.lmcache: LMCache peer {peer_id!r} ({kb_peer}) grants no arena with "
                f"pages of {self.page_size} bytes (it grants: {seen or 'nothing'}); both sides "
                "must use the same KV chunk shape"
            )
        return same[0].id

    ############################################################
    # Notifications: the listener side of the announcement
    ############################################################

    def _dispatch_loop(self) -> None:
        while not self._closed.is_set():
            try:
                got = self._ch.recv_notification(timeout=0.2)
            except kvbridge.Closed:
                return
            except Exception as e:  # noqa: BLE001 - one bad read must not stop the loop
                if self._closed.is_set():
                    return
                logger.warning("kvbridge: notification receive failed: %s", e)
                time.sleep(0.05)
                continue
            if got is None:
                continue
            kb_peer, data = got
            try:
                self._on_notification(kb_peer, data)
            except Exception as e:  # noqa: BLE001
                logger.warning("kvbridge: notification from %s not handled: %s", kb_peer, e)

    def _on_notification(self, kb_peer: str, data: bytes) -> None:
        if not data.startswith(_NOTIF_MAGIC):
            logger.warning("kvbridge: ignoring a foreign notification from %s", kb_peer)
            return
        msg = msgspec.msgpack.decode(data[len(_NOTIF_MAGIC) :], type=_Notif)
        if isinstance(msg, _Landed):
            self._check_landed(kb_peer, msg)
            return
        if isinstance(msg, _Verdict):
            with self._lock:
                fut = self._verdicts.pop(msg.nonce, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            return
        if isinstance(msg, _HelloAck):
            with self._lock:
                fut = self._acks.pop(msg.nonce, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            return
        ack = _HelloAck(nonce=msg.nonce, integrity=self.integrity)
        try:
            region = self._arena_of(kb_peer, msg.local_id)
            self._bind(msg.local_id, kb_peer, region, msg.integrity)
            if msg.side_msg:
                side = msgspec.msgpack.decode(msg.side_msg, type=SideMsg)
                ack.side_ret = msgspec.msgpack.encode(self.handle_init_side_msg(side))
        except Exception as e:  # noqa: BLE001 - the dialer gets the reason
            ack.error = f"{type(e).__name__}: {e}"
        self._ch.notify(kb_peer, _NOTIF_MAGIC + msgspec.msgpack.encode(ack))

    def _bind(self, local_id: str, kb_peer: str, region: int, integrity: bool = False) -> None:
        """Binds an announced LMCache id to the kvbridge session that announced it. An id
        stays with its session while that session lives: another peer that holds the secret
        and claims the id (to receive the writes meant for it) is refused, and so is a
        session claiming a second id. Once the session ended, a new one takes the id over
        (the peer restarted). An empty id (LMCache's senders announce ``""``: nobody
        addresses them back) binds nothing, so that several senders can dial one receiver."""
        if not local_id:
            return
        with self._lock:
            held = self._peers.get(local_id)
            other = next((i for i, p in self._peers.items() if p.kb_peer == kb_peer and i != local_id), None)
        if other is not None:
            raise PermissionError(f"this session announced LMCache id {other!r} already; one id per session")
        if held is not None and held.kb_peer != kb_peer and self._session_lives(held.kb_peer):
            if local_id not in self._refused_ids:
                self._refused_ids.add(local_id)
                logger.warning(
                    "kvbridge: %s claimed LMCache id %r, which belongs to the live session of %s: refused",
                    kb_peer, local_id, held.kb_peer,
                )  # fmt: skip
            self.identity_refusals += 1
            raise PermissionError(f"LMCache id {local_id!r} belongs to another live session")
        with self._lock:
            self._peers[local_id] = _Peer(
                kb_peer=kb_peer, region=region, addr=None, integrity=integrity
            )

    def _session_lives(self, kb_peer: str) -> bool:
        try:
            self._ch.peer_transport(kb_peer)
        except kvbridge.KvbridgeError:
            return False
        return True

    ############################################################
    # Integrity: digests of written pages, checked where they landed
    ############################################################

    def _page_ranges(self, pages: list[int]) -> list[tuple[int, int]]:
        return [(self._buffer_ptr + i * self.page_size, self.page_size) for i in pages]

    def _check_landed(self, kb_peer: str, msg: _Landed) -> None:
        """The receiver's side: digests what landed in the named pages and answers which
        differ from the writer's digests (before LMCache is told the pages are there)."""
        verdict = _Verdict(nonce=msg.nonce)
        if not self.integrity:
            verdict.unchecked = True
            verdict.error = "this receiver does not check (integrity off)"
        elif len(msg.pages) != len(msg.digests) or any(
            not 0 <= i < self._region_pages() for i in msg.pages
        ):
            verdict.error = f"malformed: {len(msg.pages)} pages, {len(msg.digests)} digests"
        else:
            got = _landed_digests(self._page_ranges(msg.pages))
            verdict.bad = [i for i, a, b in zip(msg.pages, got, msg.digests) if a != b]
            with self._lock:
                self.integrity_checks += len(msg.pages)
                self.integrity_failures += len(verdict.bad)
                first = bool(verdict.bad) and kb_peer not in self._integrity_logged
                if first:
                    self._integrity_logged.add(kb_peer)
            if first:
                logger.error(
                    "kvbridge: %d of %d pages written by %s differ from their digest where "
                    "they landed (pages %s): the write fails as integrity; further "
                    "mismatches of this peer are counted (integrity_failures), not logged",
                    len(verdict.bad), len(msg.pages), kb_peer, verdict.bad[:8],
                )  # fmt: skip
        self._ch.notify(kb_peer, _NOTIF_MAGIC + msgspec.msgpack.encode(verdict))

    def _region_pages(self) -> int:
        return self._arena_len // self.page_size

    def _landed_msg(
        self, local: list[int], remote: list[int]
    ) -> tuple[bytes, concurrent.futures.Future]:
        nonce = next(self._nonces)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._verdicts[nonce] = fut
        digests = kvbridge.digest_ranges(self._page_ranges(local))
        msg = _Landed(nonce=nonce, pages=remote, digests=digests)
        return _NOTIF_MAGIC + msgspec.msgpack.encode(msg), fut

    def _forget_verdict(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            for k, v in list(self._verdicts.items()):
                if v is fut:
                    del self._verdicts[k]

    def _judge(self, lmc_peer: str, p: _Peer, verdict: Optional[_Verdict]) -> None:
        """Raises what a verdict (or its absence: ``None``) means for the write."""
        if verdict is None:
            raise kvbridge.Timeout(
                f"kvbridge.lmcache: LMCache peer {lmc_peer!r} did not answer the integrity "
                f"check of a write within {self.hello_timeout:g} s",
                peer=p.kb_peer,
                step="integrity",
            )
        if verdict.unchecked:
            logger.warning(
                "kvbridge: LMCache peer %s did not check a write: %s", lmc_peer, verdict.error
            )
            return
        if verdict.error:
            raise kvbridge.PeerMisbehaved(
                f"kvbridge.lmcache: LMCache peer {lmc_peer!r} could not check a write: "
                f"{verdict.error}",
                peer=p.kb_peer,
                step="integrity",
            )
        if verdict.bad:
            with self._lock:
                self.integrity_failures += len(verdict.bad)
            raise kvbridge.IntegrityError(
                f"kvbridge.lmcache: {len(verdict.bad)} page(s) written to LMCache peer "
                f"{lmc_peer!r} differ from their digest ({kvbridge.DIGEST_ALGORITHM}) where "
                f"they landed: pages {verdict.bad[:8]}",
                peer=p.kb_peer,
                pages=verdict.bad,
            )

    def _write_checked(self, lmc_peer: str, p: _Peer, local: list[int], remote: list[int]) -> None:
        # The pages are digested while their write is in flight (the GIL released in both);
        # the digests leave once the write has landed, so they follow it on the session.
        transfer = self._ch.submit_write_pages(p.kb_peer, self._region, local, p.region, remote)
        try:
            msg, fut = self._landed_msg(local, remote)
        except BaseException:
            # True: the engine reads none of the pages any more, the caller may reuse them
            if not transfer.cancel():
                logger.error(
                    "kvbridge: a write to LMCache peer %s was not let go of within 5 s of its "
                    "cancel: its pages may still be read",
                    lmc_peer,
                )
            raise
        try:
            transfer.wait()
            self._ch.notify(p.kb_peer, msg)
            try:
                verdict = fut.result(timeout=self.hello_timeout)
            except concurrent.futures.TimeoutError:
                verdict = None
        finally:
            self._forget_verdict(fut)
        self._judge(lmc_peer, p, verdict)

    async def _async_write_checked(
        self, lmc_peer: str, p: _Peer, local: list[int], remote: list[int]
    ) -> None:
        write = self._ch.write_pages_async(p.kb_peer, self._region, local, p.region, remote)
        try:
            msg, fut = self._landed_msg(local, remote)  # while the write is in flight
        except BaseException:
            # The write runs already: it is cancelled, and the error goes up once the engine
            # let go of the pages it sends from (a cancelled ``kvbridge.Call`` ends only
            # then), so that the caller does not reuse them under it.
            write.cancel()
            try:
                await write
            except BaseException:
                pass  # the first error is the one to report
            raise
        try:
            await write
            await self._ch.notify_async(p.kb_peer, msg)
            try:
                verdict = await asyncio.wait_for(asyncio.wrap_future(fut), self.hello_timeout)
            except asyncio.TimeoutError:
                verdict = None
        finally:
            self._forget_verdict(fut)
        self._judge(lmc_peer, p, verdict)

    ############################################################
    # Write windows: a sender writes only the pages allocated to it
    ############################################################

    @property
    def writer_id(self) -> str:
        """The id a receiver knows this channel's session by: what a sender names in its
        ``AllocRequest`` so that the receiver opens the allocated pages to it."""
        return self._ch.peer_id

    @property
    def write_refusals(self) -> int:
        """Writes refused for landing outside the writer's windows: by this channel's engine
        as a receiver (its ``access_denied``), plus this channel's own writes a receiver
        refused."""
        denied = self._ch.stats().get("access_denied", 0) if not self._closed.is_set() else 0
        with self._lock:
            return denied + self._own_write_refusals

    def grant_writes(self, writer: str, pages: list[int]) -> list[int]:
        """Opens each page to ``writer`` (a kvbridge session id: the sender's ``writer_id``)
        for writes. A page whose last window is still open, or closed with a write of its
        last holder still landing (a page handed out again without a hooked free), is
        closed first and waited for (``revoke_writes``); one whose wait ran out is not
        opened (the new writer's writes to it are refused rather than mixed with a late
        one). The windows open in one engine call, all or none (an engine refusal raises with
        none opened). Returns the pages opened. No-op unless ``write_windows``; a negative
        index (LMCache's failed slot) is skipped."""
        if not self.write_windows:
            return []
        # once each, in order: one batch of windows never overlaps itself
        pages = list(dict.fromkeys(int(i) for i in pages if int(i) >= 0))
        for i in pages:
            if i >= self._region_pages():
                raise ValueError(f"kvbridge: page {i} is outside the arena ({self._region_pages()} pages)")
        late = set(self.revoke_writes(pages))
        opened = [i for i in pages if i not in late]
        if not opened:
            return []
        # one call and one engine lock for the whole allocation (all pages or none)
        ps = self.page_size
        wids = self._ch.open_windows(self._region, [i * ps for i in opened], ps, peer=writer, access="write")
        with self._lock:
            for i, wid in zip(opened, wids):
                self._windows[i] = (wid, writer)
        return opened

    def has_writes(self, pages: list[int]) -> bool:
        """Whether any of these pages has a window open, or closed with writes that may
        still be landing."""
        with self._lock:
            return any(int(i) in self._windows or int(i) in self._closing for i in pages)

    def close_writes(self, pages: list[int]) -> list[int]:
        """Closes the windows open on these pages at once, without waiting: no write passes
        them from now on. Returns the pages where a write admitted before may still be
        landing (``wait_writes`` waits for them); a page with no window is not listed."""
        closing = []
        with self._lock:
            for i in pages:
                i = int(i)
                held = self._windows.pop(i, None)
                if held is not None:
                    self._closing[i] = held
                elif i not in self._closing:
                    continue
                closing.append(i)
        return self.wait_writes(closing, timeout=0.0) if closing else []

    def wait_writes(self, pages: list[int], timeout: Optional[float] = None) -> list[int]:
        """Waits, at most ``timeout`` seconds for all of them (default: the engine's op
        deadline, by which every admitted write has ended), for the writes admitted through
        the closed windows of these pages to end. Returns the pages still waited for."""
        with self._lock:
            held = {int(i): self._closing[int(i)] for i in pages if int(i) in self._closing}
        if not held:
            return []
        # An id another caller already saw drained counts as drained (close_windows).
        late = set(self._ch.close_windows([h[0] for h in held.values()], timeout=timeout))
        left = []
        with self._lock:
            for i, h in held.items():
                if h[0] in late:
                    left.append(i)
                elif self._closing.get(i) == h:
                    del self._closing[i]
        return left

    def revoke_writes(self, pages: list[int]) -> list[int]:
        """Closes the windows open on these pages and waits (the engine's op deadline) for
        the writes already admitted. Returns the pages whose writes did not end in time
        (their windows are closed all the same: no write passes them any more)."""
        late = self.wait_writes(self.close_writes(pages))
        for i in late:
            logger.error("kvbridge: a write into page %d outlived its window and the op deadline", i)
        return late

    def release_when_written(self, pages: list[int], release: Any) -> list[int]:
        """Closes the windows of pages LMCache is freeing and calls ``release(pages)`` for
        those that no write can land in any more. Pages with no window (never granted, or
        with the setting off) are released at once; the others from this channel's drain
        thread, which closes their windows (no write passes them after) and releases each
        page once the writes admitted before the close ended, so the caller (LMCache's free,
        on its event loop or a retrieve) never waits on a close. A page whose writes did not
        end within the op deadline is never released (a page is not reused while a write
        into it can land): counted in ``pages_withheld`` and logged. Returns the pages
        released at once."""
        if self.write_windows:
            with self._lock:
                windowed = {int(i) for i in pages if int(i) in self._windows or int(i) in self._closing}
        else:
            windowed = set()
        now = [i for i in pages if int(i) not in windowed]
        if now:
            release(now)
        if windowed:
            self._drains.put(([i for i in pages if int(i) in windowed], release))
            with self._lock:
                if self._drainer is None:
                    self._drainer = threading.Thread(
                        target=self._drain_loop, name=DRAIN_THREAD, daemon=True
                    )
                    self._drainer.start()
        return now

    def _drain_loop(self) -> None:
        while True:
            item = self._drains.get()
            if item is None:
                return
            pages, release = item
            try:
                waiting = set(self.close_writes(pages))
                late = set(self.wait_writes(sorted(waiting))) if waiting else set()
            except Exception:  # noqa: BLE001 - the channel closed: nothing is released
                late = set(pages)
            done = [i for i in pages if i not in late]
            if done:
                try:
                    release(done)
                except Exception:  # noqa: BLE001 - LMCache's free; the loop goes on
                    logger.exception("kvbridge: freeing pages %s failed", done[:8])
            if late:
                with self._lock:
                    self.pages_withheld += len(late)
                logger.error(
                    "kvbridge: writes into pages %s did not end within the op deadline after "
                    "their windows closed: the pages are withheld from LMCache's allocator",
                    sorted(late)[:8],
                )

    def _refused(self, lmc_peer: str, p: _Peer) -> None:
        """This channel's write was refused by the receiver's window check: counted, and
        logged once per peer."""
        with self._lock:
            self._own_write_refusals += 1
            first = p.kb_peer not in self._refusal_logged
            self._refusal_logged.add(p.kb_peer)
        if first:
            logger.error(
                "kvbridge: LMCache peer %s (%s) refused a write outside the pages it allocated "
                "to us (AccessDenied); further refusals are counted (write_refusals), not logged",
                lmc_peer, p.kb_peer,
            )  # fmt: skip

    ############################################################
    # Pages
    ############################################################

    def get_local_mem_indices(self, objects: Union[list[bytes], list[MemoryObj]]) -> list[int]:
        indices = []
        for obj in objects:
            if not isinstance(obj, MemoryObj):
                raise NotImplementedError(
                    "kvbridge channel moves pages of its arena (MemoryObj), not raw bytes"
                )
            indices.append(obj.meta.address)
        return indices

    def _plan(
        self, objects: list, transfer_spec: Optional[dict], id_key: str
    ) -> tuple[str, list[int], list[int]]:
        if transfer_spec is None or id_key not in transfer_spec:
            raise ValueError(f"kvbridge: transfer_spec must name {id_key!r} and 'remote_indexes'")
        remote = [int(i) for i in transfer_spec["remote_indexes"]]
        local = self.get_local_mem_indices(objects)
        if len(remote) != len(local):
            raise ValueError(
                f"kvbridge: {len(local)} objects but {len(remote)} remote_indexes "
                f"for {transfer_spec[id_key]!r}"
            )
        return transfer_spec[id_key], local, remote

    def _peer_for(self, lmc_peer: str) -> _Peer:
        with self._lock:
            p = self._peers.get(lmc_peer)
        if p is None:
            raise KeyError(
                f"kvbridge: no connection to LMCache peer {lmc_peer!r} "
                "(lazy_init_peer_connection was not called for it)"
            )
        return p

    def _redial(self, lmc_peer: str, p: _Peer) -> _Peer:
        """One dial to a peer whose session ended; a new incarnation is adopted."""
        if p.addr is None:
            raise kvbridge.UnknownPeer(
                f"kvbridge.lmcache: LMCache peer {lmc_peer!r} dialed us and its session ended; "
                "it must dial again",
                peer=p.kb_peer,
                step="connect",
            )
        kb_peer = self._ch.connect(p.addr)
        return self._readopt(lmc_peer, p, kb_peer)

    async def _async_redial(self, lmc_peer: str, p: _Peer) -> _Peer:
        if p.addr is None:
            raise kvbridge.UnknownPeer(
                f"kvbridge.lmcache: LMCache peer {lmc_peer!r} dialed us and its session ended; "
                "it must dial again",
                peer=p.kb_peer,
                step="connect",
            )
        kb_peer = await self._ch.connect_async(p.addr)
        return self._readopt(lmc_peer, p, kb_peer)

    def _readopt(self, lmc_peer: str, p: _Peer, kb_peer: str) -> _Peer:
        # A new incarnation at the same address is taken to check as the old one did.
        fresh = _Peer(
            kb_peer=kb_peer,
            region=self._arena_of(kb_peer, lmc_peer),
            addr=p.addr,
            integrity=p.integrity,
        )
        with self._lock:
            self._peers[lmc_peer] = fresh
        logger.info("kvbridge: LMCache peer %s redialed: %s -> %s", lmc_peer, p.kb_peer, kb_peer)
        return fresh

    def _failed(self, lmc_peer: str, p: _Peer, e: BaseException, step: str) -> None:
        if isinstance(e, _SESSION_ENDED):
            p.lost = True
        if step == "write" and _access_denied(e):
            p.lost = True  # the receiver ends the session of a refused write
            self._refused(lmc_peer, p)
        _note(e, f"kvbridge.lmcache: {step} of LMCache peer {lmc_peer!r} ({p.kb_peer}) failed")

    def _xfer(self, objects: list, transfer_spec: Optional[dict], id_key: str, write: bool) -> int:
        if not objects:
            return 0
        lmc_peer, local, remote = self._plan(objects, transfer_spec, id_key)
        p = self._peer_for(lmc_peer)
        step = "write" if write else "read"
        plain = self._ch.write_pages if write else self._ch.read_pages

        def op(p: _Peer) -> None:
            if write and self.integrity and p.integrity:
                self._write_checked(lmc_peer, p, local, remote)
            else:
                plain(p.kb_peer, self._region, local, p.region, remote)

        try:
            if p.lost:
                p = self._redial(lmc_peer, p)
            try:
                op(p)
            except kvbridge.UnknownPeer:
                # No session to that incarnation any more (nothing of this batch moved):
                # dial once; a peer that answers again is a new incarnation.
                p = self._redial(lmc_peer, p)
                op(p)
        except kvbridge.KvbridgeError as e:
            self._failed(lmc_peer, p, e, step)
            raise
        return len(objects)

    async def _async_xfer(
        self, objects: list, transfer_spec: Optional[dict], id_key: str, write: bool
    ) -> int:
        if not objects:
            return 0
        lmc_peer, local, remote = self._plan(objects, transfer_spec, id_key)
        p = self._peer_for(lmc_peer)
        step = "write" if write else "read"
        plain = self._ch.write_pages_async if write else self._ch.read_pages_async

        async def op(p: _Peer) -> None:
            if write and self.integrity and p.integrity:
                await self._async_write_checked(lmc_peer, p, local, remote)
            else:
                await plain(p.kb_peer, self._region, local, p.region, remote)

        try:
            if p.lost:
                p = await self._async_redial(lmc_peer, p)
            try:
                await op(p)
            except kvbridge.UnknownPeer:
                p = await self._async_redial(lmc_peer, p)
                await op(p)
        except kvbridge.KvbridgeError as e:
            self._failed(lmc_peer, p, e, step)
            raise
        return len(objects)

    def batched_write(self, objects, transfer_spec: Optional[dict] = None) -> int:
        """Writes the objects' pages into the receiver's pages; returns once they landed."""
        return self._xfer(objects, transfer_spec, "receiver_id", write=True)

    def batched_read(self, buffers, transfer_spec: Optional[dict] = None) -> int:
        """Reads the sender's pages into the buffers' pages; returns once they landed."""
        return self._xfer(buffers, transfer_spec, "sender_id", write=False)

    async def async_batched_write(self, objects, transfer_spec: Optional[dict] = None) -> int:
        return await self._async_xfer(objects, transfer_spec, "receiver_id", write=True)

    async def async_batched_read(self, buffers, transfer_spec: Optional[dict] = None) -> int:
        return await self._async_xfer(buffers, transfer_spec, "sender_id", write=False)

    # Two-sided send/recv is not part of LMCache's PD protocol (NIXL does not offer it either).
    def batched_send(self, objects, transfer_spec: Optional[dict] = None) -> int:
        raise NotImplementedError("kvbridge channel: use batched_write (one-sided)")

    def batched_recv(self, buffers, transfer_spec: Optional[dict] = None) -> int:
        raise NotImplementedError("kvbridge channel: use batched_read (one-sided)")

    async def async_batched_send(self, objects, transfer_spec: Optional[dict] = None) -> int:
        raise NotImplementedError("kvbridge channel: use async_batched_write (one-sided)")

    async def async_batched_recv(self, buffers, transfer_spec: Optional[dict] = None) -> int:
        raise NotImplementedError("kvbridge channel: use async_batched_read (one-sided)")

    ############################################################
    # Cleanup
    ############################################################

    def close(self) -> None:
        """Stops the listener and the notification thread, deregisters the arena. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._ch.close()
        self._drains.put(None)
        self._dispatcher.join(timeout=2.0)
        with self._lock:
            for fut in [*self._acks.values(), *self._verdicts.values()]:
                if not fut.done():
                    fut.cancel()
            self._acks.clear()
            self._verdicts.clear()
