"""A kvbridge peer in its own process, driven by the tests.

`listen [PORT [TRANSPORT]]`: listens (on PORT, default any; over TRANSPORT, default auto) with a
KV buffer of PAGES pages, each page i filled with byte i; prints
"ADDR REGION" and answers notifications: b"digest" -> the sha256 of its buffer, b"bye" ->
closes and exits.

`block-connect ADDR` / `block-recv`: makes a blocking call that does not end by itself,
prints "blocking" just before, and reports how it ended (for Ctrl-C tests); then shows the
channel is still usable by writing a page to a channel of its own and prints "usable".
"""

import hashlib
import inspect
import signal
import sys
import threading
import time

import numpy as np

import kvbridge

PAGE = 64 << 10
PAGES = 16


def listen(port=0, transport=None):
    with kvbridge.Channel("decode-sub", "127.0.0.1:%d" % port, use_env=False, transport=transport) as ch:
        kv = np.repeat(np.arange(PAGES, dtype=np.uint8), PAGE)
        rid = ch.register_buffer(kv, PAGE)
        print(ch.local_addr, rid, flush=True)
        while True:
            got = ch.recv_notification(timeout=30)
            if got is None:
                sys.exit("no notification for 30 s")
            peer, msg = got
            if msg == b"digest":
                ch.notify(peer, hashlib.sha256(kv.tobytes()).hexdigest().encode())
            elif msg == b"bye":
                return


def still_usable(ch):
    with kvbridge.Channel("local-listener", "127.0.0.1:0", use_env=False) as other:
        dst = np.zeros(PAGE, dtype=np.uint8)
        dst_region = other.register_buffer(dst, PAGE)
        src = np.full(PAGE, 42, dtype=np.uint8)
        src_region = ch.register_buffer(src, PAGE)
        peer = ch.connect(other.local_addr)
        ch.write_pages(peer, src_region, [0], dst_region, [0])
        assert (dst == 42).all()
    print("usable", flush=True)


def announce_when_main_thread_reaches(line):
    """Prints "blocking" once the main thread's frame stands at `line` while this thread
    runs: the main thread is then inside the call on that line (it released the GIL)."""
    main = threading.main_thread().ident

    def watch():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            frame = sys._current_frames().get(main)
            if frame is not None and frame.f_lineno == line:
                print("blocking", flush=True)
                return
            time.sleep(0.001)

    threading.Thread(target=watch, daemon=True).start()


def block(kind, addr=None):
    # A process started from a non-interactive shell's background job inherits SIGINT as
    # ignored, and Python then installs no KeyboardInterrupt handler: this child is about
    # Ctrl-C, so it puts the handler back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    deadlines = {"connect": 60.0, "handshake_step": 60.0, "op": 60.0}
    ch = kvbridge.Channel("blocked", use_env=False, deadlines=deadlines)
    try:
        if kind == "connect":
            print("blocking", flush=True)  # the test sees the call begin at its listener
            ch.connect(addr)
        else:
            announce_when_main_thread_reaches(inspect.currentframe().f_lineno + 1)
            ch.recv_notification()
        print("returned", flush=True)
    except KeyboardInterrupt:
        print("interrupted %.3f" % time.monotonic(), flush=True)
    still_usable(ch)
    ch.close()


if __name__ == "__main__":
    if sys.argv[1] == "listen":
        listen(int(sys.argv[2]) if len(sys.argv) > 2 else 0, sys.argv[3] if len(sys.argv) > 3 else None)
    elif sys.argv[1] == "block-connect":
        block("connect", sys.argv[2])
    elif sys.argv[1] == "block-recv":
        block("recv")
