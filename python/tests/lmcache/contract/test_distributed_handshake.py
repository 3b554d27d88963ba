"""The notifications that introduce a dialer's arena: what is accepted, what is refused,
and who may answer whom."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest

from kvbridge.lmcache import distributed_handshake as hs

ARENA = hs.ArenaInfo.of(2**127 + 5, 4096, 256)


def test_messages_round_trip_with_128_bit_region_ids():
    for msg in (hs.Hello(nonce=3, advertise_url="h:1", arena=ARENA),
                hs.Welcome(nonce=3, advertise_url="h:2", arena=ARENA)):
        back = hs.decode(hs.encode(msg))
        assert back == msg
        assert back.arena.region_id == 2**127 + 5


def test_a_notification_without_the_prefix_is_not_ours():
    assert hs.decode(b"ProxyNotif") is None
    assert hs.decode(b"") is None


@pytest.mark.parametrize(
    "payload",
    [
        b"\xff\x00garbage",
        msgspec.msgpack.encode({"type": "Nope", "nonce": 1}),
        msgspec.msgpack.encode({"type": "Hello", "nonce": 1}),
    ],
)
def test_undecodable_messages_are_refused(payload):
    with pytest.raises(hs.MalformedMessage):
        hs.decode(hs.PREFIX + payload)


@pytest.mark.parametrize(
    "arena",
    [
        hs.ArenaInfo(region="-1", length=4096, page_size=256),
        hs.ArenaInfo(region="1e9", length=4096, page_size=256),
        hs.ArenaInfo(region="9" * 40, length=4096, page_size=256),
        hs.ArenaInfo(region="1", length=4096, page_size=0),
        hs.ArenaInfo(region="1", length=0, page_size=256),
        hs.ArenaInfo(region="1", length=4000, page_size=256),
    ],
)
def test_invalid_arenas_are_refused(arena):
    with pytest.raises(hs.MalformedMessage):
        hs.decode(hs.encode(hs.Hello(nonce=1, advertise_url="h:1", arena=arena)))


def test_a_welcome_reaches_the_dialer_that_waits_for_it():
    pending = hs.PendingWelcomes()
    nonce = pending.open("peer-b")
    welcome = hs.Welcome(nonce=nonce, advertise_url="b:1", arena=ARENA)
    threading.Timer(0.05, pending.deliver, ("peer-b", welcome)).start()
    assert pending.wait(nonce, time.monotonic() + 30) == welcome


def test_a_welcome_from_another_peer_is_not_delivered():
    pending = hs.PendingWelcomes()
    nonce = pending.open("peer-b")
    welcome = hs.Welcome(nonce=nonce, advertise_url="c:1", arena=ARENA)
    assert pending.deliver("peer-c", welcome) is False
    assert pending.wait(nonce, time.monotonic() + 0.05) is None


def test_a_late_welcome_finds_nobody():
    pending = hs.PendingWelcomes()
    nonce = pending.open("peer-b")
    assert pending.wait(nonce, time.monotonic()) is None
    late = hs.Welcome(nonce=nonce, advertise_url="b:1", arena=ARENA)
    assert pending.deliver("peer-b", late) is False


def test_closing_wakes_every_waiter_empty_handed():
    pending = hs.PendingWelcomes()
    nonce = pending.open("peer-b")
    threading.Timer(0.05, pending.fail_all).start()
    started = time.monotonic()
    assert pending.wait(nonce, started + 30) is None
    assert time.monotonic() - started < 25  # woken, not timed out
