"""What the LMCache channel's integrity check costs a write: ``KvbridgeChannel.batched_write``
of ``--pages`` pages of ``--page`` bytes, checked (both channels ``integrity=True``: the
writer digests its pages, the receiver digests what landed and answers) against unchecked,
two pairs of channels in this process, measured alternately (which goes first alternates
too) for ``--rounds`` rounds of ``--iters`` writes, per transport (``KVBRIDGE_TRANSPORT``).
After each measurement every page is compared with what was written; a difference fails the
run. Medians (min-max) over the rounds and the ratio checked / unchecked of each round.

    python python/bench/bench_lmcache_integrity.py [--transports tcp,cma,ucx] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from types import SimpleNamespace
from unittest.mock import MagicMock

import numpy as np

import kvbridge


def _objs(indices):
    from lmcache.v1.memory_management import MemoryObj

    out = []
    for i in indices:
        o = MagicMock(spec=MemoryObj)
        o.meta = SimpleNamespace(address=i)
        out.append(o)
    return out


def _pair(args, integrity, port):
    from kvbridge.lmcache.channel import KvbridgeChannel

    def make(role, url):
        arena = np.zeros(args.pages * args.page, dtype=np.uint8)
        ch = KvbridgeChannel(
            role=role,
            buffer_ptr=arena.ctypes.data,
            buffer_size=arena.nbytes,
            align_bytes=args.page,
            tp_rank=0,
            peer_init_url=url,
            device="cpu",
            integrity=integrity,
        )
        ch.arena = arena
        return ch

    url = f"127.0.0.1:{port}"
    recv = make("receiver", url)
    send = make("sender", None)
    send.lazy_init_peer_connection("S", "R", url)
    send.arena[:] = np.random.default_rng(port).integers(0, 256, send.arena.size, dtype=np.uint8)
    return send, recv


def _measure(send, recv, args, objs, spec):
    recv.arena[:] = 0
    t = time.perf_counter()
    for _ in range(args.iters):
        send.batched_write(objs, spec)
    ms = (time.perf_counter() - t) * 1e3 / args.iters
    if not np.array_equal(recv.arena, send.arena):
        raise SystemExit("a write did not land byte for byte")
    return ms


def _row(args, transport, port):
    if transport == "cma":
        os.environ.pop("KVBRIDGE_TRANSPORT", None)
    else:
        os.environ["KVBRIDGE_TRANSPORT"] = transport
    if transport == "ucx":
        os.environ.setdefault("UCX_TLS", "posix,cma,self")
    plain = _pair(args, False, port)
    checked = _pair(args, True, port + 1)
    objs = _objs(range(args.pages))
    spec = {"receiver_id": "R", "remote_indexes": list(range(args.pages))}
    _measure(*plain, args, objs, spec)
    _measure(*checked, args, objs, spec)
    u, c = [], []
    for r in range(args.rounds):
        order = [(plain, u), (checked, c)]
        for (s, rv), out in order if r % 2 == 0 else reversed(order):
            out.append(_measure(s, rv, args, objs, spec))
    assert checked[1].integrity_checks >= args.pages * args.iters * args.rounds
    assert plain[1].integrity_checks == 0
    for ch in (*plain, *checked):
        ch.close()
    ratios = [b / a for a, b in zip(u, c)]
    gib = args.pages * args.page / (1 << 30)
    f = lambda v: f"{statistics.median(v):8.2f} ({min(v):.2f}-{max(v):.2f})"  # noqa: E731
    print(
        f"{transport:<5} unchecked {f(u)} ms  checked {f(c)} ms  ratio "
        f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})  "
        f"ratio of medians {statistics.median(c) / statistics.median(u):.3f}  "
        f"GiB/s {gib / statistics.median(u) * 1e3:.2f} / {gib / statistics.median(c) * 1e3:.2f}",
        flush=True,
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transports", default="tcp,cma,ucx")
    p.add_argument("--pages", type=int, default=32)
    p.add_argument("--page", type=int, default=1 << 20)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--port", type=int, default=47310)
    args = p.parse_args()
    print(
        f"KvbridgeChannel.batched_write of {args.pages} x {args.page} bytes, {args.iters} "
        f"writes per measurement, {args.rounds} rounds alternated; ms per write, median "
        f"(min-max); digest {kvbridge.DIGEST_ALGORITHM}",
        flush=True,
    )
    for i, t in enumerate(args.transports.split(",")):
        if t == "ucx" and "ucx" not in kvbridge.TRANSPORTS:
            print("ucx   skipped: this package was built without UCX")
            continue
        _row(args, t, args.port + 2 * i)


if __name__ == "__main__":
    main()
