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
    # The refusal ended b's session; once the receiver has dropped it, b dials again. (Over
    # shm and cma, a dial racing that drop can lose its new session: not the subject here.)
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
