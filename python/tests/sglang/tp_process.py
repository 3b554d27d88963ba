"""Prefill and decode ranks of the kvbridge backend with attention TP on each side, in one
process of its own (the runtime context is per process), for test_tp.py:

    python tp_process.py P D [mla]    prints "OK" and exits 0, or raises

With P == D each decode rank must receive the KV of the prefill rank of its index (each
prefill rank's KV differs). With P < D and MLA (the same KV on every rank) every decode
rank receives prefill rank 0's.
"""

import sys

import numpy as np

import kvbridge.sglang
from sglang_pd import LAYERS, Pool, free_port, kv_args, topology, until_done, wait_for


def main() -> None:
    ptp, dtp = int(sys.argv[1]), int(sys.argv[2])
    mla = len(sys.argv) > 3 and sys.argv[3] == "mla"
    kvbridge.sglang.install()
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class
    from sglang.srt.runtime_context import get_parallel

    cls = {t: get_kv_class(TransferBackend("kvbridge"), t) for t in KVClassType}
    port = free_port()
    addr = f"127.0.0.1:{port}"
    with topology(port, tp_size=dtp) as server_args:
        server = cls[KVClassType.BOOTSTRAP_SERVER](host="127.0.0.1", port=port)
        ppools = [Pool.make(fill=10 + r) for r in range(ptp)]
        dpools = [Pool.make() for _ in range(dtp)]
        pm, dm = [], []
        for r in range(ptp):
            with get_parallel().override(tp_size=ptp, attn_tp_size=ptp, moe_tp_size=ptp, tp_rank=r, attn_tp_rank=r):
                pm.append(cls[KVClassType.MANAGER](kv_args(ppools[r], rank=r), DisaggregationMode.PREFILL, server_args, mla))
        for r in range(dtp):
            with get_parallel().override(tp_rank=r, attn_tp_rank=r):
                dm.append(cls[KVClassType.MANAGER](kv_args(dpools[r], rank=r), DisaggregationMode.DECODE, server_args, mla))
        room = 77
        senders, receivers = [], []
        for r in range(ptp):
            senders.append(cls[KVClassType.SENDER](pm[r], addr, room))
        for r in range(dtp):
            with get_parallel().override(tp_rank=r, attn_tp_rank=r):
                wait_for(lambda: dm[r].try_ensure_parallel_info(addr), 20, "the prefill ranks")
                rcv = cls[KVClassType.RECEIVER](dm[r], addr, room)
                rcv.init(0)
                receivers.append(rcv)
        src, dst = [3, 4, 8], [10, 11, 30]
        for r in range(dtp):
            if receivers[r].poll() == KVPoll.Failed:
                receivers[r].failure_exception()
            receivers[r].send_metadata(np.array(dst, dtype=np.int32), aux_index=2)
        for r in range(ptp):
            wait_for(lambda: senders[r].poll() == KVPoll.WaitingForInput, 20, f"rank {r}'s indices")
            senders[r].init(len(src), aux_index=1)
            senders[r].send(np.array(src, dtype=np.int32))
        for r in range(ptp):
            assert until_done(senders[r]) == KVPoll.Success
        for r in range(dtp):
            assert until_done(receivers[r]) == KVPoll.Success
            p = r if ptp == dtp else 0
            for buf in range(2 * LAYERS):
                for s, d in zip(src, dst):
                    assert dpools[r].page(buf, d) == ppools[p].page(buf, s), (r, buf, s, d)
                    if ptp > 1:
                        assert dpools[r].page(buf, d) != ppools[1 - p].page(buf, s)
            assert dpools[r].aux_slot(0, 2) == ppools[p].aux_slot(0, 1)
        for m in pm + dm:
            m.close()
        server.close()
    print("OK", flush=True)


if __name__ == "__main__":
    main()
