"""Bytes land exactly where the ops say, in every form of the call."""

import asyncio

import numpy as np
import pytest

import kvbridge
from conftest import PAGE


def test_write_pages_lands_byte_exact(pair):
    pair.prefiller.write_pages(pair.peer, pair.staging_region, [0, 3, 5], pair.kv_region, [9, 1, 30])
    for local, remote in [(0, 9), (3, 1), (5, 30)]:
        assert np.array_equal(pair.kv_page(remote), pair.staging_page(local))
    untouched = [i for i in range(32) if i not in (9, 1, 30)]
    assert all(not pair.kv_page(i).any() for i in untouched)


def test_read_pages_copies_the_peers_pages(pair):
    pair.kv[:] = np.random.default_rng(1).integers(0, 256, pair.kv.size, dtype=np.uint8)
    out = np.zeros(4 * PAGE, dtype=np.uint8)
    rid = pair.prefiller.register_buffer(out, PAGE)
    pair.prefiller.read_pages(pair.peer, rid, [0, 1, 2, 3], pair.kv_region, [31, 0, 17, 2])
    for local, remote in enumerate([31, 0, 17, 2]):
        assert np.array_equal(out[local * PAGE : (local + 1) * PAGE], pair.kv_page(remote))


def test_page_len_moves_part_of_a_page(pair):
    pair.prefiller.write_pages(pair.peer, pair.staging_region, [2], pair.kv_region, [4], page_len=100)
    assert np.array_equal(pair.kv[4 * PAGE : 4 * PAGE + 100], pair.staging[2 * PAGE : 2 * PAGE + 100])
    assert not pair.kv[4 * PAGE + 100 : 5 * PAGE].any()


def test_byte_ops_write_and_read(pair):
    s, k = pair.staging_region, pair.kv_region
    pair.prefiller.write(pair.peer, [(s, 10, k, 1000, 333), (s, PAGE + 1, k, 5 * PAGE - 7, 4096)])
    assert np.array_equal(pair.kv[1000:1333], pair.staging[10:343])
    assert np.array_equal(pair.kv[5 * PAGE - 7 : 5 * PAGE - 7 + 4096], pair.staging[PAGE + 1 : PAGE + 4097])
    back = bytearray(4096)
    rid = pair.prefiller.register_buffer(back, 4096)
    pair.prefiller.read(pair.peer, [(rid, 0, k, 5 * PAGE - 7, 4096)])
    assert bytes(back) == pair.staging[PAGE + 1 : PAGE + 4097].tobytes()


def test_raw_pointer_registration(pair):
    buf = np.zeros(2 * PAGE, dtype=np.uint8)
    ptr = buf.__array_interface__["data"][0]
    rid = pair.prefiller.register(ptr, buf.nbytes, PAGE)
    pair.kv[7 * PAGE : 8 * PAGE] = 0xAB
    pair.prefiller.read_pages(pair.peer, rid, [1], pair.kv_region, [7])
    assert (buf[PAGE:] == 0xAB).all() and not buf[:PAGE].any()
    pair.prefiller.deregister(rid)


def test_notification_follows_the_writes_before_it(pair):
    for i in range(8):
        pair.prefiller.write_pages(pair.peer, pair.staging_region, [i], pair.kv_region, [i])
        pair.prefiller.notify(pair.peer, b"page %d" % i)
        got = pair.decoder.recv_notification(timeout=5)
        assert got == ("prefill-0", b"page %d" % i)
        assert np.array_equal(pair.kv_page(i), pair.staging_page(i))


def test_get_new_notifs_drains_by_peer_without_blocking(pair):
    assert pair.decoder.get_new_notifs() == {}
    for m in (b"a", b"b", b"c"):
        pair.prefiller.notify(pair.peer, m)
    assert pair.decoder.get_new_notifs() == {"prefill-0": [b"a", b"b", b"c"]}
    assert pair.decoder.get_new_notifs() == {}
    assert pair.decoder.recv_notification(timeout=0.05) is None


def test_peer_regions_and_stats(pair):
    [info] = pair.prefiller.peer_regions(pair.peer)
    assert (info.id, info.length, info.page_size) == (pair.kv_region, 32 * PAGE, PAGE)
    stats = pair.prefiller.stats()
    assert stats["established"] == 1 and stats["regions"] == 1


def test_connect_is_idempotent(pair):
    assert pair.prefiller.connect(pair.decoder.local_addr) == "decode-0"
    assert pair.prefiller.stats()["established"] == 1


def test_submit_then_poll(pair):
    t = pair.prefiller.submit_write_pages(pair.peer, pair.staging_region, [1, 2], pair.kv_region, [20, 21])
    assert t.poll() in ("PROC", "DONE")
    t.wait(timeout=10)
    assert t.poll() == "DONE" and t.error is None and t.done
    assert np.array_equal(pair.kv_page(21), pair.staging_page(2))
    out = np.zeros(PAGE, dtype=np.uint8)
    rid = pair.prefiller.register_buffer(out, PAGE)
    t = pair.prefiller.submit_read(pair.peer, [(rid, 0, pair.kv_region, 20 * PAGE, PAGE)])
    t.wait(timeout=10)
    assert np.array_equal(out, pair.staging_page(1))


def test_submitted_failure_is_reported_by_poll_and_wait(pair):
    pair.decoder.close()
    t = pair.prefiller.submit_write_pages(pair.peer, pair.staging_region, [0], pair.kv_region, [0])
    with pytest.raises(kvbridge.KvbridgeError) as e:
        t.wait(timeout=10)
    assert t.poll() == "ERR"
    assert isinstance(t.error, kvbridge.KvbridgeError)
    assert e.value.peer == "decode-0"


def test_asyncio_forms(pair):
    async def main():
        p = pair.prefiller
        assert await p.connect_async(pair.decoder.local_addr) == "decode-0"
        await p.write_pages_async(pair.peer, pair.staging_region, [6], pair.kv_region, [12])
        await p.write_async(pair.peer, [(pair.staging_region, 0, pair.kv_region, 13 * PAGE, PAGE)])
        await p.notify_async(pair.peer, b"done")
        assert await pair.decoder.recv_notification_async(5) == ("prefill-0", b"done")
        assert await pair.decoder.recv_notification_async(0.05) is None
        out = np.zeros(2 * PAGE, dtype=np.uint8)
        rid = p.register_buffer(out, PAGE)
        await asyncio.gather(
            p.read_pages_async(pair.peer, rid, [0], pair.kv_region, [12]),
            p.read_async(pair.peer, [(rid, PAGE, pair.kv_region, 13 * PAGE, PAGE)]),
        )
        assert np.array_equal(out[:PAGE], pair.staging_page(6))
        assert np.array_equal(out[PAGE:], pair.staging_page(0))
        with pytest.raises(kvbridge.InvalidOp):
            await p.write_pages_async(pair.peer, pair.staging_region, [0], pair.kv_region, [32])

    asyncio.run(main())


def test_asyncio_cancel_leaves_the_channel_usable(pair):
    async def main():
        waiter = asyncio.ensure_future(pair.decoder.recv_notification_async())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await pair.prefiller.notify_async(pair.peer, b"after cancel")
        assert await pair.decoder.recv_notification_async(5) == ("prefill-0", b"after cancel")

    asyncio.run(main())


def test_gil_is_released_while_a_call_blocks(pair):
    """A second Python thread runs while the first one waits in a blocking call.

    Every blocking call (writes, reads, connect, receive) waits through the same helper, so
    one call that blocks for a known time shows it: a receive with nothing to receive. A
    count of loop turns in a burst of writes depended on the scheduler of a loaded host.
    """
    import threading

    turns_needed = 1_000_000  # ~0.1 s of Python: twenty 5 ms GIL switch intervals
    go = threading.Event()
    done = threading.Event()

    def spin():
        go.wait()
        n = 0
        while n < turns_needed:
            n += 1
        done.set()

    t = threading.Thread(target=spin)
    t.start()
    try:
        go.set()
        # Holding the GIL for the whole wait would leave the spinner at most a few switch
        # intervals, too few for its turns; with the GIL released it finishes well inside.
        assert pair.decoder.recv_notification(timeout=3.0) is None
        assert done.is_set(), "the spinner did not finish while the call blocked: GIL held?"
    finally:
        done.wait(10)
        t.join()


class FakeTensor:
    """What register_buffer asks of a CPU tensor: data_ptr(), nbytes, device, is_contiguous()."""

    class device:
        type = "cpu"

    def __init__(self, array, contiguous=True):
        self.array = array
        self.contiguous = contiguous

    def data_ptr(self):
        return self.array.__array_interface__["data"][0]

    @property
    def nbytes(self):
        return self.array.nbytes

    def is_contiguous(self):
        return self.contiguous


def test_tensor_like_objects_register_by_data_ptr(pair):
    backing = np.zeros(2 * PAGE, dtype=np.uint8)
    tensor = FakeTensor(backing)
    rid = pair.prefiller.register_buffer(tensor, PAGE)
    pair.kv[3 * PAGE : 4 * PAGE] = 9
    pair.prefiller.read_pages(pair.peer, rid, [1], pair.kv_region, [3])
    assert (backing[PAGE:] == 9).all()
    with pytest.raises(kvbridge.InvalidOp, match="not contiguous"):
        pair.prefiller.register_buffer(FakeTensor(backing, contiguous=False), PAGE)
    gpu = FakeTensor(backing)
    gpu.device = type("device", (), {"type": "cuda"})
    with pytest.raises(kvbridge.InvalidOp, match="cuda"):
        pair.prefiller.register_buffer(gpu, PAGE)


def test_cpu_torch_tensor_registers(pair):
    """A real CPU tensor over memory torch did not allocate, where torch is installed (the
    LMCache environment has it)."""
    torch = pytest.importorskip("torch")
    t = torch.frombuffer(bytearray(2 * PAGE), dtype=torch.uint8)
    rid = pair.prefiller.register_buffer(t, PAGE)
    pair.kv[5 * PAGE : 6 * PAGE] = 77
    pair.prefiller.read_pages(pair.peer, rid, [1], pair.kv_region, [5])
    assert bool((t[PAGE:] == 77).all()) and not bool(t[:PAGE].any())
    rid16 = pair.prefiller.register_buffer(torch.from_numpy(np.ones(PAGE // 2, dtype=np.float16)), PAGE)
    pair.prefiller.write_pages(pair.peer, rid16, [0], pair.kv_region, [6])
    assert pair.kv_page(6).view(np.float16).tolist() == [1.0] * (PAGE // 2)


def test_a_tensor_torch_may_reallocate_is_refused(pair):
    """``resize_`` past a torch-allocated tensor's size frees its memory: registered, peers
    would then read and write freed memory of this process."""
    torch = pytest.importorskip("torch")
    t = torch.zeros(2 * PAGE, dtype=torch.uint8)
    with pytest.raises(kvbridge.InvalidOp, match="resizable"):
        pair.prefiller.register_buffer(t, PAGE)


def test_a_registered_tensor_keeps_its_memory_in_place(pair):
    """A registered tensor cannot be resized, and one moved to other storage (``set_``)
    leaves the registered memory allocated (here a numpy array, which only the tensor's
    first storage references) until the region is deregistered: a read lands in it, not in
    freed memory."""
    torch = pytest.importorskip("torch")
    import gc
    import weakref

    arr = np.zeros(2 * PAGE, dtype=np.uint8)
    memory = weakref.ref(arr)
    t = torch.from_numpy(arr)
    del arr
    rid = pair.prefiller.register_buffer(t, PAGE)
    with pytest.raises(RuntimeError, match="not resizable"):
        t.resize_(64 * PAGE)
    t.set_(torch.zeros(4, dtype=torch.uint8))
    gc.collect()
    assert memory() is not None, "the registered memory was freed while registered"
    pair.kv[5 * PAGE : 6 * PAGE] = 91
    pair.prefiller.read_pages(pair.peer, rid, [0], pair.kv_region, [5])
    assert bool((memory()[:PAGE] == 91).all())
    pair.prefiller.deregister(rid)
    gc.collect()
    assert memory() is None, "deregister kept the memory"


def test_cancel_returns_once_the_batch_let_go_and_checks_its_timeout(pair):
    t = pair.prefiller.submit_write_pages(pair.peer, pair.staging_region, [0], pair.kv_region, [0])
    assert t.cancel() is True  # ended or aborted: either way its task let go of it
    assert t.done
    with pytest.raises(kvbridge.InvalidOp):
        t.cancel(timeout=-1.0)
    with pytest.raises(kvbridge.InvalidOp):
        t.cancel(timeout=float("nan"))
