"""What ``kvbridge_read_grants`` costs a vLLM load: loads of the same request from a
prefiller with read grants on and from one with them off, alternating, side by side in one
run, over TCP (read grants send every read over TCP; the comparison is TCP against TCP),
between in-process KvbridgeWorkers (vLLM CPU's block layout, 1 MiB blocks; no model runs;
digests off on both, to measure the grants alone).

Prints per round each load's seconds (the decoder worker's own ``load_seconds``: from the
load's start to its end, reads and lease check), then the medians, the spread and the ratio
on / off, and what the prefiller spends opening a request's windows (with its hold) and
closing them (with its free). A failed load, or a prefiller with grants on whose reads were
not all made under a grant, fails the run and prints no figure.

    .venv/bin/python bench/vllm_read_grants.py [--rounds 15] [--blocks 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "tests" / "vllm"))


from kvbridge.vllm.metadata import KvbridgeConnectorMetadata  # noqa: E402
from vllm_helpers import LAYERS, granted_meta, kv_caches, make_worker, poll, recv_job  # noqa: E402

HEADS, HEAD_SIZE, TOKENS = 8, 128, 256  # bf16: 1 MiB a block a layer


def caches(blocks: int, seed: int | None) -> dict:
    return kv_caches(seed, heads=HEADS, head_size=HEAD_SIZE, block_size=TOKENS, blocks=blocks)


def ms(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1e3:.2f} ms, min {min(xs) * 1e3:.2f}, max {max(xs) * 1e3:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--blocks", type=int, default=64)
    # both prefillers with read grants off: what the two instances differ by alone (the
    # "on" figures are then a second "off" prefiller's)
    ap.add_argument("--aa", action="store_true")
    # the prefiller with grants off made first (by default the one with them on is): an
    # A/A run showed the two instances differ by themselves, so a pair of runs, one each
    # way, cancels what comes of the order they were made in
    ap.add_argument("--swap", action="store_true")
    a = ap.parse_args()
    os.environ["KVBRIDGE_CMA"] = "0"
    base = {"kvbridge_transport": "tcp", "kvbridge_integrity": False}
    shape = dict(block_size=TOKENS, total_kv_heads=HEADS, head_size=HEAD_SIZE)
    # the request's blocks, every other one (a window per block, as a fragmented cache's)
    # and then a contiguous run: half the cache each way
    half = a.blocks // 2
    blocks = list(range(0, half, 2)) + list(range(half, half + half // 2))
    ps = {
        on: make_worker("kv_producer", caches(a.blocks, seed=1), engine_id=f"P{int(on)}",
                        extra={**base, "kvbridge_read_grants": on and not a.aa}, **shape)  # fmt: skip
        for on in ((False, True) if a.swap else (True, False))
    }
    d = make_worker("kv_consumer", caches(a.blocks, None), engine_id="D", extra=base, **shape)
    took: dict[bool, list[float]] = {True: [], False: []}
    opens: dict[bool, list[float]] = {True: [], False: []}
    frees: dict[bool, list[float]] = {True: [], False: []}
    n = 0
    try:
        for r in range(a.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                n += 1
                p, req = ps[on], f"p-{n}"
                host, port = p.listen_addr.rsplit(":", 1)
                t0 = time.perf_counter()
                p.start_load_kv(granted_meta(reqs_to_send={req: 30.0}, hold_blocks={req: blocks}))
                opens[on].append(time.perf_counter() - t0)
                before = d.stats["load_seconds"]
                job = recv_job(list(range(len(blocks))), blocks, p.settings.engine_id, req, host, int(port))
                d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={f"d-{n}": job}))
                poll(d, want_recving={f"d-{n}"}, timeout=60)
                if d.take_failed_recving():
                    print(f"FAILED: load {n} (grants {'on' if on else 'off'}) failed: {d.stats}", file=sys.stderr)
                    return 1
                took[on].append(d.stats["load_seconds"] - before)
                t0 = time.perf_counter()
                poll(p, want_sending={req}, timeout=60)
                frees[on].append(time.perf_counter() - t0)
            print(f"round {r}: grants on {took[True][-1] * 1e3:.2f} ms, off {took[False][-1] * 1e3:.2f} ms")
        s_on, s_off = ps[True].channel.stats(), ps[False].channel.stats()
        confined = ps[True]._read_grants is not None
        if a.aa == confined or s_on["access_denied"] or s_on["cma_batches"] or s_off["cma_batches"]:
            print(f"FAILED: grants on {s_on}, off {s_off}", file=sys.stderr)
            return 1
        if ps[True]._read_grants is not None and len(ps[True]._read_grants):
            print(f"FAILED: grants on {s_on}, off {s_off}", file=sys.stderr)
            return 1
    finally:
        for w in (*ps.values(), d):
            w.shutdown()
    mib = len(blocks) * len(LAYERS)
    on, off = statistics.median(took[True]), statistics.median(took[False])
    runs = len(range(0, half, 2)) + 1
    print(f"prefillers made in the order: {'off, on' if a.swap else 'on, off'}")
    if a.aa:
        print("A/A: both prefillers with read grants OFF; 'on' is the first prefiller, 'off' the second")
    print(
        f"transport tcp, {a.rounds} loads each of {len(blocks)} blocks ({runs} runs) x {len(LAYERS)} layers "
        f"({mib} MiB)"
    )
    print(f"load, grants on: {ms(took[True])}")
    print(f"load, grants off: {ms(took[False])}")
    ratios = sorted(x / y for x, y in zip(took[True], took[False]))
    print(
        f"ratio on/off: median of medians {on / off:.4f} ({(on / off - 1) * 100:+.2f}%); median per-round ratio "
        f"{statistics.median(ratios):.4f}; per round {ratios[0]:.3f}..{ratios[-1]:.3f}"
    )
    print(f"prefiller's hold (start_load_kv), grants on: {ms(opens[True])}; off: {ms(opens[False])}")
    print(f"prefiller's free (from the decoder's load end to get_finished), on: {ms(frees[True])}; "
          f"off: {ms(frees[False])}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
