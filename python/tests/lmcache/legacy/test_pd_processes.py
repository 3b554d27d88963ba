"""LMCache's unmodified PDBackendAsync on both sides, in separate processes, over kvbridge.

Each role is a process running ``pd_role.py`` (LMCache's backend, configured by a YAML file with
``transfer_channel: "kvbridge"`` and ``pd_buffer_device: "cpu"``); the test process is the
proxy's ZMQ PULL socket and decodes what arrives with LMCache's own ``PDMsg``.
"""

from __future__ import annotations

import time

import pytest

from pdproc import ProxySocket, Role, free_ports, write_config

KV_SMALL = "2,2,16,4,64"  # 32 KiB chunks
BUF = 64 << 20


def _receiver(tmp_path, rank, world, init_ports, alloc_ports, env=None, kv=KV_SMALL, buf=BUF, mode="async"):
    cfg = write_config(
        tmp_path / f"recv{rank}.yaml",
        pd_backend_mode=mode,
        pd_role="receiver",
        pd_buffer_size=buf,
        pd_peer_host="127.0.0.1",
        pd_peer_init_port=init_ports,
        pd_peer_alloc_port=alloc_ports,
        chunk_size=int(kv.split(",")[2]),
    )
    return Role("receiver", cfg, env, "--rank", str(rank), "--world-size", str(world), "--kv-shape", kv)


def _sender(tmp_path, rank, world, proxy_port, init_ports, alloc_ports, env=None, kv=KV_SMALL, buf=BUF, mode="async"):
    cfg = write_config(
        tmp_path / f"send{rank}.yaml",
        pd_backend_mode=mode,
        pd_role="sender",
        pd_buffer_size=buf,
        pd_proxy_host="127.0.0.1",
        pd_proxy_port=proxy_port,
        chunk_size=int(kv.split(",")[2]),
    )
    return Role(
        "sender",
        cfg,
        env,
        "--rank", str(rank),
        "--world-size", str(world),
        "--kv-shape", kv,
        "--receiver-init-ports", ",".join(map(str, init_ports)),
        "--receiver-alloc-ports", ",".join(map(str, alloc_ports)),
    )


@pytest.fixture
def procs():
    started: list = []
    yield started
    for p in started:
        if isinstance(p, Role):
            p.stop()
        else:
            p.close()


def _expect_all_free(role: Role, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        role.send(op="free")
        ev = role.expect("free", timeout=10)
        if ev["free"] == ev["total"] or time.monotonic() > deadline:
            return ev
        time.sleep(0.1)


@pytest.mark.parametrize(
    "tp,mode,transport,windows",
    [
        (1, "async", "auto", False),
        (2, "async", "auto", False),
        (1, "sync", "auto", False),
        (2, "async", "tcp", False),
        # The receivers confine writes to the pages they allocated (issue 41 §1).
        (2, "async", "tcp", True),
        (1, "sync", "tcp", True),
    ],
)
def test_kv_chunks_arrive_byte_exact_and_each_request_notifies_the_proxy(tmp_path, procs, tp, mode, transport, windows):
    ports = free_ports(2 * tp + 1)
    init_ports, alloc_ports, proxy_port = ports[:tp], ports[tp : 2 * tp], ports[-1]
    proxy = ProxySocket(proxy_port)
    procs.append(proxy)
    env = {"KVBRIDGE_TRANSPORT": transport, "KVBRIDGE_LMCACHE_WRITE_WINDOWS": "1" if windows else "0"}
    receivers = [_receiver(tmp_path, r, tp, init_ports, alloc_ports, env, mode=mode) for r in range(tp)]
    senders = [_sender(tmp_path, r, tp, proxy_port, init_ports, alloc_ports, env, mode=mode) for r in range(tp)]
    procs.extend(receivers + senders)
    for p in receivers + senders:
        ready = p.expect("ready", timeout=120)
        assert ready["channel"] == "kvbridge.lmcache.channel.KvbridgeChannel"
        assert ready["backend"] == ("PDBackend" if mode == "sync" else "PDBackendAsync")

    # Full chunks, a partial last chunk, a one-chunk request: all in flight at once.
    reqs = [("r-full", 4, 16, 11), ("r-partial", 3, 5, 12), ("r-one", 1, 7, 13)]
    for req, n, last, seed in reqs:
        for s in senders:
            s.send(op="put", req_id=req, chunks=n, last_chunk_toks=last, seed=seed)
    for s in senders:
        for _ in reqs:
            s.expect("submitted", timeout=60)
    got = proxy.collect({req: tp for req, *_ in reqs}, timeout=60)
    assert got == {req: tp for req, *_ in reqs}, f"ProxyNotifs: {got}"
    for r in receivers:
        r.send(op="windows")
        ev = r.expect("windows", timeout=10)
        assert ev["on"] == windows and ev["refused"] == 0, ev
        # one window per allocated page (4 + 3 + 1), each open to its sender
        assert ev["open"] == (8 if windows else 0), ev
    for req, n, last, seed in reqs:
        for r in receivers:
            r.send(op="check", req_id=req, chunks=n, last_chunk_toks=last, seed=seed)
            ev = r.expect("checked", timeout=30)
            assert ev["bad"] == [], f"{req}: chunks {ev['bad']} differ on a receiver"
    for s in senders:
        ev = _expect_all_free(s)
        assert ev["free"] == ev["total"], f"sender pages still held: {ev}"
    for r in receivers:
        # consumed: every page back in the allocator, its window closed first
        ev = _expect_all_free(r)
        assert ev["free"] == ev["total"], f"receiver pages still held: {ev}"
        r.send(op="windows")
        ev = r.expect("windows", timeout=10)
        assert ev["open"] == 0 and ev["refused"] == 0, ev


def test_receiver_listening_6s_after_the_sender_dials(tmp_path, procs):
    init_port, alloc_port, proxy_port = free_ports(3)
    proxy = ProxySocket(proxy_port)
    procs.append(proxy)
    sender = _sender(tmp_path, 0, 1, proxy_port, [init_port], [alloc_port])
    procs.append(sender)
    sender.expect("ready", timeout=120)
    t0 = time.monotonic()
    sender.send(op="put", req_id="late", chunks=2, last_chunk_toks=16, seed=21)
    time.sleep(6.0)  # the scenario: nothing listens for 6 s after the first dial
    receiver = _receiver(tmp_path, 0, 1, [init_port], [alloc_port])
    procs.append(receiver)
    receiver.expect("ready", timeout=120)
    ev = sender.expect("submitted", timeout=60)
    assert ev["secs"] >= 6.0 - 0.5, ev
    assert proxy.collect({"late": 1}, timeout=60) == {"late": 1}
    receiver.send(op="check", req_id="late", chunks=2, last_chunk_toks=16, seed=21)
    assert receiver.expect("checked", timeout=30)["bad"] == []
    print(f"late receiver: first write done {time.monotonic() - t0:.1f} s after the first dial")


def test_no_receiver_fails_with_a_typed_error_within_the_connect_deadline(tmp_path, procs):
    init_port, alloc_port, proxy_port = free_ports(3)
    sender = _sender(
        tmp_path, 0, 1, proxy_port, [init_port], [alloc_port],
        env={"KVBRIDGE_LMCACHE_CONNECT_TIMEOUT": "2"},
    )
    procs.append(sender)
    sender.expect("ready", timeout=120)
    sender.send(op="put", req_id="nobody", chunks=1, last_chunk_toks=16, seed=1)
    ev = sender.expect("submit_failed", timeout=30)
    assert ev["error"].startswith("ConnectionLost"), ev
    assert "connect" in ev["error"], ev
    assert 1.5 <= ev["secs"] <= 8.0, ev
    ev = _expect_all_free(sender)
    assert ev["free"] == ev["total"], ev


def test_receiver_killed_mid_transfer_fails_the_write_frees_pages_and_a_restart_works(tmp_path, procs):
    # Large chunks over TCP, so that the receiver dies while bytes are still moving.
    kv, buf = "8,2,256,8,64", 256 << 20  # 4 MiB chunks
    env = {"KVBRIDGE_TRANSPORT": "tcp"}
    init_port, alloc_port, proxy_port = free_ports(3)
    proxy = ProxySocket(proxy_port)
    procs.append(proxy)
    receiver = _receiver(tmp_path, 0, 1, [init_port], [alloc_port], env, kv, buf)
    sender = _sender(tmp_path, 0, 1, proxy_port, [init_port], [alloc_port], env, kv, buf)
    procs.extend([receiver, sender])
    receiver.expect("ready", timeout=120)
    total = sender.expect("ready", timeout=120)["total"]

    receiver.send(op="die_when_bytes_land", seed=31)
    receiver.expect("armed", timeout=10)
    sender.send(op="put", req_id="doomed", chunks=48, last_chunk_toks=256, seed=31)
    sender.expect("submitted", timeout=60)
    receiver.proc.wait(timeout=60)
    assert receiver.proc.returncode == -9

    ev = _expect_all_free(sender, timeout=40)
    assert ev == {"event": "free", "free": total, "total": total}, ev
    log = sender.output()
    assert "Async transfer task failed" in log, log
    assert "kvbridge.lmcache: write of LMCache peer" in log, log
    failure = [l for l in log.splitlines() if "Async transfer task failed" in l or l.startswith("kvbridge.")]
    print("prefiller saw:", *failure, sep="\n  ")
    assert proxy.collect({"doomed": 1}, timeout=2) == {}, "a failed transfer was reported done"

    # The receiver comes back on the same ports: the next request reaches the new one.
    receiver2 = _receiver(tmp_path, 0, 1, [init_port], [alloc_port], env, kv, buf)
    procs.append(receiver2)
    receiver2.expect("ready", timeout=120)
    sender.send(op="put", req_id="after", chunks=3, last_chunk_toks=100, seed=32)
    sender.expect("submitted", timeout=60)
    assert proxy.collect({"after": 1}, timeout=60) == {"after": 1}, sender.output()
    receiver2.send(op="check", req_id="after", chunks=3, last_chunk_toks=100, seed=32)
    assert receiver2.expect("checked", timeout=30)["bad"] == []
