"""What the LMCache receiver's write-window steps cost alone, in one process, no network:
per transfer of N pages, the grant at allocation (``grant_writes``) and the close its drain
thread does once LMCache freed the pages (``revoke_writes``: close, then wait for admitted
writes; none is in flight here). ``--cold`` sleeps 2 ms before each step, as a receiver
does while the write is on the wire (caches and the core go cold); without it the steps run
back to back. Medians with p10-p90 over ``--reps``; bench/lmcache_windows.py measures the
same steps inside real transfers.

    python bench/lmcache_window_steps.py [--pages 8,32] [--reps 1000] [--cold]
"""

from __future__ import annotations

import argparse
import statistics
import time

PAGE = 512 << 10


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", default="8,32", help="pages per transfer (512 KiB each)")
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--cold", action="store_true")
    args = ap.parse_args()

    import torch

    import kvbridge
    from kvbridge.lmcache.channel import KvbridgeChannel

    def q(v: list) -> str:
        s = sorted(v)
        return f"{statistics.median(s) * 1e6:6.1f} us ({s[len(s) // 10] * 1e6:.1f}-{s[9 * len(s) // 10] * 1e6:.1f})"

    print(f"# kvbridge {kvbridge.__version__} from {kvbridge.__file__}, {'cold' if args.cold else 'hot'}, {args.reps} reps")
    for n in (int(p) for p in args.pages.split(",")):
        arena = torch.zeros(2 * n * PAGE, dtype=torch.uint8)
        ch = KvbridgeChannel(role="receiver", buffer_ptr=arena.data_ptr(), buffer_size=arena.numel(),
                             align_bytes=PAGE, tp_rank=0, peer_init_url="127.0.0.1:0", device="cpu",
                             write_windows=True)  # fmt: skip
        grant, close = [], []
        try:
            for k in range(args.reps):
                pages = [(k % 2) * n + i for i in range(n)]
                if args.cold:
                    time.sleep(0.002)
                t0 = time.perf_counter()
                ch.grant_writes("lmcache-sender-tp0-bench", pages)
                grant.append(time.perf_counter() - t0)
                if args.cold:
                    time.sleep(0.002)
                t0 = time.perf_counter()
                late = ch.revoke_writes(pages)
                close.append(time.perf_counter() - t0)
                assert not late, late
        finally:
            ch.close()
        print(f"{n:3d} pages: grant {q(grant)}, close and wait {q(close)} (median, p10-p90)")


if __name__ == "__main__":
    main()
