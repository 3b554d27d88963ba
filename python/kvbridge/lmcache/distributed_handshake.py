"""The two notifications that introduce a dialer's L1 arena to the peer it dialed.

A kvbridge session already authenticates both peers and tells each the other's id; what
LMCache's distributed layer adds is a name per peer (its ``advertise_url``) and one arena
per peer. After ``Channel.connect`` the dialer notifies ``Hello`` (its url and arena);
the dialed side registers a reverse client for that url and answers ``Welcome`` (its own
url and arena). The dialer's ``get_transfer_channel_client`` returns only after the
``Welcome``, so by then the peer holds its reverse client, as NIXL's two-stage ZMQ
handshake guarantees.

Messages are msgpack (msgspec, tagged by class name) after a fixed prefix, so a
notification of anyone else's protocol on the same channel is told apart and ignored.
"""

from __future__ import annotations

import threading
import time
from typing import Optional, Union

import msgspec

PREFIX = b"kvbridge.lmcache.tc/1\n"
"""Starts every handshake notification; its version changes with the message shapes."""


class ArenaInfo(msgspec.Struct, frozen=True):
    """A peer's registered L1 arena: enough to address its pages."""

    region: str
    """The region id in decimal (kvbridge's ids are 128-bit, more than msgpack's ints)."""
    length: int
    page_size: int

    @classmethod
    def of(cls, region: int, length: int, page_size: int) -> "ArenaInfo":
        return cls(region=str(region), length=length, page_size=page_size)

    @property
    def region_id(self) -> int:
        """The region id (checked to be decimal digits by ``decode``)."""
        return int(self.region)


class Hello(msgspec.Struct, tag=True, frozen=True):
    """Dialer -> dialed: who I am and what you may read of mine."""

    nonce: int
    advertise_url: str
    arena: ArenaInfo


class Welcome(msgspec.Struct, tag=True, frozen=True):
    """Dialed -> dialer: the answer to the ``Hello`` with the same nonce."""

    nonce: int
    advertise_url: str
    arena: ArenaInfo


Message = Union[Hello, Welcome]

_decoder = msgspec.msgpack.Decoder(Message)
_encoder = msgspec.msgpack.Encoder()


class MalformedMessage(ValueError):
    """A notification that carries the prefix but no valid message."""


def encode(msg: Message) -> bytes:
    """The notification payload of ``msg``."""
    return PREFIX + _encoder.encode(msg)


def decode(data: bytes) -> Optional[Message]:
    """The message of a notification; ``None`` if it is not ours (no prefix).

    Raises ``MalformedMessage`` if it has the prefix but does not decode, or names an
    arena that is not a positive whole number of positive pages.
    """
    if not data.startswith(PREFIX):
        return None
    try:
        msg = _decoder.decode(data[len(PREFIX) :])
    except msgspec.DecodeError as err:
        raise MalformedMessage(f"undecodable handshake message: {err}") from err
    arena = msg.arena
    if (
        not (arena.region.isascii() and arena.region.isdigit() and len(arena.region) <= 39)
        or arena.page_size <= 0
        or arena.length <= 0
        or arena.length % arena.page_size != 0
    ):
        raise MalformedMessage(f"invalid arena in {type(msg).__name__}: {arena}")
    return msg


class PendingWelcomes:
    """Dialers waiting for their ``Welcome``, keyed by the nonce of their ``Hello``.

    The thread that receives notifications delivers; the dialing threads wait. A Welcome
    whose nonce nobody waits for (late, after its dialer gave up) is dropped.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_nonce = 1
        self._slots: dict[int, tuple[str, threading.Event, list]] = {}

    def open(self, peer: str) -> int:
        """A fresh nonce for a Hello to ``peer``; its Welcome must come from ``peer``."""
        with self._lock:
            nonce = self._next_nonce
            self._next_nonce += 1
            self._slots[nonce] = (peer, threading.Event(), [])
        return nonce

    def deliver(self, peer: str, welcome: Welcome) -> bool:
        """Hand ``welcome`` from ``peer`` to its waiter; ``False`` if nobody waits for it."""
        with self._lock:
            slot = self._slots.get(welcome.nonce)
            if slot is None or slot[0] != peer:
                return False
            _, event, box = slot
            box.append(welcome)
        event.set()
        return True

    def wait(self, nonce: int, deadline: float) -> Optional[Welcome]:
        """The Welcome for ``nonce`` once it arrives, or ``None`` at ``deadline``
        (``time.monotonic()``); the slot is closed either way."""
        with self._lock:
            slot = self._slots.get(nonce)
        if slot is None:
            return None
        _, event, box = slot
        try:
            event.wait(max(0.0, deadline - time.monotonic()))
            with self._lock:
                return box[0] if box else None
        finally:
            with self._lock:
                self._slots.pop(nonce, None)

    def fail_all(self) -> None:
        """Wake every waiter empty-handed (the context is closing)."""
        with self._lock:
            slots = list(self._slots.values())
        for _, event, _ in slots:
            event.set()
