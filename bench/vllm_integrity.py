"""What ``kvbridge_integrity`` costs a vLLM decoder's load: loads of the same request with
the check on and off, alternating, side by side in one run, over real kvbridge channels
between in-process KvbridgeWorkers (vLLM CPU's block layout, 1 MiB blocks; no model runs).

Prints per round each load's seconds (the worker's own ``load_seconds``: from the load's
start to its end, reads, lease check and, when on, the digest check), then the medians, the
spread and the ratio checked / unchecked, and what the prefiller's digests of one request
cost. A failed load fails the run and prints no figure.

    .venv/bin/python bench/vllm_integrity.py [--rounds 7] [--blocks 32] [--transport auto|tcp]
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--transport", default="auto", choices=["auto", "tcp"])
    a = ap.parse_args()
    if a.transport == "tcp":
        os.environ["KVBRIDGE_CMA"] = "0"
    extra = {"kvbridge_transport": a.transport}
    shape = dict(block_size=TOKENS, total_kv_heads=HEADS, head_size=HEAD_SIZE)
    blocks = list(range(a.blocks))
    p = make_worker("kv_producer", caches(a.blocks, seed=1), engine_id="P", extra=extra, **shape)
    ds = {
        on: make_worker("kv_consumer", caches(a.blocks, None), engine_id=f"D{on}",
                        extra={**extra, "kvbridge_integrity": on}, **shape)  # fmt: skip
        for on in (True, False)
    }
    host, port = p.listen_addr.rsplit(":", 1)
    took: dict[bool, list[float]] = {True: [], False: []}
    records: list[float] = []
    n = 0
    try:
        for r in range(a.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                n += 1
                req = f"p-{n}"
                t0 = time.perf_counter()
                p.start_load_kv(granted_meta(reqs_to_send={req: 30.0}, hold_blocks={req: blocks}))
                records.append(time.perf_counter() - t0)
                d = ds[on]
                before = d.stats["load_seconds"]
                job = recv_job(blocks, blocks, "P", req, host, int(port))
                d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={f"d-{n}": job}))
                poll(d, want_recving={f"d-{n}"}, timeout=60)
                if d.take_failed_recving():
                    print(f"FAILED: load {n} (check {'on' if on else 'off'}) failed: {d.stats}", file=sys.stderr)
                    return 1
                took[on].append(d.stats["load_seconds"] - before)
                poll(p, want_sending={req}, timeout=60)
            print(f"round {r}: checked {took[True][-1] * 1e3:.1f} ms, unchecked {took[False][-1] * 1e3:.1f} ms")
        if ds[True].stats["loads_checked"] != a.rounds or ds[False].stats["loads_checked"] != 0:
            print(f"FAILED: loads checked {ds[True].stats['loads_checked']} / {ds[False].stats['loads_checked']}")
            return 1
    finally:
        for w in (p, *ds.values()):
            w.shutdown()
    mib = a.blocks * len(LAYERS)
    on, off = statistics.median(took[True]), statistics.median(took[False])
    print(f"transport {a.transport}, {a.rounds} loads each of {a.blocks} blocks x {len(LAYERS)} layers ({mib} MiB)")
    for name, xs in (("checked", took[True]), ("unchecked", took[False])):
        print(f"{name}: median {statistics.median(xs) * 1e3:.1f} ms, min {min(xs) * 1e3:.1f}, max {max(xs) * 1e3:.1f}")
    ratios = sorted(x / y for x, y in zip(took[True], took[False]))
    print(f"ratio checked/unchecked: median of medians {on / off:.3f}; per round {ratios[0]:.3f}..{ratios[-1]:.3f}")
    print(f"prefiller's digests of one request (with its hold): median {statistics.median(records) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
