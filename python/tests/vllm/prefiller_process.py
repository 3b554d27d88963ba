"""A prefiller worker in a process of its own, for tests that stop or kill it.

`prefiller_process.py SEED REQ...`: a kv_producer worker whose KV cache is filled from SEED,
holding the blocks of requests REQ... (as its scheduler would after their prefill); prints
its kvbridge address, then `freed REQ` for each request whose blocks a decoder's notice
freed, and exits after 120 s.
"""

import sys
import time

from kvbridge.vllm.metadata import KvbridgeConnectorMetadata
from vllm_helpers import kv_caches, make_worker
from vllm_helpers import granted_meta  # noqa: E402

LIFETIME_S = 120.0


def main() -> None:
    worker = make_worker("kv_producer", kv_caches(seed=int(sys.argv[1])), engine_id=f"P{sys.argv[1]}")
    worker.start_load_kv(granted_meta(reqs_to_send={r: LIFETIME_S for r in sys.argv[2:]}))
    print(worker.listen_addr, flush=True)
    deadline = time.monotonic() + LIFETIME_S
    while time.monotonic() < deadline:
        sending, _ = worker.get_finished(set())
        for req in sorted(sending or ()):
            print("freed", req, flush=True)
        time.sleep(0.01)


if __name__ == "__main__":
    main()
