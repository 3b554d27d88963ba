"""The kvbridge SGLang backend's write of one request's KV, by how its pages lie:

    PYTHONPATH=<slim SGLang>:python python bench/sglang_write_ops.py [--reps 2]

A prefill rank and a decode rank on SGLang's real classes in this process
(python/tests/sglang/sglang_pd.py), over TCP on 127.0.0.1, with the KV of
bench/sglang-pd.sh's model: 8 layers (16 KV buffers) x 4 heads x head_dim 64, bf16, page
size 1 (SGLang on CPU), 900 tokens: 7.0 MiB. For pages in one run on both sides (16 ops, one
per buffer) and for pages scattered on both sides (one op per page and buffer): the time to
build the ops, the manager's write, and from ``send`` to the decode's ``poll()`` saying
Success (polled every 10 ms)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("KVBRIDGE_SECRET", "sglang-bench-secret-0123456789")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python/tests/sglang"))

import numpy as np  # noqa: E402
import sglang_pd as pdmod  # noqa: E402

TOKENS, BUFFERS, ITEM = 900, 16, 1 * 4 * 64 * 2  # one token's K (or V) of one layer: 512 bytes
pdmod.LAYERS, pdmod.PAGES, pdmod.PAGE_TOKENS = BUFFERS // 2, 2048, 1


def pool(fill):
    kv = [np.zeros(pdmod.PAGES * ITEM, dtype=np.uint8) for _ in range(BUFFERS)]
    aux = [np.zeros(pdmod.AUX_ITEMS * pdmod.AUX_ITEM, dtype=np.uint8) for _ in range(2)]
    if fill is not None:
        for b in kv:
            b[:] = np.random.default_rng(fill).integers(0, 256, b.size, dtype=np.uint8)
    return pdmod.Pool(kv, aux, ITEM)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    import kvbridge.sglang
    from kvbridge.sglang import manager
    from kvbridge.sglang.ops import write_ops
    from sglang.srt.disaggregation.base.conn import KVPoll

    kvbridge.sglang.install()
    pdmod.Pool.make = classmethod(lambda cls, fill=None, item=ITEM: pool(fill))
    writes = []
    write = manager.KvbridgeKVManager._write

    def timed(self, peer, ops, token):
        t0 = time.perf_counter()
        write(self, peer, ops, token)
        writes.append(time.perf_counter() - t0)

    manager.KvbridgeKVManager._write = timed
    rng = np.random.default_rng(0)
    port = pdmod.free_port()
    with pdmod.topology(port) as server_args:
        pd = pdmod.PD(server_args, port)
        try:
            for label in ["pages in one run"] * a.reps + ["pages scattered"] * a.reps:
                if label == "pages in one run":
                    src, dst = np.arange(10, 10 + TOKENS), np.arange(1000, 1000 + TOKENS)
                else:
                    src, dst = rng.permutation(2000)[:TOKENS], rng.permutation(2000)[:TOKENS]
                src, dst = src.astype(np.int32), dst.astype(np.int32)
                room = pd.room()
                s, r = pd.sender(room), pd.receiver(room)
                r.send_metadata(dst, aux_index=1)
                pdmod.wait_for(lambda: s.poll() == KVPoll.WaitingForInput, 10, "the decode's indices")
                s.init(len(src), aux_index=0)
                t0 = time.perf_counter()
                ops = write_ops(src, dst, pd.prefill.kv_regions, pd.decode.kv_regions, [ITEM] * BUFFERS)
                built = time.perf_counter() - t0
                t0 = time.perf_counter()
                s.send(src)
                pdmod.wait_for(lambda: r.poll() == KVPoll.Success, 20, "Success")
                done = time.perf_counter() - t0
                print(
                    f"{label}: {len(ops)} ops built in {built * 1e3:.1f} ms; write {writes[-1] * 1e3:.1f} ms; "
                    f"send to the decode's Success {done * 1e3:.1f} ms",
                    flush=True,
                )
                s.clear()
                r.clear()
        finally:
            pd.close()


if __name__ == "__main__":
    main()
