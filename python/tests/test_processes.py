"""A peer in another process; Ctrl-C during blocking calls."""

import hashlib
import os
import select
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import kvbridge
from conftest import channel

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = 64 << 10
PAGES = 16


def spawn(*args):
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "peer_process.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
    )


def readline(proc, timeout=15.0):
    """The child's next stdout line, failing the test when none comes within `timeout`."""
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            proc.kill()
            pytest.fail("no line from the child within %.0f s (got %r)" % (timeout, line))
        b = proc.stdout.read(1)
        if not b:
            break
        line += b
    return line.decode()


def finish(proc, timeout=20):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail("peer process did not exit: %s %s" % (out, err))
    return out, err


def read_write_digest(ch, peer, region, seed):
    """Reads the `listen` peer's pattern (page i holds byte i) in reverse page order, writes
    four random pages into it, and checks the peer's digest of its whole buffer, which it
    computes on a notification issued after the write; then says bye."""
    back = np.zeros(PAGES * PAGE, dtype=np.uint8)
    back_region = ch.register_buffer(back, PAGE)
    ch.read_pages(peer, back_region, list(range(PAGES)), region, list(reversed(range(PAGES))))
    for i in range(PAGES):
        assert (back[i * PAGE : (i + 1) * PAGE] == PAGES - 1 - i).all(), i
    src = np.random.default_rng(seed).integers(0, 256, 4 * PAGE, dtype=np.uint8)
    src_region = ch.register_buffer(src, PAGE)
    ch.write_pages(peer, src_region, [0, 1, 2, 3], region, [15, 2, 7, 0])
    expected = np.repeat(np.arange(PAGES, dtype=np.uint8), PAGE)
    for local, remote in [(0, 15), (1, 2), (2, 7), (3, 0)]:
        expected[remote * PAGE : (remote + 1) * PAGE] = src[local * PAGE : (local + 1) * PAGE]
    ch.notify(peer, b"digest")
    got = ch.recv_notification(timeout=10)
    assert got == ("decode-sub", hashlib.sha256(expected.tobytes()).hexdigest().encode())
    # The peer closes the moment it reads this: the notification is still confirmed.
    ch.notify(peer, b"bye")


def test_peer_in_another_process_byte_exact():
    proc = spawn("listen")
    try:
        addr, region = readline(proc).split()
        with channel("prefill-main") as ch:
            peer = ch.connect(addr)
            assert peer == "decode-sub"
            read_write_digest(ch, peer, int(region), seed=3)
        out, err = finish(proc)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def queued_at(port):
    """Bytes waiting unread in the receive queues of this host's established TCP sockets
    whose local port is `port` (the kernel's /proc/net/tcp)."""
    total = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[3] == "01" and int(fields[1].split(":")[1], 16) == port:
                total += int(fields[4].split(":")[1], 16)
    return total


def stop(pid):
    """SIGSTOPs `pid` and returns once it is stopped (the signal is delivered
    asynchronously: a peer still running would serve the read)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open("/proc/%d/stat" % pid) as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.001)
    pytest.fail("process %d did not stop" % pid)


def test_a_read_cancelled_while_its_peer_is_stopped_lands_nothing():
    """The peer holds a read (SIGSTOP, over TCP: a same-host copy would not need it); the
    read is cancelled (True), its destination overwritten, the peer resumed: its answer is
    dropped when it comes (counted), the destination keeps what was written, and the
    session goes on (the next read lands)."""
    proc = spawn("listen", "0", "tcp")
    stopped = False
    try:
        addr, region = readline(proc).split()
        region, port = int(region), int(addr.rsplit(":", 1)[1])
        with channel("prefill-cancel", transport="tcp") as ch:
            peer = ch.connect(addr)
            dst = np.zeros(2 * PAGE, dtype=np.uint8)
            dst_region = ch.register_buffer(dst, PAGE)
            ch.read_pages(peer, dst_region, [1], region, [3])  # the data connection is up
            stop(proc.pid)
            stopped = True
            t = ch.submit_read_pages(peer, dst_region, [0], region, [5])
            deadline = time.monotonic() + 10
            while queued_at(port) == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert queued_at(port) > 0, "the read request never reached the stopped peer"
            assert t.cancel() is True
            dst[:PAGE] = 0xAB
            os.kill(proc.pid, signal.SIGCONT)
            stopped = False
            ch.read_pages(peer, dst_region, [1], region, [7])
            assert (dst[PAGE:] == 7).all()
            # with several data connections the late answer may come on another one than
            # this read's: wait until it was read past, so that it had its chance to land
            deadline = time.monotonic() + 10
            while ch.stats().get("late_answers_discarded", 0) == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert (dst[:PAGE] == 0xAB).all(), "the cancelled read landed after its cancel"
            assert ch.stats()["late_answers_discarded"] == 1
            ch.notify(peer, b"bye")
        _, err = finish(proc)
        assert proc.returncode == 0, err
    finally:
        if stopped:
            os.kill(proc.pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def write_kill_write(ch, proc, peer, region):
    """Writes a page to the `listen` peer, kills its process, then writes until a write
    fails (the session ends once the peer is seen gone); returns that error and the seconds
    from the kill's end to it."""
    src = np.ones(PAGE, dtype=np.uint8)
    src_region = ch.register_buffer(src, PAGE)
    ch.write_pages(peer, src_region, [0], region, [1])
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    with pytest.raises(kvbridge.KvbridgeError) as e:
        for _ in range(50):
            ch.write_pages(peer, src_region, [0], region, [1])
    return e.value, time.monotonic() - t0


def test_killed_peer_fails_the_next_write_typed():
    proc = spawn("listen")
    try:
        addr, region = readline(proc).split()
        with channel("prefill-main", deadlines={"op": 2.0, "connect": 1.0, "handshake_step": 1.0}) as ch:
            peer = ch.connect(addr)
            error, took = write_kill_write(ch, proc, peer, int(region))
            assert took < 5
            assert error.peer in ("decode-sub", addr)
            assert not isinstance(error, kvbridge.Closed)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def interrupt_while(args, accept_from=None):
    proc = spawn(*args)
    try:
        assert readline(proc).strip() == "blocking"
        if accept_from is not None:
            # The child is inside connect() once its TCP connection arrives.
            conn, _ = accept_from.accept()
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        line = readline(proc).split()
        assert line and line[0] == "interrupted", line
        assert float(line[1]) - sent < 1.0, "KeyboardInterrupt took %.3f s" % (float(line[1]) - sent)
        assert readline(proc).strip() == "usable"
        out, err = finish(proc)
        assert proc.returncode == 0, err
        if accept_from is not None:
            conn.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_interrupts_a_blocked_connect():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        interrupt_while(["block-connect", "127.0.0.1:%d" % silent.getsockname()[1]], silent)
    finally:
        silent.close()


def test_ctrl_c_interrupts_a_blocked_receive():
    interrupt_while(["block-recv"])


def test_listener_late_then_restarted_on_the_same_port():
    """The seed's orderings from the sender's side: the listener is not up yet (a typed,
    prompt refusal), comes up (connect works), dies (the next write fails typed within its
    deadline), and comes back on the same port (connect again, the write lands)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    addr = "127.0.0.1:%d" % port
    deadlines = {"connect": 1.0, "handshake_step": 1.0, "op": 2.0}
    with channel("prefill-main", deadlines=deadlines) as ch:
        src = np.full(PAGE, 5, dtype=np.uint8)
        src_region = ch.register_buffer(src, PAGE)
        with pytest.raises(kvbridge.ConnectionLost) as e:
            ch.connect(addr)
        assert e.value.step == "connect"
        for attempt in range(2):
            proc = spawn("listen", str(port))
            try:
                got_addr, region = readline(proc).split()
                assert got_addr == addr
                assert ch.connect(addr) == "decode-sub"
                ch.write_pages("decode-sub", src_region, [0], int(region), [attempt])
                ch.notify("decode-sub", b"digest")
                _, digest = ch.recv_notification(timeout=10)
                expected = np.repeat(np.arange(PAGES, dtype=np.uint8), PAGE)
                expected[attempt * PAGE : (attempt + 1) * PAGE] = 5
                assert digest == hashlib.sha256(expected.tobytes()).hexdigest().encode()
            finally:
                proc.kill()
                proc.wait()
            t0 = time.monotonic()
            with pytest.raises(kvbridge.KvbridgeError) as e:
                for _ in range(50):  # until the session's end is seen
                    ch.write_pages("decode-sub", src_region, [0], int(region), [0])
            assert time.monotonic() - t0 < 5
            assert not isinstance(e.value, kvbridge.Closed)


EXIT_WITH_A_BLOCKED_DAEMON = r"""
import threading, torch, kvbridge
ch = kvbridge.Channel("decode-0", "127.0.0.1:0", use_env=False)
ended = []
def receive():
    try:
        ch.recv_notification(timeout=None)
    except kvbridge.KvbridgeError as e:
        ended.append(e)
t = threading.Thread(target=receive, daemon=True)
t.start()
t.join(0.3)  # the thread is now blocked in the receive
print("exiting", flush=True)
"""


def test_exit_with_a_daemon_thread_blocked_in_a_call_is_clean():
    """The interpreter exits while a daemon thread waits in a call. Ended by finalization,
    the wait's forced unwind through Rust frames aborts the process (seen with torch
    loaded); the exit hook ends the call first."""
    pytest.importorskip("torch")
    r = subprocess.run(
        [sys.executable, "-c", EXIT_WITH_A_BLOCKED_DAEMON], capture_output=True, timeout=60
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert b"FATAL" not in r.stderr
