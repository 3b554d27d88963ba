"""KvbridgeChannel's integrity check: the writer digests each page it writes, the receiver
digests what landed and answers; a page that changed on the way fails the write as
``integrity``. Two channels in one process, over each transport the channel runs on here.

The fault is a test-only hook on the receiving side: ``_landed_digests`` (what the receiver
digests before its verdict) is wrapped so that it first flips one byte of a page that
landed, as a bit flipped in flight would leave it.
"""

from __future__ import annotations

import asyncio
import ctypes

import pytest

from test_channel import PAGE, _objs, _url, make  # noqa: F401 - make is a fixture


TRANSPORTS = ["tcp", "shm", "cma", "ucx"]
# Which stats counter shows a batch moved over the transport (tcp: none of them). The
# channel registers LMCache's arena as caller memory, which no peer can map: with
# KVBRIDGE_TRANSPORT=shm the same-host path moves its bytes by cross-memory attach.
_COUNTERS = ("shm_batches", "cma_batches", "ucx_batches")
_COUNTER = {"shm": "cma_batches", "cma": "cma_batches", "ucx": "ucx_batches"}


@pytest.fixture(params=TRANSPORTS)
def transport(request, monkeypatch):
    """KVBRIDGE_TRANSPORT as a deployment sets it: tcp, shm, ucx; cma is the default
    transport between two processes' (here: channels') private memory."""
    import kvbridge

    t = request.param
    if t == "ucx":
        if "ucx" not in kvbridge.TRANSPORTS:
            pytest.skip("this kvbridge package was built without UCX")
        monkeypatch.setenv("UCX_TLS", "posix,cma,self")
    if t == "cma":
        monkeypatch.delenv("KVBRIDGE_TRANSPORT", raising=False)
    else:
        monkeypatch.setenv("KVBRIDGE_TRANSPORT", t)
    return t


def _moved_over(ch, transport, batches):
    stats = ch._ch.stats()
    counted = {k: stats[k] for k in _COUNTERS}
    want = {k: (batches if k == _COUNTER.get(transport) else 0) for k in _COUNTERS}
    assert counted == want, (transport, stats)


@pytest.fixture
def flip_landed(monkeypatch):
    """Arms the fault: the receiver's next check first flips bit 0 of byte ``at`` of the
    ``nth`` page it is about to digest. Returns the list of (page address) flips done."""
    import kvbridge.lmcache.channel as mod

    real = mod._landed_digests
    done = []

    def arm(nth=0, at=PAGE // 2):
        def flipping(ranges):
            if not done:
                addr, _ = ranges[nth]
                b = ctypes.c_uint8.from_address(addr + at)
                b.value ^= 0x01
                done.append(addr)
            return real(ranges)

        monkeypatch.setattr(mod, "_landed_digests", flipping)
        return done

    return arm


def _pair(make, transport, **kw):  # noqa: F811 - make is the fixture
    url = _url()
    recv = make("receiver", url, integrity=kw.get("recv", True))
    send = make("sender", integrity=kw.get("send", True))
    send.lazy_init_peer_connection("S", "R", url)
    for i in range(4):
        send.arena.fill(i, seed=200 + i)
    return send, recv


def test_a_byte_flipped_where_it_landed_fails_the_write_as_integrity(make, transport, flip_landed):  # noqa: F811
    import kvbridge

    send, recv = _pair(make, transport)
    flips = flip_landed(nth=1)
    with pytest.raises(kvbridge.IntegrityError) as e:
        send.batched_write(_objs([0, 1, 2]), {"receiver_id": "R", "remote_indexes": [7, 8, 9]})
    assert flips, "the fault hook never ran: nothing was checked"
    assert e.value.cause == "integrity" and e.value.step == "integrity"
    assert e.value.pages == [8], e.value.pages
    assert isinstance(e.value, kvbridge.KvbridgeError)
    assert recv.integrity_checks == 3 and recv.integrity_failures == 1
    assert send.integrity_failures == 1
    _moved_over(send, transport, 1)
    # The session survives: the next write (no fault) is checked and passes.
    assert send.batched_write(_objs([3]), {"receiver_id": "R", "remote_indexes": [10]}) == 1
    assert recv.arena.page_bytes(10) == send.arena.page_bytes(3)
    assert recv.integrity_checks == 4 and recv.integrity_failures == 1


def test_the_async_write_fails_as_integrity_too(make, transport, flip_landed):  # noqa: F811
    import kvbridge

    send, recv = _pair(make, transport)
    flip_landed(nth=0)

    async def go():
        await send.async_batched_write(_objs([2]), {"receiver_id": "R", "remote_indexes": [5]})

    with pytest.raises(kvbridge.IntegrityError):
        asyncio.run(go())
    assert recv.integrity_failures == 1


def test_checked_writes_pass_and_land_byte_for_byte(make, transport):  # noqa: F811
    send, recv = _pair(make, transport)
    assert send.batched_write(_objs([0, 1, 2, 3]), {"receiver_id": "R", "remote_indexes": [60, 1, 2, 33]}) == 4

    async def go():
        await send.async_batched_write(_objs([1]), {"receiver_id": "R", "remote_indexes": [40]})

    asyncio.run(go())
    for src, dst in ((0, 60), (1, 1), (2, 2), (3, 33), (1, 40)):
        assert recv.arena.page_bytes(dst) == send.arena.page_bytes(src)
    assert recv.integrity_checks == 5 and recv.integrity_failures == 0
    _moved_over(send, transport, 2)


@pytest.mark.parametrize("off", ["sender", "receiver"])
def test_either_side_with_the_check_off_writes_unchecked(make, off, flip_landed):  # noqa: F811
    send, recv = _pair(make, "cma", **{"send" if off == "sender" else "recv": False})
    flips = flip_landed()
    assert send.batched_write(_objs([0]), {"receiver_id": "R", "remote_indexes": [3]}) == 1
    assert not flips and recv.integrity_checks == 0
    assert recv.arena.page_bytes(3) == send.arena.page_bytes(0)


def test_a_receiver_that_turned_the_check_off_answers_unchecked(make, flip_landed):  # noqa: F811
    # A receiver restarted with the check off, reached again by the writer's redial, is
    # taken to check as its old incarnation did: it answers that it did not, and the write
    # passes (with a warning), unchecked.
    send, recv = _pair(make, "cma")
    recv.integrity = False
    flips = flip_landed()
    assert send.batched_write(_objs([1]), {"receiver_id": "R", "remote_indexes": [2]}) == 1
    assert not flips and recv.integrity_checks == 0 and send.integrity_failures == 0
    assert recv.arena.page_bytes(2) == send.arena.page_bytes(1)


def test_the_setting_comes_from_the_environment(make, monkeypatch):  # noqa: F811
    from kvbridge.lmcache import channel as mod

    monkeypatch.setenv("KVBRIDGE_LMCACHE_INTEGRITY", "1")
    assert make("sender").integrity is True
    monkeypatch.setenv("KVBRIDGE_LMCACHE_INTEGRITY", "off")
    assert make("sender").integrity is False
    monkeypatch.delenv("KVBRIDGE_LMCACHE_INTEGRITY")
    assert make("sender").integrity is mod.DEFAULT_INTEGRITY
    assert make("sender", integrity=True).integrity is True
    monkeypatch.setenv("KVBRIDGE_LMCACHE_INTEGRITY", "maybe")
    with pytest.raises(ValueError, match="KVBRIDGE_LMCACHE_INTEGRITY"):
        make("sender")


def test_an_async_write_whose_check_message_fails_is_cancelled_and_let_go_first(make, monkeypatch):
    """The integrity message of an async write is built while the write is in flight; when
    that fails, the write is cancelled, and the error goes up only once the engine let go of
    the pages the write sends from (the caller may reuse them at once)."""
    send, recv = _pair(make, "cma")
    real, calls = send._ch, []

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def write_pages_async(self, *a, **kw):
            calls.append(real.write_pages_async(*a, **kw))
            return calls[-1]

    send._ch = Spy()

    def no_message(*_):
        raise RuntimeError("no message")

    monkeypatch.setattr(send, "_landed_msg", no_message)

    async def go():
        with pytest.raises(RuntimeError, match="no message"):
            await send.async_batched_write(_objs([1]), {"receiver_id": "R", "remote_indexes": [40]})
        (write,) = calls
        # (a write left to run ends done, not cancelled; a cancel not waited for, pending)
        assert write.cancelled() and write._kvb_let_go, (
            "the error went up before the write was cancelled and the engine let go of it"
        )

    asyncio.run(go())
    send._ch = real
    monkeypatch.undo()
    assert send.batched_write(_objs([2]), {"receiver_id": "R", "remote_indexes": [41]}) == 1
