"""The Python binding's own cost: batched writes from Python against `kvbridge bench
transfer` (the Rust engine driven from Rust) at the same block sizes, in the same run.

Both sides write `--batch` ops of one block each per batch, `--inflight` batches in flight,
`--total` bytes per measurement, scattered over a window of batch x inflight blocks (as
`kvbridge bench transfer --block-sizes BLOCK` does), over TCP (one session) to the same kind of
listener: `kvbridge bench peer`, the process `kvbridge bench transfer` starts. The Python
side sends from shared anonymous memory, the kind `Region::alloc` gives the Rust side.
Repetitions alternate Rust and Python; medians and spreads are printed with the ratio
Python / Rust. Any failed transfer, or a peer whose memory does not read back exactly what
was written, fails the run loudly and prints no throughput.

    python python/bench/bench_binding.py --kvbridge target/release/kvbridge [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import kvbridge

PEER_PAGE = 4096


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


def rust_rep(binary, blocks, batch, inflight, total, inner):
    cmd = [
        binary, "bench", "transfer", "--transport", "tcp",
        "--block-sizes", ",".join(str(b) for b in blocks),
        "--batch", str(batch), "--inflight", str(inflight), "--total", str(total),
        "--reps", str(inner), "--json",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise Failed("kvbridge bench transfer failed (%d): %s" % (r.returncode, r.stderr[-2000:]))
    out = r.stdout[r.stdout.index("{"):]
    report = json.loads(out)
    return {row["block_size"]: row["gib_per_s"] for row in report["results"]}


def python_measurement(a, block, window, local_mem):
    """What one `kvbridge bench transfer --block-sizes BLOCK --reps INNER` call does, from
    Python: a fresh listener process and session, INNER measurements, their median; then
    the listener's window must read back equal to what was written."""
    peer_proc = subprocess.Popen(
        [a.kvbridge, "bench", "peer", "--region-bytes", str(window), "--page", str(PEER_PAGE)],
        stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True,
    )
    try:
        ready, addr, remote_region, _sink = peer_proc.stdout.readline().split()
        if ready != "READY":
            raise Failed("kvbridge bench peer did not start")
        remote_region = int(remote_region, 16)
        with kvbridge.Channel("bench-python", transport="tcp", use_env=False) as ch:
            local_region = ch.register_buffer(local_mem, PEER_PAGE)
            peer = ch.connect(addr)
            figures = [
                python_rep(ch, peer, local_region, remote_region, block, a.batch, a.inflight,
                           a.total, window, a.api)
                for _ in range(a.inner)
            ]
            back_mem = mmap.mmap(-1, window)
            back_region = ch.register_buffer(back_mem, PEER_PAGE)
            chunk = min(window, 1 << 20)
            for at in range(0, window, chunk * 64):
                ops = [(back_region, o, remote_region, o, chunk)
                       for o in range(at, min(window, at + chunk * 64), chunk)]
                ch.read(peer, ops)
            ch.deregister(back_region)
            if back_mem[:] != local_mem[:window]:
                raise Failed("the listener's memory differs from what was written (block %d)" % block)
        return statistics.median(figures)
    finally:
        peer_proc.stdin.close()
        try:
            peer_proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            peer_proc.kill()


def spread(xs):
    return "%.2f-%.2f" % (min(xs), max(xs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvbridge", default="target/release/kvbridge", help="the release CLI binary")
    ap.add_argument("--block-sizes", default="262144,1048576,4194304")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--inflight", type=int, default=2)
    ap.add_argument("--total", type=int, default=512 << 20, help="bytes per measurement")
    ap.add_argument("--reps", type=int, default=5, help="repetitions; the median is reported")
    ap.add_argument("--inner", type=int, default=3,
                    help="measurements per repetition and side (the Rust side's --reps); their "
                         "median is the repetition's figure, so a cold first one does not count")
    ap.add_argument("--api", choices=["pages", "ops"], default="pages",
                    help="submit_write_pages (page indices) or submit_write (byte ops)")
    a = ap.parse_args()
    blocks = [int(b) for b in a.block_sizes.split(",")]
    if any(b % PEER_PAGE for b in blocks):
        sys.exit("block sizes must be multiples of %d" % PEER_PAGE)
    def scatter_window(block):
        # What `kvbridge bench transfer --block-sizes BLOCK` cycles through.
        return min(max(block * a.batch * a.inflight, 1 << 20), 1 << 30)

    window = max(scatter_window(b) for b in blocks)
    if a.total < window:
        sys.exit("--total must cover the window (%d bytes) so every block is written" % window)
    if not os.access(a.kvbridge, os.X_OK):
        sys.exit("%s not found: cargo build --release -p kvbridge-cli" % a.kvbridge)

    rust = {b: [] for b in blocks}
    py = {b: [] for b in blocks}
    local_mem = mmap.mmap(-1, window)
    local = np.frombuffer(local_mem, dtype=np.uint8)
    local[:] = (np.arange(window, dtype=np.uint64) * 31 + 7).astype(np.uint8)
    try:
        for rep in range(a.reps):
            # Side by side per block size, the order alternating per repetition, so that the
            # host's load swings hit both alike.
            for b in blocks:
                def rust_side():
                    rust[b].append(rust_rep(a.kvbridge, [b], a.batch, a.inflight, a.total, a.inner)[b])

                def python_side():
                    py[b].append(python_measurement(a, b, scatter_window(b), local_mem))

                for side in ((rust_side, python_side) if rep % 2 == 0 else (python_side, rust_side)):
                    side()
            print("rep %d/%d done" % (rep + 1, a.reps), file=sys.stderr, flush=True)
    except (kvbridge.KvbridgeError, Failed, subprocess.TimeoutExpired) as e:
        print("FAILED: %s" % e, file=sys.stderr)
        return 1

    print("Python batched writes (%s) vs kvbridge bench transfer, tcp, batch %d, %d in flight, "
          "%d MiB per measurement, medians of %d repetitions (min-max), each the median of %d"
          % (a.api, a.batch, a.inflight, a.total >> 20, a.reps, a.inner))
    print("%10s %16s %18s %7s" % ("block", "python GiB/s", "rust GiB/s", "ratio"))
    for b in blocks:
        p, r = statistics.median(py[b]), statistics.median(rust[b])
        print("%10d %6.2f (%s) %7.2f (%s) %7.2f" % (b, p, spread(py[b]), r, spread(rust[b]), p / r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
