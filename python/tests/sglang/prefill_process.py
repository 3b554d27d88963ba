"""A prefill rank of the kvbridge backend in its own process, with its bootstrap server, for
the tests that kill it (test_failures.py). Commands on stdin, one a line:

    room ROOM PAGES SEND    make a sender, wait for the decode's indices, send SEND of PAGES
                            pages (one page a chunk), print "SENT ROOM"

Prints "READY" once its bootstrap server and rank are registered.
"""

import sys
import numpy as np

import kvbridge.sglang
from sglang_pd import ITEM, Pool, kv_args, topology, wait_for


def main() -> None:
    port = int(sys.argv[1])
    kvbridge.sglang.install()
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

    b = TransferBackend("kvbridge")
    with topology(port) as server_args:
        server = get_kv_class(b, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
        pool = Pool.make(fill=2)
        mgr = get_kv_class(b, KVClassType.MANAGER)(kv_args(pool), DisaggregationMode.PREFILL, server_args, False)
        print("READY", flush=True)
        senders = []
        for line in sys.stdin:
            cmd = line.split()
            if cmd and cmd[0] == "room":
                room, pages, send = int(cmd[1]), int(cmd[2]), int(cmd[3])
                s = get_kv_class(b, KVClassType.SENDER)(mgr, f"127.0.0.1:{port}", room)
                senders.append(s)
                wait_for(lambda: s.poll() == KVPoll.WaitingForInput, 20, "the decode's indices")
                s.init(pages, aux_index=0)
                sent_before = mgr.stats["bytes_sent"]
                for p in range(send):
                    s.send(np.array([p], dtype=np.int32))
                if send == pages:
                    wait_for(lambda: s.poll() == KVPoll.Success, 20, "the transfer")
                else:  # the chunks sent so far have landed
                    want = sent_before + send * ITEM * len(pool.kv)
                    wait_for(lambda: mgr.stats["bytes_sent"] >= want, 20, "the first chunks")
                print("SENT", room, flush=True)
        server.close()


if __name__ == "__main__":
    main()
