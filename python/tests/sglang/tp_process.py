"""Two prefill ranks and two decode ranks (attention TP 2 on both sides) of the kvbridge
backend in one process of its own (the runtime context is per process), for
test_tp.py: each decode rank must receive the KV of the prefill rank of its index.

    python tp_process.py        prints "OK" and exits 0, or raises
"""

import numpy as np

import kvbridge.sglang
from sglang_pd import LAYERS, Pool, free_port, kv_args, topology, until_done, wait_for


def main() -> None:
    kvbridge.sglang.install()
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class
    from sglang.srt.runtime_context import get_parallel

    cls = {t: get_kv_class(TransferBackend("kvbridge"), t) for t in KVClassType}
    port = free_port()
    addr = f"127.0.0.1:{port}"
    with topology(port, tp_size=2) as server_args:
        server = cls[KVClassType.BOOTSTRAP_SERVER](host="127.0.0.1", port=port)
        ppools = [Pool.make(fill=10 + r) for r in (0, 1)]
        dpools = [Pool.make() for _ in (0, 1)]
        pm, dm = [], []
        for r in (0, 1):
            with get_parallel().override(tp_rank=r, attn_tp_rank=r):
                pm.append(cls[KVClassType.MANAGER](kv_args(ppools[r], rank=r), DisaggregationMode.PREFILL, server_args, False))
                dm.append(cls[KVClassType.MANAGER](kv_args(dpools[r], rank=r), DisaggregationMode.DECODE, server_args, False))
        room = 77
        senders, receivers = [], []
        for r in (0, 1):
            with get_parallel().override(tp_rank=r, attn_tp_rank=r):
                wait_for(lambda: dm[r].try_ensure_parallel_info(addr), 20, "the prefill ranks")
                senders.append(cls[KVClassType.SENDER](pm[r], addr, room))
                rcv = cls[KVClassType.RECEIVER](dm[r], addr, room)
                rcv.init(0)
                receivers.append(rcv)
        src, dst = [3, 4, 8], [10, 11, 30]
        for r in (0, 1):
            receivers[r].send_metadata(np.array(dst, dtype=np.int32), aux_index=2)
        for r in (0, 1):
            wait_for(lambda: senders[r].poll() == KVPoll.WaitingForInput, 20, f"rank {r}'s indices")
            senders[r].init(len(src), aux_index=1)
            senders[r].send(np.array(src, dtype=np.int32))
        for r in (0, 1):
            assert until_done(senders[r]) == KVPoll.Success
            assert until_done(receivers[r]) == KVPoll.Success
            for buf in range(2 * LAYERS):
                for s, d in zip(src, dst):
                    assert dpools[r].page(buf, d) == ppools[r].page(buf, s), (r, buf, s, d)
                    assert dpools[r].page(buf, d) != ppools[1 - r].page(buf, s)
            assert dpools[r].aux_slot(0, 2) == ppools[r].aux_slot(0, 1)
        for m in pm + dm:
            m.close()
        server.close()
    print("OK", flush=True)


if __name__ == "__main__":
    main()
