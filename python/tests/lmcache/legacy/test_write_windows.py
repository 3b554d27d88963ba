"""Write windows (issue 41 §1): an LMCache sender writes only the pages the receiver
allocated to it, over TCP; any other write is refused by the receiver's engine, typed,
counted and lands nothing.

Attackers hold the secret (the suite's channels share the environment's). The first test is
the issue's reproduction: a peer with no allocation dials a real LMCache PD receiver process
(``transfer_channel: kvbridge``, ``KVBRIDGE_TRANSPORT=tcp``) and writes over the first page
of its arena.
"""

from __future__ import annotations

import math
import threading
import time
import typing

import pytest

from pdproc import Role
from test_channel import PAGE, Arena, _objs, _url, make  # noqa: F401 - make is a fixture
from test_integrity import transport  # noqa: F401 - a fixture
from test_pd_processes import KV_SMALL, _receiver, free_ports, procs  # noqa: F401 - procs too


@pytest.fixture(autouse=True)
def tcp(monkeypatch):
    monkeypatch.setenv("KVBRIDGE_TRANSPORT", "tcp")


def _denied(e) -> bool:
    import kvbridge

    return isinstance(e, kvbridge.Rejected) and e.code == "AccessDenied"


def _page_digest(r: Role, index: int) -> int:
    r.send(op="page", index=index)
    return r.expect("page", timeout=10)["digest"]


@pytest.mark.parametrize("windows", [True, False])
def test_a_peer_with_no_allocation_cannot_write_an_lmcache_receivers_page(tmp_path, procs, make, windows):  # noqa: F811
    import kvbridge

    init_port, alloc_port = free_ports(2)
    env = {"KVBRIDGE_TRANSPORT": "tcp", "KVBRIDGE_LMCACHE_WRITE_WINDOWS": "1" if windows else "0"}
    receiver = _receiver(tmp_path, 0, 1, [init_port], [alloc_port], env, mode="async")
    procs.append(receiver)
    receiver.expect("ready", timeout=120)
    before = _page_digest(receiver, 0)

    # The attacker's arena has the receiver's page size: one KV chunk of KV_SMALL (bf16).
    page = math.prod(int(x) for x in KV_SMALL.split(",")) * 2
    attacker = make("sender", arena=Arena(pages=2, page=page))
    attacker.lazy_init_peer_connection("", "R", f"127.0.0.1:{init_port}")
    attacker.arena.fill(0, seed=66)
    spec = {"receiver_id": "R", "remote_indexes": [0]}
    if not windows:  # the default: the write lands (what the setting guards against)
        attacker.batched_write(_objs([0]), spec)
        assert _page_digest(receiver, 0) == kvbridge.digest(attacker.arena.page_bytes(0))
        return
    with pytest.raises(kvbridge.Rejected) as e:
        attacker.batched_write(_objs([0]), spec)
    assert _denied(e.value) and e.value.step == "write" and e.value.peer, e.value
    assert _page_digest(receiver, 0) == before, "the refused write landed"
    assert attacker.write_refusals == 1
    receiver.send(op="windows")
    ev = receiver.expect("windows", timeout=10)
    assert ev == {"event": "windows", "on": True, "open": 0, "refused": 1}, ev


def _three(make):  # noqa: F811
    url = _url()
    r = make("receiver", url, write_windows=True)
    a, b = make("sender"), make("sender")
    for s in (a, b):
        s.lazy_init_peer_connection("", "R", url)
        s.arena.fill(0, seed=id(s) % 1000)
    return r, a, b


def _until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def _write(s, page):
    s.batched_write(_objs([0]), {"receiver_id": "R", "remote_indexes": [page]})


def test_a_sender_cannot_write_the_pages_allocated_to_another(make, transport):  # noqa: F811
    # Whatever KVBRIDGE_TRANSPORT says, writes into a confined arena go over TCP, where the
    # receiver's process checks them: no same-host copy or UCX put reaches it.
    import kvbridge

    r, a, b = _three(make)
    r.grant_writes(a.writer_id, [3, 4])
    r.grant_writes(b.writer_id, [5])
    with pytest.raises(kvbridge.Rejected) as e:
        _write(b, 3)
    assert _denied(e.value)
    assert r.arena.page_bytes(3) == bytes(PAGE)
    assert (r.write_refusals, b.write_refusals) == (1, 1)
    # the owner's pages still take its writes, and the refused sender's own page its own
    _write(a, 3)
    assert r.arena.page_bytes(3) == a.arena.page_bytes(0)
    # The refusal ended b's session (its engine told it of the refusal only once b's side
    # was down); once the receiver has dropped it too, b dials again. A dial racing the
    # receiver's drop can still lose its new session there: not the subject here.
    _until(lambda: r._ch.stats()["sessions"] == 1)
    _write(b, 5)
    assert r.arena.page_bytes(5) == b.arena.page_bytes(0)
    with pytest.raises(kvbridge.Rejected):
        _write(a, 5)
    assert r.arena.page_bytes(5) == b.arena.page_bytes(0)
    assert r.write_refusals == 2
    moved = {k: v for k, v in a._ch.stats().items() if k in ("shm_batches", "cma_batches", "ucx_batches")}
    assert set(moved.values()) == {0}, (transport, moved)


def test_a_page_handed_out_again_is_closed_to_its_last_holder(make):  # noqa: F811
    import kvbridge

    r, a, b = _three(make)
    r.grant_writes(a.writer_id, [7])
    _write(a, 7)
    r.grant_writes(b.writer_id, [7])  # LMCache freed page 7 and allocated it to b
    with pytest.raises(kvbridge.Rejected) as e:
        _write(a, 7)
    assert _denied(e.value)
    assert r.arena.page_bytes(7) == a.arena.page_bytes(0)
    _write(b, 7)
    assert r.arena.page_bytes(7) == b.arena.page_bytes(0)
    r.revoke_writes([7])
    with pytest.raises(kvbridge.Rejected):
        _write(b, 7)


def test_the_alloc_request_names_its_writer_and_stays_lmcaches_wire():
    import msgspec

    import kvbridge.lmcache
    from lmcache.v1.storage_backend import pd_backend, pd_backend_async

    kvbridge.lmcache.install()
    from kvbridge.lmcache import alloc_windows

    assert set(alloc_windows.installed()) == set(alloc_windows.BACKENDS)
    for mod in (pd_backend, pd_backend_async):
        members = typing.get_args(mod.PDMsg)
        ext = next(t for t in members if t.__name__ == "AllocRequest")
        assert ext is not mod.AllocRequest and issubclass(ext, mod.AllocRequest)
        lmcaches = typing.Union[tuple(mod.AllocRequest if t is ext else t for t in members)]
        fields = dict(keys=["k"], fmt=1, shape=[2, 2], dtype="bfloat16", last_chunk_toks=3)
        wire = msgspec.msgpack.encode(ext(**fields, kvbridge_writer="lmcache-sender-x"))
        got = msgspec.msgpack.decode(wire, type=mod.PDMsg)
        assert isinstance(got, mod.AllocRequest) and got.kvbridge_writer == "lmcache-sender-x"
        # an LMCache without the hook decodes the same bytes, ignoring the field
        plain = msgspec.msgpack.decode(wire, type=lmcaches)
        assert type(plain) is mod.AllocRequest and plain.keys == ["k"]


def _alloc_socket(port):
    import zmq

    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.RCVTIMEO, 20_000)
    s.setsockopt(zmq.SNDTIMEO, 20_000)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def _ask(sock, mod, msg):
    import msgspec

    sock.send(msgspec.msgpack.encode(msg))
    return msgspec.msgpack.decode(sock.recv(), type=mod.PDMsg)


@pytest.mark.parametrize(
    "mode,end",
    [("async", "consumed"), ("sync", "consumed"), ("async", "cancelled"), ("async", "cancelled, still held")],
)
def test_a_sender_cannot_write_its_pages_again_once_they_were_consumed_or_cancelled(tmp_path, procs, make, mode, end):  # noqa: F811
    """The attacker is the session the receiver allocated the pages to, and holds the
    secret: it asks for two chunks with LMCache's own AllocRequest (naming itself, as a
    hooked sender does), writes them (they land), and once the decoder consumed them (read
    and removed, as LMCache's retrieve does) or the request was cancelled (LMCache's
    CancelNotif; also while another request that found the same keys still holds the
    pages, so that the cancel frees nothing), writes the same pages again: refused, typed,
    counted, nothing lands, and freed pages are back in the allocator."""
    import importlib

    import torch

    import kvbridge
    import kvbridge.lmcache
    from lmcache.utils import CacheEngineKey

    kvbridge.lmcache.install()
    mod = importlib.import_module(
        "lmcache.v1.storage_backend." + ("pd_backend_async" if mode == "async" else "pd_backend")
    )
    ext = next(t for t in typing.get_args(mod.PDMsg) if t.__name__ == "AllocRequest")
    init_port, alloc_port = free_ports(2)
    env = {"KVBRIDGE_TRANSPORT": "tcp", "KVBRIDGE_LMCACHE_WRITE_WINDOWS": "1"}
    receiver = _receiver(tmp_path, 0, 1, [init_port], [alloc_port], env, mode=mode)
    procs.append(receiver)
    total = receiver.expect("ready", timeout=120)["total"]

    shape = [int(x) for x in KV_SMALL.split(",")]
    attacker = make("sender", arena=Arena(pages=2, page=math.prod(shape) * 2))
    attacker.lazy_init_peer_connection("", "R", f"127.0.0.1:{init_port}")
    attacker.arena.fill(0, seed=71)
    keys = [
        CacheEngineKey(model_name="kvbridge-test", world_size=1, worker_id=0, chunk_hash=h,
                       dtype=torch.bfloat16).to_string()
        for h in (4101, 4102)
    ]  # fmt: skip
    fields = dict(keys=keys, fmt=1, shape=shape, dtype="bfloat16", last_chunk_toks=shape[2])

    def ask(req_id: str, writer: str):
        more = dict(req_id=req_id, is_last_batch=False, total_chunks=3) if mode == "async" else {}
        return _ask(sock, mod, ext(**fields, **more, kvbridge_writer=writer))

    sock = _alloc_socket(alloc_port)
    try:
        got = ask("req-w", attacker.writer_id)
        pages = list(got.remote_indexes)
        assert len(pages) == 2 and min(pages) >= 0, got
        for p in pages:  # the allocation's writes land
            _write(attacker, p)
            assert _page_digest(receiver, p) == kvbridge.digest(attacker.arena.page_bytes(0))
        receiver.send(op="windows")
        assert receiver.expect("windows", timeout=10)["open"] == 2
        held = 0
        if end == "consumed":
            receiver.send(op="consume", keys=keys, want_free=total)
            assert receiver.expect("consumed", timeout=10)["free"] == total
        else:
            if end == "cancelled, still held":  # another request finds both chunks sent
                assert ask("req-x", "someone-else").already_sent_indexes == [0, 1]
                held = 2
            _ask(sock, mod, mod.CancelNotif(req_id="req-w", keys=keys))
    finally:
        sock.close()

    attacker.arena.fill(0, seed=72)
    before = _page_digest(receiver, pages[0])
    with pytest.raises(kvbridge.Rejected) as e:
        _write(attacker, pages[0])
    assert _denied(e.value) and e.value.step == "write", e.value
    assert _page_digest(receiver, pages[0]) == before, "the refused write landed"
    assert attacker.write_refusals == 1
    receiver.send(op="windows")
    assert receiver.expect("windows", timeout=10) == {"event": "windows", "on": True, "open": 0, "refused": 1}
    deadline = time.monotonic() + 10
    while True:  # freed pages go back from the channel's drain thread
        receiver.send(op="free")
        free = receiver.expect("free", timeout=10)["free"]
        if free == total - held or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert free == total - held, "the pages did not go back"


class _Landing:
    """The receiver's engine as seen while a write admitted through a window still lands:
    ``close_windows`` closes the windows (the real ones: no write passes them any more) but
    reports their drains done only once ``landed`` is set."""

    def __init__(self, real, patience=0.5):
        self.real, self.landed, self.closed = real, threading.Event(), set()
        self.patience = patience

    def __getattr__(self, name):
        return getattr(self.real, name)

    def close_windows(self, wids, timeout=None):
        new = [w for w in wids if w not in self.closed]
        if new:
            assert self.real.close_windows(new, timeout=timeout) == []
            self.closed.update(new)
        if not self.landed.wait(0 if timeout == 0 else self.patience):
            return list(wids)
        return []


@pytest.mark.parametrize("lands", [True, False])
def test_a_freed_page_goes_back_only_once_no_write_into_it_can_land(make, lands):  # noqa: F811
    import kvbridge

    r, a, _ = _three(make)
    r.grant_writes(a.writer_id, [7, 8])
    engine = r._ch = _Landing(r._ch)
    released: list[int] = []
    back = threading.Event()

    def release(pages):
        released.extend(pages)
        back.set()

    assert r.release_when_written([7, 8], release) == []
    _until(lambda: len(engine.closed) == 2)  # closed by the drain thread
    with pytest.raises(kvbridge.Rejected):  # closed: no new write passes
        _write(a, 7)
    assert released == [], "a page went back while a write into it could still land"
    if lands:
        engine.landed.set()
        assert back.wait(10)
        assert sorted(released) == [7, 8] and r.pages_withheld == 0
        assert not r.has_writes([7, 8])
    else:  # past the op deadline: the pages are never handed back
        _until(lambda: r.pages_withheld == 2)
        assert released == [] and r.has_writes([7, 8])


def test_a_page_handed_out_with_a_write_still_landing_does_not_hold_lmcaches_event_loop(make):  # noqa: F811
    """PDBackendAsync allocates on its event loop; when a page comes back to it with its
    last holder's write still landing (a free the hook did not see), the hooked allocation
    waits for that write off the loop, then opens the page to the new writer."""
    import asyncio
    from types import SimpleNamespace

    import kvbridge
    from kvbridge.lmcache import alloc_windows

    r, a, b = _three(make)
    r.grant_writes(a.writer_id, [7])
    engine = r._ch = _Landing(r._ch, patience=10)

    async def allocate(self, request):  # LMCache's allocation handed page 7 out again
        return SimpleNamespace(remote_indexes=[7], already_sent_indexes=[])

    hooked = alloc_windows._granting(allocate, True)
    backend = SimpleNamespace(transfer_channel=r)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        tick = asyncio.create_task(ticker())
        alloc = asyncio.create_task(hooked(backend, SimpleNamespace(kvbridge_writer=b.writer_id)))
        await asyncio.sleep(0)
        seen = ticks
        while ticks < seen + 5:  # the loop runs while the allocation waits
            await asyncio.sleep(0.001)
        assert not alloc.done(), "the allocation returned before the write into its page ended"
        engine.landed.set()
        await asyncio.wait_for(alloc, 10)
        tick.cancel()

    asyncio.run(main())
    _write(b, 7)
    assert r.arena.page_bytes(7) == b.arena.page_bytes(0)
    with pytest.raises(kvbridge.Rejected):
        _write(a, 7)
