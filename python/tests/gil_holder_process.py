"""A serving peer whose main thread holds the GIL, like an engine loop in a long C call.

`gil_holder_process.py HOLD_S`: pinned to one core (as vLLM CPU pins a process's transfer
threads: kvbridge's runtime then has one worker thread), listens with a buffer of PAGES
pages (page i filled with byte i) and prints "ADDR REGION". On a line on stdin it starts
an awaitable call that completes 0.1 s later, prints "holding", and holds the GIL for HOLD_S
seconds (a C call made through ctypes.PyDLL, which keeps the GIL), then prints "released"
and serves on until its stdin ends.
A peer that connects and reads meanwhile needs this process's kvbridge, never its GIL.
"""

import asyncio
import ctypes
import os
import sys

# before kvbridge starts its runtime, which sizes itself from this mask
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

import numpy as np  # noqa: E402

import kvbridge  # noqa: E402

PAGE = 64 << 10
PAGES = 16


def main() -> None:
    hold_s = float(sys.argv[1])
    with kvbridge.Channel("gil-holder", "127.0.0.1:0", use_env=False) as ch:
        kv = np.repeat(np.arange(PAGES, dtype=np.uint8), PAGE)
        rid = ch.register_buffer(kv, PAGE)
        print(ch.local_addr, rid, flush=True)
        sys.stdin.readline()
        loop = asyncio.new_event_loop()

        async def start():
            # not awaited: its completion comes while the GIL is held below
            return ch.recv_notification_async(timeout=0.1)

        pending = loop.run_until_complete(start())
        libc = ctypes.PyDLL(None)
        print("holding", flush=True)
        libc.usleep(ctypes.c_uint(int(hold_s * 1e6)))
        print("released", flush=True)
        loop.run_until_complete(pending)
        loop.close()
        sys.stdin.read()


if __name__ == "__main__":
    main()
