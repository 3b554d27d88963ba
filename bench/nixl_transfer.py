#!/usr/bin/env python3
"""NIXL's UCX backend measured the way `kvbridge bench transfer` measures kvbridge.

The reference side of bench/transfer.sh: two processes, a target that registers a region and an
initiator that writes into it through NIXL's Python API (the `nixl` wheel from PyPI, installed
without dependencies at benchmark time; its UCX is the one bundled in the wheel). Per block
size, batches of `--batch` writes, `--inflight` batches in flight, `--total` bytes; each batch
cycles through the target's region. Also timed: agent metadata exchange plus the first write
completed (what a decoder pays before its first KV byte lands).

Every written byte is checked by the target at the end: a mismatch or a transfer that ended in
ERR fails the run (exit 1) and prints no figure. UCX_TLS and UCX_NET_DEVICES pass through.

    .venv/bin/python bench/nixl_transfer.py --block-sizes 65536,262144,1048576,4194304 --json
"""

from __future__ import annotations

import argparse
import base64
import json
import mmap
import os
import subprocess
import sys
import time

GIB = float(1 << 30)
# Every wait ends: a transfer still in progress after this fails the run.
XFER_DEADLINE_S = 60.0


def pattern_at(size: int):
    import numpy as np

    # Byte i of the initiator's region; offsets are the same on both sides, so the target
    # knows what every written byte must be.
    return ((np.arange(size, dtype=np.uint64) * 7 + 3) & 0xFF).astype(np.uint8)


def region(size: int):
    """Anonymous memory, page-aligned, with its address (NIXL registers by address)."""
    import ctypes
    import numpy as np

    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(m, dtype=np.uint8)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    return m, arr, addr


def agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def run_target(size: int) -> int:
    """Registers `size` bytes, prints its metadata, serves until the initiator says "done",
    then checks every byte it was told was written."""
    a = agent("target")
    m, arr, addr = region(size)
    arr[:] = 0
    a.register_memory([(addr, size, 0, "")], "DRAM")
    print(
        json.dumps(
            {"meta": base64.b64encode(a.get_agent_metadata()).decode(), "addr": addr}
        ),
        flush=True,
    )
    # The initiator names the written extent in its "done" notification.
    deadline = time.monotonic() + 3600
    written = None
    while written is None and time.monotonic() < deadline:
        for msgs in a.get_new_notifs().values():
            for msg in msgs:
                if msg.startswith(b"done "):
                    written = int(msg.split()[1])
        time.sleep(0.001)
    if written is None:
        print(json.dumps({"error": "no done notification"}), flush=True)
        return 1
    want = pattern_at(written)
    bad = int((arr[:written] != want).sum())
    print(json.dumps({"checked": written, "mismatched": bad}), flush=True)
    return 0 if bad == 0 else 1


def wait_done(a, handles) -> None:
    deadline = time.monotonic() + XFER_DEADLINE_S
    pending = list(handles)
    while pending:
        st = [a.check_xfer_state(h) for h in pending]
        if "ERR" in st:
            raise RuntimeError("a NIXL transfer ended in ERR")
        pending = [h for h, s in zip(pending, st) if s != "DONE"]
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"a NIXL transfer passed its {XFER_DEADLINE_S} s deadline")


def run_initiator(args) -> dict:
    size = args.region_mib << 20
    target = subprocess.Popen(
        [sys.executable, __file__, "--role", "target", "--region-mib", str(args.region_mib)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        info = next_json(target)
        meta, raddr = base64.b64decode(info["meta"]), info["addr"]
        a = agent("initiator")
        m, arr, addr = region(size)
        arr[:] = pattern_at(size)
        a.register_memory([(addr, size, 0, "")], "DRAM")

        # Metadata exchange plus the first write completed.
        first = 4096
        t = time.perf_counter()
        remote = a.add_remote_agent(meta)
        h = a.initialize_xfer(
            "WRITE",
            a.get_xfer_descs([(addr, first, 0)], "DRAM"),
            a.get_xfer_descs([(raddr, first, 0)], "DRAM"),
            remote,
        )
        if a.transfer(h) == "ERR":
            raise RuntimeError("the first NIXL write ended in ERR")
        wait_done(a, [h])
        handshake_ms = (time.perf_counter() - t) * 1e3
        h.release()

        rows = []
        written = first
        total = parse_size(args.total)
        for bs in [parse_size(s) for s in args.block_sizes.split(",")]:
            per_batch = bs * args.batch
            if per_batch > size:
                raise RuntimeError(f"a batch of {args.batch} x {bs} B exceeds the region")
            # One prepared request per batch position in the region, re-posted as it ends.
            slots = size // per_batch
            handles = []
            for k in range(slots):
                off = k * per_batch
                ld = [(addr + off + i * bs, bs, 0) for i in range(args.batch)]
                rd = [(raddr + off + i * bs, bs, 0) for i in range(args.batch)]
                handles.append(
                    a.initialize_xfer(
                        "WRITE",
                        a.get_xfer_descs(ld, "DRAM"),
                        a.get_xfer_descs(rd, "DRAM"),
                        remote,
                    )
                )
            batches = max(1, total // per_batch)
            written = max(written, min(batches, slots) * per_batch)
            t = time.perf_counter()
            posted = 0
            inflight = []
            while posted < batches or inflight:
                while posted < batches and len(inflight) < args.inflight:
                    # A handle is re-posted only once its last post ended.
                    hh = handles[posted % slots]
                    if any(x is hh for x in inflight):
                        break
                    if a.transfer(hh) == "ERR":
                        raise RuntimeError("a NIXL write ended in ERR")
                    inflight.append(hh)
                    posted += 1
                wait_done(a, inflight[:1])
                inflight.pop(0)
            secs = time.perf_counter() - t
            rows.append(
                {"block_size": bs, "gib_per_s": batches * per_batch / GIB / secs}
            )
            for hh in handles:
                hh.release()
        a.send_notif(remote, f"done {written}".encode())
        verdict = next_json(target)
        if verdict.get("mismatched") != 0:
            raise RuntimeError(f"the target found wrong bytes: {verdict}")
        return {
            "transport": "nixl-ucx",
            "ucx_tls": os.environ.get("UCX_TLS", "(default)"),
            "handshake_first_write_ms": handshake_ms,
            "results": rows,
        }
    finally:
        try:
            target.wait(timeout=30)
        except subprocess.TimeoutExpired:
            target.kill()
            target.wait()


def next_json(proc) -> dict:
    """The target's next JSON line (UCX and NIXL may print their own lines on stdout)."""
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"the target exited (status {proc.wait()}) without its answer")


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if s[-1:] in "KMG" else s) * mult


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["initiator", "target"], default="initiator")
    p.add_argument("--block-sizes", default="65536,262144,1048576,4194304")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--inflight", type=int, default=2)
    p.add_argument("--total", default="256M")
    p.add_argument("--region-mib", type=int, default=128)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.role == "target":
        return run_target(args.region_mib << 20)
    try:
        r = run_initiator(args)
    except Exception as e:  # noqa: BLE001 - the run fails as a whole, loudly
        print(f"nixl_transfer: FAILED: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(r))
    else:
        print(f"NIXL UCX ({r['ucx_tls']}): metadata + first write {r['handshake_first_write_ms']:.2f} ms")
        for row in r["results"]:
            print(f"  {row['block_size']:>9} B  {row['gib_per_s']:.3f} GiB/s")
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # NIXL 1.5.1's agent teardown at interpreter exit crashes with SIGSEGV here (after every
    # figure was printed and checked), so the process leaves without running it.
    os._exit(rc)
