"""A cancelled ``*_async`` call (a ``kvbridge.Call``) hands control back only once the
engine let go of the call's memory: the awaiting coroutine may reuse its pages in its
``except CancelledError`` clause and nothing of the cancelled batch lands in them (a read)
or is sent from them (a write) afterwards.

The batches are large (128 pages of 1 MiB) so that each is cancelled while its bytes are
still moving: the test waits until the first page of the batch has landed and checks that
the last one has not, then cancels. The coroutine that gave up marks the last byte of every
page it owns; a second batch of the same size on the same channel then runs behind the
cancelled one (the same connections and copy queues, in order), and the marks must still be
there (a read) or must not have reached the peer (a write). Over UCX the cancel ends the
session, and the Call returns once its teardown ended: the second batch runs on a new one.
"""

import asyncio
import gc
import logging
import time
import warnings
import weakref

import numpy as np
import pytest

import kvbridge
from conftest import channel

PAGE = 1 << 20
PAGES = 128
ALL = list(range(PAGES))  # a batch of every page
MARK = 0xA5
SENT = 7
AGAIN = 9
# The page tails a cancelled caller marks.
TAILS = slice(PAGE - 1, None, PAGE)


class Big:
    """A decoder owning two 128 MiB regions and a prefiller with two of its own, over TCP,
    over cross-memory attach (the same-host copy of caller memory; ``transport="auto"`` in
    one process) or over UCX (its same-user transports)."""

    def __init__(self, transport):
        self.transport = transport
        mode = {"tcp": "tcp", "cma": "auto", "ucx": "ucx"}[transport]
        self.decoder = channel("decode-0", "127.0.0.1:0", transport=mode)
        self.prefiller = channel("prefill-0", transport=mode)
        self.kv = np.zeros(PAGES * PAGE, dtype=np.uint8)
        self.kv2 = np.zeros(PAGES * PAGE, dtype=np.uint8)
        self.kv_region = self.decoder.register_buffer(self.kv, PAGE)
        self.kv2_region = self.decoder.register_buffer(self.kv2, PAGE)
        self.local = np.zeros(PAGES * PAGE, dtype=np.uint8)
        self.local2 = np.zeros(PAGES * PAGE, dtype=np.uint8)
        self.local_region = self.prefiller.register_buffer(self.local, PAGE)
        self.local2_region = self.prefiller.register_buffer(self.local2, PAGE)
        self.peer = self.prefiller.connect(self.decoder.local_addr)

    def direct_copies(self):
        return self.prefiller.stats()["ucx_batches" if self.transport == "ucx" else "cma_batches"]

    async def after_cancel(self):
        """Over UCX the cancel ended the session (its posted operations cannot be called
        back) and the Call waited for its teardown: dials again. Elsewhere the session goes
        on."""
        if self.transport == "ucx":
            with pytest.raises(kvbridge.UnknownPeer):
                await self.read(self.local2_region, self.kv2_region)
            self.peer = await self.prefiller.connect_async(self.decoder.local_addr)

    def after_transfer_cancel(self):
        """``after_cancel`` for a cancelled ``Transfer``."""
        asyncio.run(self.after_cancel())

    def submit_read(self, dst_region, src_region):
        return self.prefiller.submit_read_pages(self.peer, dst_region, ALL, src_region, ALL)

    def submit_write(self, src_region, dst_region):
        return self.prefiller.submit_write_pages(self.peer, src_region, ALL, dst_region, ALL)

    def read(self, dst_region, src_region):
        return self.prefiller.read_pages_async(self.peer, dst_region, ALL, src_region, ALL)

    def write(self, src_region, dst_region):
        return self.prefiller.write_pages_async(self.peer, src_region, ALL, dst_region, ALL)

    def close(self):
        self.prefiller.close()
        self.decoder.close()


@pytest.fixture(params=["tcp", "cma", "ucx"])
def big(request, monkeypatch):
    if request.param == "ucx":
        if "ucx" not in kvbridge.TRANSPORTS:
            pytest.skip("this kvbridge package was built without UCX")
        monkeypatch.setenv("UCX_TLS", "posix,cma,self")
    b = Big(request.param)
    yield b
    b.close()


def check_carrier(big, before):
    """The batches went the way the test is named for."""
    if big.transport == "tcp":
        assert big.direct_copies() == before, "a tcp test copied directly"
    else:
        assert big.direct_copies() > before, "no batch went by %s" % big.transport


async def until_under_way(task, first, last):
    """Returns once byte `first[0]` changed while `last[0]` did not yet: the batch is
    moving and not done. Fails if it ended first or never started."""
    deadline = time.monotonic() + 20
    while first[0] == 0:
        assert not task.done(), "the batch ended before its bytes were seen moving"
        assert time.monotonic() < deadline, "the batch never got under way"
        await asyncio.sleep(0)
    assert last[0] == 0, "the batch was nearly done when seen moving: nothing left to cancel"


WAYS = {
    "await": lambda call: call,
    "ensure_future": asyncio.ensure_future,
    "wait_for": lambda call: asyncio.wait_for(call, 60),
    "gather": lambda call: asyncio.gather(call),
}


@pytest.mark.parametrize("way", list(WAYS))
def test_a_cancelled_read_lands_nothing_after_its_cancelled_error(big, way):
    async def caller():
        try:
            await WAYS[way](big.read(big.local_region, big.kv_region))
        except asyncio.CancelledError:
            big.local[TAILS] = MARK  # the pages are the caller's again
            raise

    async def main():
        big.kv[:] = SENT
        big.kv2[:] = AGAIN
        before = big.direct_copies()
        task = asyncio.ensure_future(caller())
        await until_under_way(task, big.local[:1], big.local[-1:])
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await big.after_cancel()
        # behind the cancelled read on every connection and copy queue: its bytes, had any
        # still been on their way, would have landed by the time this one has
        await big.read(big.local2_region, big.kv2_region)
        assert (big.local2 == AGAIN).all(), "the read after the cancel did not land"
        landed_late = int((big.local[TAILS] != MARK).sum())
        assert landed_late == 0, "%d pages of the cancelled read landed after it was cancelled" % landed_late
        check_carrier(big, before)

    asyncio.run(main())


def test_a_cancelled_write_sends_nothing_after_its_cancelled_error(big):
    async def caller():
        try:
            await big.write(big.local_region, big.kv_region)
        except asyncio.CancelledError:
            big.local[TAILS] = MARK  # the pages are the caller's again
            raise

    async def main():
        big.local[:] = SENT
        big.local2[:] = AGAIN
        before = big.direct_copies()
        task = asyncio.ensure_future(caller())
        await until_under_way(task, big.kv[:1], big.kv[-1:])
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await big.after_cancel()
        await big.write(big.local2_region, big.kv2_region)
        assert (big.kv2 == AGAIN).all(), "the write after the cancel did not land"
        sent_late = int((big.kv[TAILS] == MARK).sum())
        assert sent_late == 0, "%d pages were read from the caller's memory after the cancel" % sent_late
        check_carrier(big, before)

    asyncio.run(main())


def until_moving(transfer, first, last):
    """``until_under_way`` for a ``Transfer``."""
    deadline = time.monotonic() + 20
    while first[0] == 0:
        assert transfer.poll() == "PROC", "the batch ended before its bytes were seen moving"
        assert time.monotonic() < deadline, "the batch never got under way"
    assert last[0] == 0, "the batch was nearly done when seen moving: nothing left to cancel"


def test_a_cancelled_transfer_read_lands_nothing_once_cancel_returned(big):
    big.kv[:] = SENT
    big.kv2[:] = AGAIN
    before = big.direct_copies()
    t = big.submit_read(big.local_region, big.kv_region)
    until_moving(t, big.local[:1], big.local[-1:])
    assert t.cancel(timeout=60) is True
    big.local[TAILS] = MARK  # the pages are the caller's again
    with pytest.raises(kvbridge.LocalError):
        t.wait(1)
    big.after_transfer_cancel()
    big.submit_read(big.local2_region, big.kv2_region).wait(60)
    assert (big.local2 == AGAIN).all(), "the read after the cancel did not land"
    landed_late = int((big.local[TAILS] != MARK).sum())
    assert landed_late == 0, "%d pages of the cancelled read landed after cancel() returned" % landed_late
    check_carrier(big, before)


def test_a_cancelled_transfer_write_sends_nothing_once_cancel_returned(big):
    big.local[:] = SENT
    big.local2[:] = AGAIN
    before = big.direct_copies()
    t = big.submit_write(big.local_region, big.kv_region)
    until_moving(t, big.kv[:1], big.kv[-1:])
    assert t.cancel(timeout=60) is True
    big.local[TAILS] = MARK
    big.after_transfer_cancel()
    big.submit_write(big.local2_region, big.kv2_region).wait(60)
    assert (big.kv2 == AGAIN).all(), "the write after the cancel did not land"
    sent_late = int((big.kv[TAILS] == MARK).sum())
    assert sent_late == 0, "%d pages were read from the caller's memory after cancel() returned" % sent_late
    check_carrier(big, before)


def test_wait_for_that_times_out_raises_once_the_engine_let_go(pair):
    async def main():
        call = pair.prefiller.write_pages_async(pair.peer, pair.staging_region, [0], pair.kv_region, [3])
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(call, 0)
        assert call.cancelled()
        assert call._kvb_let_go, "wait_for returned before the engine let go of the write"
        await asyncio.wait_for(
            pair.prefiller.write_pages_async(pair.peer, pair.staging_region, [1], pair.kv_region, [4]), 10
        )
        assert np.array_equal(pair.kv_page(4), pair.staging_page(1))

    asyncio.run(main())


def test_a_call_never_awaited_runs_to_its_end_silently_and_is_collected(pair):
    seen = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: seen.append(ctx))
        call = pair.prefiller.write_pages_async(pair.peer, pair.staging_region, [2], pair.kv_region, [9])
        assert isinstance(call, kvbridge.Call) and isinstance(call, asyncio.Future)
        gone = weakref.ref(call)
        del call
        deadline = time.monotonic() + 10
        while gone() is not None and time.monotonic() < deadline:
            gc.collect()
            await asyncio.sleep(0.001)
        assert gone() is None, "a call never awaited was not collected"
        assert np.array_equal(pair.kv_page(9), pair.staging_page(2))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
        gc.collect()
    assert not caught, [str(w.message) for w in caught]
    assert not seen, seen


class Fake:
    """What the engine's side hands a Call: an abort and a session end, counted."""

    def __init__(self):
        self.aborts = 0
        self.ends = 0

    def abort(self):
        self.aborts += 1

    def end(self):
        self.ends += 1


def test_a_cancel_the_engine_never_answers_ends_the_session_and_raises_timeout(caplog):
    fake = Fake()

    async def waiting(call):
        return await call

    async def main():
        loop = asyncio.get_running_loop()
        call = kvbridge.Call(loop, fake.abort, fake.end, 0.05, "read of 1 pages with peer p", "p", "read")
        # (awaited directly: asyncio.wait_for of Python 3.11 raises CancelledError whatever
        # the cancelled future ended with; the warning below is then what tells)
        task = asyncio.ensure_future(waiting(call))
        await asyncio.sleep(0)
        task.cancel()
        for _ in range(3):
            await asyncio.sleep(0)
        assert not task.done(), "the cancel returned before the engine let go"
        assert fake.aborts == 1 and fake.ends == 0
        with pytest.raises(kvbridge.Timeout) as e:
            await task
        assert (e.value.peer, e.value.step) == ("p", "read")
        assert "read of 1 pages with peer p" in str(e.value) and "ending the session" in str(e.value)
        assert fake.ends == 1
        call._kvb_released()  # the engine let go later: nothing changes
        assert isinstance(call.exception(), kvbridge.Timeout)

    with caplog.at_level(logging.WARNING, logger="kvbridge"):
        asyncio.run(main())
    assert any("peer p" in r.getMessage() for r in caplog.records)


def test_a_call_cancelled_turns_cancelled_when_the_engine_let_go_and_keeps_an_earlier_outcome():
    fake = Fake()

    async def main():
        loop = asyncio.get_running_loop()
        call = kvbridge.Call(loop, fake.abort, fake.end, 60.0, "write of 1 pages with peer p", "p", "write")
        assert call.cancel() is True and call.cancel() is True
        assert fake.aborts == 1 and not call.done()
        assert not call._kvb_wants_outcome(), "an outcome after the cancel would be set"
        call._kvb_released()
        assert call.cancelled() and fake.ends == 0
        done = kvbridge.Call(loop, fake.abort, fake.end, 60.0, "write", "p", "write")
        done.set_result(None)
        assert done.cancel() is False and fake.aborts == 1
        assert await done is None

    asyncio.run(main())
