"""kvbridge's transfer-channel context beyond LMCache's contract tests: peers in separate
processes (reads both ways over one session), a peer that is not there or never answers,
foreign notifications, a restarted peer, and use after close."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("interop")

PAGE = 256
PAGES = 16
PEER = Path(__file__).with_name("distributed_peer.py")


def _free_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class _Context:
    """A context in this process over a torch buffer filled with ``fill``."""

    def __init__(self, fill: int, url: str | None = None, **kwargs):
        import torch
        from lmcache.v1.distributed.internal_api import L1MemoryDesc

        from kvbridge.lmcache.distributed import KvbridgeTransferChannelContext

        self.url = url or _free_url()
        self.buf = torch.full((PAGES * PAGE,), fill, dtype=torch.uint8)
        self.ctx = KvbridgeTransferChannelContext(
            L1MemoryDesc(ptr=self.buf.data_ptr(), size=self.buf.numel(), align_bytes=PAGE),
            listen_url=self.url,
            advertise_url=self.url,
            **kwargs,
        )

    def read(self, peer_url: str, local: int, remote: int, size: int, timeout_s: float = 30):
        from lmcache.v1.distributed.transfer_channel.api import TransferChannelAddress

        client = self.ctx.get_transfer_channel_client(peer_url)
        task = client.submit_read(
            [TransferChannelAddress(local, size)], [TransferChannelAddress(remote, size)]
        )
        deadline = time.monotonic() + timeout_s
        result = client.query_read_status(task)
        while not result.is_finished() and time.monotonic() < deadline:
            time.sleep(0.001)
            result = client.query_read_status(task)
        return result

    def close(self):
        self.ctx.close()


@pytest.fixture
def peer_process():
    """A context in another process; yields (url, ask, proc) where ask(line) -> reply."""
    url = _free_url()
    proc = subprocess.Popen(
        [sys.executable, str(PEER), url, str(PAGES), str(PAGE), "7"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, env=dict(os.environ),
    )

    def ask(line: str) -> str:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        return proc.stdout.readline().strip()

    try:
        assert proc.stdout.readline().strip() == "ready"
        yield url, ask, proc
    finally:
        try:
            proc.stdin.write("exit\n")
            proc.stdin.close()
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def test_register_is_idempotent_and_lmcache_builds_kvbridge_contexts():
    from lmcache.v1.distributed.internal_api import L1MemoryDesc
    from lmcache.v1.distributed.transfer_channel.factory import create_transfer_channel_context

    from kvbridge.lmcache import distributed

    distributed.register()
    distributed.register()
    import torch

    buf = torch.zeros(PAGES * PAGE, dtype=torch.uint8)
    url = _free_url()
    ctx = create_transfer_channel_context(
        "kvbridge", L1MemoryDesc(buf.data_ptr(), buf.numel(), PAGE),
        listen_url=url, advertise_url=url, backends=["UCX"],
    )
    try:
        assert isinstance(ctx, distributed.KvbridgeTransferChannelContext)
    finally:
        ctx.close()


def test_reads_both_ways_between_processes_over_one_session(peer_process):
    peer_url, ask, _ = peer_process
    me = _Context(fill=3)
    try:
        result = me.read(peer_url, local=2 * PAGE, remote=5 * PAGE, size=3 * PAGE)
        assert result.succeeded_mask == [True]
        assert me.buf[2 * PAGE : 5 * PAGE].eq(7).all()
        assert me.buf[: 2 * PAGE].eq(3).all() and me.buf[5 * PAGE :].eq(3).all()
        # the peer reads us through the reverse client our dial left there: no new dial
        me.buf[4 * PAGE : 5 * PAGE].fill_(0xAB)
        assert ask(f"read {me.url} {4 * PAGE} {PAGE}") == "read 1 " + "ab" * 16
        assert ask("clients") == "clients 1"
    finally:
        me.close()


def test_an_unreachable_peer_is_a_typed_error_naming_it():
    import kvbridge

    me = _Context(fill=0)
    gone = _free_url()
    try:
        with pytest.raises(kvbridge.KvbridgeError) as err:
            me.ctx.get_transfer_channel_client(gone)
        assert gone in str(err.value)
        assert me.ctx.get_num_connected_clients() == 0
    finally:
        me.close()


def test_a_peer_that_never_answers_the_handshake_times_out_naming_it():
    import kvbridge
    from lmcache.v1.mp_observability.errors import LMCacheTimeoutError

    silent_url = _free_url()
    silent = kvbridge.Channel("silent", silent_url)  # a kvbridge peer, not a context
    me = _Context(fill=0, handshake_timeout=0.5)
    try:
        with pytest.raises(LMCacheTimeoutError, match=silent_url):
            me.ctx.get_transfer_channel_client(silent_url)
        assert me.ctx.get_num_connected_clients() == 0
    finally:
        me.close()
        silent.close()


def test_foreign_and_malformed_notifications_are_ignored():
    import kvbridge

    from kvbridge.lmcache import distributed_handshake as hs

    me = _Context(fill=9)
    other = kvbridge.Channel("other")
    try:
        peer = other.connect(me.url)
        for junk in (b"not ours", hs.PREFIX + b"\xc1", hs.PREFIX + b"\x81\xa4type\xa5Hello"):
            other.notify(peer, junk)
        # an orphan Welcome, for a dial nobody made
        other.notify(peer, hs.encode(hs.Welcome(nonce=99, advertise_url="x:1",
                                                arena=hs.ArenaInfo.of(1, PAGE, PAGE))))
        you = _Context(fill=1)
        try:
            result = you.read(me.url, local=0, remote=0, size=PAGE)
            assert result.succeeded_mask == [True] and you.buf[:PAGE].eq(9).all()
        finally:
            you.close()
        assert me.ctx.get_num_connected_clients() == 1
    finally:
        other.close()
        me.close()


def test_a_restarted_peer_replaces_its_stale_reverse_client():
    me = _Context(fill=0)
    first = _Context(fill=1)
    url = first.url
    try:
        assert first.read(me.url, PAGE, 0, PAGE).succeeded_mask == [True]
        stale = me.ctx.get_transfer_channel_client(url)
        first.close()
        again = _relisten(fill=2, url=url)
        try:
            assert again.read(me.url, PAGE, 0, PAGE).succeeded_mask == [True]
            fresh = me.ctx.get_transfer_channel_client(url)
            assert fresh is not stale
            assert me.read(url, 0, 2 * PAGE, PAGE).succeeded_mask == [True]
            assert me.buf[:PAGE].eq(2).all()
        finally:
            again.close()
    finally:
        first.close()
        me.close()


def _relisten(fill: int, url: str, timeout_s: float = 10.0) -> _Context:
    """A context on ``url`` that a closed one just left; the old listening socket may
    linger for a moment after ``close()`` (EADDRINUSE), as after a process restart."""
    import kvbridge

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _Context(fill=fill, url=url)
        except kvbridge.LocalError as err:
            if "in use" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_use_after_close_is_refused_and_close_is_idempotent():
    from lmcache.v1.distributed.transfer_channel.api import TransferChannelAddress

    a, b = _Context(fill=0), _Context(fill=5)
    try:
        client = a.ctx.get_transfer_channel_client(b.url)
        a.ctx.remove_transfer_channel_client(b.url)
        with pytest.raises(RuntimeError, match="closed"):
            client.submit_read([TransferChannelAddress(0, PAGE)], [TransferChannelAddress(0, PAGE)])
        a.close()
        a.close()
        with pytest.raises(RuntimeError, match="closed"):
            a.ctx.get_transfer_channel_client(b.url)
    finally:
        a.close()
        b.close()


def test_unknown_options_are_refused():
    with pytest.raises(TypeError, match="unknown kvbridge transfer channel options"):
        _Context(fill=0, backend="UCX")


def test_a_killed_peer_fails_the_read_with_a_typed_error_not_a_hang(peer_process):
    import kvbridge

    peer_url, _, proc = peer_process
    me = _Context(fill=3)
    try:
        assert me.read(peer_url, 0, 0, PAGE).succeeded_mask == [True]
        proc.kill()
        proc.wait(timeout=30)
        try:
            result = me.read(peer_url, 0, 0, PAGE, timeout_s=60)
        except kvbridge.KvbridgeError as err:  # refused at submit: the session is gone
            assert err.peer is not None
        else:
            assert result.is_finished() and result.succeeded_mask == [False]
    finally:
        me.close()


def _state(pid: int) -> str:
    """The process's state letter (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _queued_at(port: int) -> int:
    """Bytes waiting unread in the receive queues of this host's established TCP sockets
    whose local port is ``port`` (the kernel's ``/proc/net/tcp``)."""
    total = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if state == "01" and int(local.split(":")[1], 16) == port:
                total += int(queues.split(":")[1], 16)
    return total


def test_closing_with_a_read_stalled_on_a_stopped_peer_returns_at_once():
    """A context closed while its read waits for a peer that stopped (SIGSTOP; over TCP,
    since a same-host copy would not wait for the peer) cancels the read and returns at
    once: the cancel returns once no byte of the read can land in the arena, so
    deregistering the arena need not wait for the read. (It waited for the channel's op
    deadline, 30 s, while a cancelled read kept its destination in the session's table.)"""
    from lmcache.v1.distributed.transfer_channel.api import TransferChannelAddress

    url = _free_url()
    port = int(url.rsplit(":", 1)[1])
    proc = subprocess.Popen(
        [sys.executable, str(PEER), url, str(PAGES), str(PAGE), "7"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, env=dict(os.environ, KVBRIDGE_TRANSPORT="tcp"),
    )  # fmt: skip
    me = None
    stopped = False
    try:
        assert proc.stdout.readline().strip() == "ready"
        me = _Context(fill=3, transport="tcp")
        assert me.read(url, 0, 0, PAGE).succeeded_mask == [True]  # the session is up
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = True
        deadline = time.monotonic() + 10  # the signal is delivered asynchronously
        while _state(proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.001)
        assert _state(proc.pid) == "T", "the peer did not stop"
        client = me.ctx.get_transfer_channel_client(url)
        client.submit_read([TransferChannelAddress(PAGE, PAGE)], [TransferChannelAddress(5 * PAGE, PAGE)])
        deadline = time.monotonic() + 10
        while _queued_at(port) == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert _queued_at(port) > 0, "the read request never reached the stopped peer"
        t = time.monotonic()
        me.close()
        took = time.monotonic() - t
        me = None
        assert took < 10, f"close took {took:.1f} s"
    finally:
        if stopped:
            os.kill(proc.pid, signal.SIGCONT)
        if me is not None:
            me.close()
        try:
            proc.stdin.write("exit\n")
            proc.stdin.close()
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
