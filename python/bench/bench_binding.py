"""The Python binding's own cost: batched writes from Python against `kvbridge bench
transfer` (the Rust engine driven from Rust) at the same block sizes, in the same run.

Both sides write `--batch` ops of one block each per batch, `--inflight` batches in flight,
`--total` bytes per measurement, scattered over a window of batch x inflight blocks of the
largest size (as `kvbridge bench transfer` does), to a
listener in another process over TCP (one session). Repetitions alternate Rust and Python;
medians and spreads are printed with the ratio Python / Rust. Any failed transfer, or a
peer whose memory does not hold exactly what was written, fails the run loudly and prints
no throughput.

    python python/bench/bench_binding.py --kvbridge target/release/kvbridge [--reps 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import kvbridge

PEER_PAGE = 4096


def peer_main(window: int) -> None:
    """The listener: a numpy region of `window` bytes; answers b"digest" with the sha256 of
    its first N bytes (N in the message) until stdin closes."""
    with kvbridge.Channel("bench-listener", "127.0.0.1:0", transport="tcp", use_env=False) as ch:
        mem = np.zeros(window, dtype=np.uint8)
        rid = ch.register_buffer(mem, PEER_PAGE)
        print(ch.local_addr, rid, flush=True)
        while True:
            got = ch.recv_notification(timeout=600)
            if got is None or got[1] == b"bye":
                return
            peer, msg = got
            n = int(msg.split()[1])
            ch.notify(peer, hashlib.sha256(mem[:n].tobytes()).hexdigest().encode())


class Failed(Exception):
    pass


def python_rep(ch, peer, local_region, remote_region, block, batch, inflight, total, window, api):
    """One measurement: GiB/s of `total` bytes in batches of `batch` blocks."""
    per_window = window // block
    batches = -(-total // (block * batch))
    slot = 0
    pending = []
    t0 = time.perf_counter()
    for _ in range(batches):
        slots = [(slot + k) % per_window for k in range(batch)]
        slot += batch
        if api == "pages":
            pages = [s * block // PEER_PAGE for s in slots]
            t = ch.submit_write_pages(peer, local_region, pages, remote_region, pages, block)
        else:
            ops = [(local_region, s * block, remote_region, s * block, block) for s in slots]
            t = ch.submit_write(peer, ops)
        pending.append(t)
        if len(pending) >= inflight:
            pending.pop(0).wait()
    for t in pending:
        t.wait()
    elapsed = time.perf_counter() - t0
    return batches * batch * block / (1 << 30) / elapsed


def rust_rep(binary, blocks, batch, inflight, total):
    cmd = [
        binary, "bench", "transfer", "--transport", "tcp",
        "--block-sizes", ",".join(str(b) for b in blocks),
        "--batch", str(batch), "--inflight", str(inflight), "--total", str(total),
        "--reps", "1", "--json",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise Failed("kvbridge bench transfer failed (%d): %s" % (r.returncode, r.stderr[-2000:]))
    out = r.stdout[r.stdout.index("{"):]
    report = json.loads(out)
    return {row["block_size"]: row["gib_per_s"] for row in report["results"]}


def spread(xs):
    return "%.2f-%.2f" % (min(xs), max(xs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvbridge", default="target/release/kvbridge", help="the release CLI binary")
    ap.add_argument("--block-sizes", default="262144,1048576,4194304")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--inflight", type=int, default=2)
    ap.add_argument("--total", type=int, default=512 << 20, help="bytes per measurement")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--api", choices=["pages", "ops"], default="pages",
                    help="submit_write_pages (page indices) or submit_write (byte ops)")
    ap.add_argument("--peer", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peer is not None:
        peer_main(a.peer)
        return 0
    blocks = [int(b) for b in a.block_sizes.split(",")]
    if any(b % PEER_PAGE for b in blocks):
        sys.exit("block sizes must be multiples of %d" % PEER_PAGE)
    window = max(b * a.batch * a.inflight for b in blocks)
    if a.total < window:
        sys.exit("--total must cover the window (%d bytes) so every block is written" % window)
    if not os.access(a.kvbridge, os.X_OK):
        sys.exit("%s not found: cargo build --release -p kvbridge-cli" % a.kvbridge)

    peer_proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--peer", str(window)],
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )
    rust = {b: [] for b in blocks}
    py = {b: [] for b in blocks}
    try:
        addr, remote_region = peer_proc.stdout.readline().split()
        remote_region = int(remote_region)
        ch = kvbridge.Channel("bench-python", transport="tcp", use_env=False)
        local = np.empty(window, dtype=np.uint8)
        local[:] = (np.arange(window, dtype=np.uint64) * 31 + 7).astype(np.uint8)
        local_region = ch.register_buffer(local, PEER_PAGE)
        peer = ch.connect(addr)
        for rep in range(a.reps):
            for b, g in rust_rep(a.kvbridge, blocks, a.batch, a.inflight, a.total).items():
                rust[b].append(g)
            for b in blocks:
                py[b].append(python_rep(ch, peer, local_region, remote_region, b, a.batch,
                                        a.inflight, a.total, window, a.api))
            print("rep %d/%d done" % (rep + 1, a.reps), file=sys.stderr, flush=True)
        # Every measured byte landed: the peer's window equals ours.
        ch.notify(peer, b"digest %d" % window)
        got = ch.recv_notification(timeout=60)
        if got is None or got[1] != hashlib.sha256(local.tobytes()).hexdigest().encode():
            raise Failed("the peer's memory differs from what was written")
        ch.notify(peer, b"bye")
        ch.close()
    except (kvbridge.KvbridgeError, Failed) as e:
        print("FAILED: %s" % e, file=sys.stderr)
        return 1
    finally:
        if peer_proc.poll() is None:
            try:
                peer_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                peer_proc.kill()

    print("Python batched writes (%s) vs kvbridge bench transfer, tcp, batch %d, %d in flight, "
          "%d MiB per measurement, medians of %d (min-max)"
          % (a.api, a.batch, a.inflight, a.total >> 20, a.reps))
    print("%10s %16s %18s %7s" % ("block", "python GiB/s", "rust GiB/s", "ratio"))
    for b in blocks:
        p, r = statistics.median(py[b]), statistics.median(rust[b])
        print("%10d %6.2f (%s) %7.2f (%s) %7.2f" % (b, p, spread(py[b]), r, spread(rust[b]), p / r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
