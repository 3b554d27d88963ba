"""What LMCache write windows cost a PD transfer: the same transfers with windows off and
on, side by side in one run, alternating, in two processes over real kvbridge channels.

A receiver process holds two LMCache channels (``KvbridgeChannel``), one registered with
write windows and one without, each on an arena of 512 KiB pages; a sender process holds
one channel connected to both. One transfer is what LMCache's PD flow does with the pages
of one request, timed where each step runs:

1. allocation (receiver): the hooked allocation's ``grant_writes(writer, pages)`` (a no-op
   with windows off);
2. write (sender): ``batched_write`` of the request's pages, returning once they landed;
3. free (receiver): what the hooked allocator's free does once the decoder consumed the
   pages, ``release_when_written(pages, free)``: the time its caller waits (with windows on
   it queues the pages for the channel's drain thread, which closes their windows and then
   frees them; the next step waits until they are back, untimed, and a page handed out
   again before its window closed makes the next grant wait, timed there).

The load time of a transfer is the sum of the three. Steps are sequenced over a pipe (not
timed). Both channels use ``KVBRIDGE_TRANSPORT`` (default here: tcp, since a windowed arena
is written over TCP whatever the setting, so off vs on compares the windows alone);
``--off-transport auto`` compares with what the unconfined arena would use on one host.

Each round runs ``--transfers`` transfers per mode and size, the mode order alternating
between rounds; the figure per mode is the median over rounds of each round's mean load
time, with the min-max of the round means, and the ratio on/off of the medians. The last
page of each transfer is checked by digest on the receiver.

    python bench/lmcache_windows.py [--rounds 7] [--transfers 20] [--sizes 4,16]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time

PAGE = 512 << 10


def _arena(pages: int):
    import torch

    return torch.zeros(pages * PAGE, dtype=torch.uint8)


def _channel(role: str, arena, listen=None, **kw):
    from kvbridge.lmcache.channel import KvbridgeChannel

    return KvbridgeChannel(
        role=role,
        buffer_ptr=arena.data_ptr(),
        buffer_size=arena.numel(),
        align_bytes=PAGE,
        tp_rank=0,
        peer_init_url=listen,
        device="cpu",
        **kw,
    )


def receiver(conn, pages: int, off_transport: str, transport: str) -> None:
    import kvbridge

    arenas, chans = {}, {}
    for mode in ("off", "on"):
        os.environ["KVBRIDGE_TRANSPORT"] = off_transport if mode == "off" else transport
        arenas[mode] = _arena(pages)
        chans[mode] = _channel("receiver", arenas[mode], "127.0.0.1:0", write_windows=(mode == "on"))
    conn.send({m: str(c.kvbridge_channel.local_addr) for m, c in chans.items()})
    while True:
        if not conn.poll(600):
            break  # the sender is gone
        cmd = conn.recv()
        if cmd is None:
            break
        op, mode, pages_ = cmd[0], cmd[1], cmd[2]
        if op == "stats":
            conn.send({m: dict(c.kvbridge_channel.stats(), write_refusals=c.write_refusals) for m, c in chans.items()})
            continue
        ch = chans[mode]
        if op == "grant":
            t0 = time.perf_counter()
            ch.grant_writes(cmd[3], pages_)
            conn.send(time.perf_counter() - t0)
        elif op == "free":
            freed: list = []
            back = threading.Event()

            def release(ps):
                freed.extend(ps)
                if len(freed) == len(pages_):
                    back.set()

            t0 = time.perf_counter()
            ch.release_when_written(pages_, release)
            dt = time.perf_counter() - t0  # what LMCache's free waits
            # the pages are back once their windows closed (the drain thread, windows on)
            assert back.wait(30), f"pages {pages_} not back in 30 s"
            assert sorted(freed) == pages_, (freed, pages_)
            last = arenas[mode][pages_[-1] * PAGE : (pages_[-1] + 1) * PAGE]
            conn.send((dt, kvbridge.digest(bytes(last.numpy()))))
    for c in chans.values():
        c.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--transfers", type=int, default=20)
    ap.add_argument("--sizes", default="4,16", help="MiB per transfer")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--off-transport", default=None, help="KVBRIDGE_TRANSPORT with windows off (default: as on)")
    args = ap.parse_args()
    transport = os.environ.get("KVBRIDGE_TRANSPORT", "tcp")
    off_transport = args.off_transport or transport
    sizes = [int(s) for s in args.sizes.split(",")]
    per = max(sizes) * (1 << 20) // PAGE
    pages = 2 * per  # two transfers' worth: consecutive transfers use different pages

    import torch
    from unittest.mock import MagicMock

    import kvbridge
    from lmcache.v1.memory_management import MemoryObj

    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(theirs, pages, off_transport, transport), daemon=True)
    proc.start()

    def answer(timeout: float = 60.0):
        # every wait has a deadline: a receiver that died or hangs fails the run by name
        if not mine.poll(timeout):
            raise SystemExit(f"bench: no answer from the receiver process in {timeout} s (exit code {proc.exitcode})")
        return mine.recv()

    urls = answer(120)
    os.environ["KVBRIDGE_TRANSPORT"] = transport
    src = _arena(per)
    g = torch.Generator().manual_seed(41)
    src.copy_(torch.randint(0, 256, (src.numel(),), generator=g, dtype=torch.uint8))
    sender = _channel("sender", src)
    for mode, url in urls.items():
        sender.lazy_init_peer_connection("", f"R-{mode}", url)
    objs = []
    for i in range(per):
        o = MagicMock(spec=MemoryObj)
        o.meta = MagicMock(address=i)
        objs.append(o)

    def transfer(mode: str, mib: int, k: int) -> float:
        n = mib * (1 << 20) // PAGE
        remote = [(k % 2) * per + i for i in range(n)]
        mine.send(("grant", mode, remote, sender.writer_id))
        grant = answer()
        t0 = time.perf_counter()
        sender.batched_write(objs[:n], {"receiver_id": f"R-{mode}", "remote_indexes": remote})
        write = time.perf_counter() - t0
        mine.send(("free", mode, remote))
        free, digest = answer()
        want = kvbridge.digest(bytes(src[(n - 1) * PAGE : n * PAGE].numpy()))
        assert digest == want, f"{mode} {mib} MiB: the last page did not land byte for byte"
        return grant + write + free, grant, write, free

    print(f"# bench/lmcache_windows.py {' '.join(sys.argv[1:])}")
    print(f"# kvbridge {kvbridge.__version__}, pages {PAGE >> 10} KiB, transport on={transport} off={off_transport}, "
          f"{args.rounds} rounds x {args.transfers} transfers per mode and size, warmup {args.warmup}, "
          f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.2f}")  # fmt: skip
    k = 0
    for mib in sizes:
        for mode in ("off", "on"):
            for _ in range(args.warmup):
                transfer(mode, mib, k)
                k += 1
    results: dict = {(mib, m): [] for mib in sizes for m in ("off", "on")}
    parts: dict = {(mib, m): [] for mib in sizes for m in ("off", "on")}
    for r in range(args.rounds):
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        for mib in sizes:
            for mode in order:
                runs = []
                for _ in range(args.transfers):
                    runs.append(transfer(mode, mib, k))
                    k += 1
                mean = statistics.fmean(x[0] for x in runs)
                results[(mib, mode)].append(mean)
                parts[(mib, mode)].append(tuple(statistics.fmean(x[i] for x in runs) for i in (1, 2, 3)))
                print(f"round {r} {mib:>3} MiB {mode:>3}: load {mean * 1e3:8.3f} ms "
                      f"(grant {parts[(mib, mode)][-1][0] * 1e6:7.1f} us, write {parts[(mib, mode)][-1][1] * 1e3:8.3f} ms, "
                      f"free {parts[(mib, mode)][-1][2] * 1e6:7.1f} us)", flush=True)  # fmt: skip
    mine.send(("stats", None, None))
    stats = answer()
    print(f"# receiver: windows on refused {stats['on']['write_refusals']} writes; "
          f"batches over shm/cma/ucx with windows off: {stats['off'].get('shm_batches')}/"
          f"{stats['off'].get('cma_batches')}/{stats['off'].get('ucx_batches')}")  # fmt: skip
    print("summary (median of round means, min-max; on/off from the medians)")
    for mib in sizes:
        off, on = results[(mib, "off")], results[(mib, "on")]
        mo, mn = statistics.median(off), statistics.median(on)
        g = statistics.median(p[0] for p in parts[(mib, "on")])
        f = statistics.median(p[2] for p in parts[(mib, "on")])
        print(f"{mib:>3} MiB: off {mo * 1e3:8.3f} ms ({min(off) * 1e3:.3f}-{max(off) * 1e3:.3f}), "
              f"on {mn * 1e3:8.3f} ms ({min(on) * 1e3:.3f}-{max(on) * 1e3:.3f}), on/off {mn / mo:.4f} "
              f"({(mn / mo - 1) * 100:+.2f}%); on: grant {g * 1e6:.1f} us, free {f * 1e6:.1f} us per transfer")  # fmt: skip
    mine.send(None)
    proc.join(30)
    sender.close()


if __name__ == "__main__":
    main()
