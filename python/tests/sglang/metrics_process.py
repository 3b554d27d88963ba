"""One request over the kvbridge backend in a process of its own, with SGLang's
``--enable-metrics`` on and ``PROMETHEUS_MULTIPROC_DIR`` set by the caller, as SGLang's
launcher sets it for its scheduler processes (test_metrics.py reads the directory as
SGLang's HTTP server does):

    python metrics_process.py    prints "OK {the managers' stats as JSON}" and exits 0
"""

import json

import numpy as np

import kvbridge.sglang
from sglang_pd import PD, free_port, topology, until_done, wait_for

MODEL = "kvbridge-metrics-test"


def main() -> None:
    kvbridge.sglang.install()
    from sglang.srt.disaggregation.base.conn import KVPoll

    port = free_port()
    with topology(port, enable_metrics=True, served_model_name=MODEL) as server_args:
        pd = PD(server_args, port)
        room = pd.room()
        sender, receiver = pd.sender(room), pd.receiver(room)
        receiver.send_metadata(np.array([5, 6, 9], dtype=np.int32), aux_index=3)
        wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 20, "the decode's indices")
        sender.init(3, aux_index=1)
        sender.send(np.array([1, 2, 7], dtype=np.int32))
        assert until_done(sender) == KVPoll.Success and until_done(receiver) == KVPoll.Success
        sender.clear()
        receiver.clear()
        stats = {"prefill": dict(pd.prefill.stats), "decode": dict(pd.decode.stats)}
        pd.close()
    print("OK " + json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
