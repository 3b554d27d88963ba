"""A prefill rank and a decode rank of the kvbridge backend under SGLang's
``--disaggregation-decode-allocation-policy prefill_complete``, in one process of its own
(the policy lives in the per-process runtime context), for test_prefill_complete.py:

    python policy_process.py CASE...    CASE: order | lease | dead

runs the cases one after another and prints, for each, ``OK CASE {json}`` or
``FAIL CASE {the traceback as JSON}``. Deadlines are short (the environment below): a
transfer deadline of TRANSFER_S, a lease of LEASE_S, a probe every PROBE_S.

The order SGLang's scheduler follows under this policy: the prefill's sender exists and
computes while the decode's receiver ``init`` asks the prefill rank to say when it is done
(``BOOTSTRAP``); the prefill's ``mark_prefill_complete`` answers ``WaitingForInput``; only
then does the decode allocate and ``send_metadata``; the prefill sends its KV in one go;
its ``clear`` (after the scheduler saw Success and freed the KV) sends the decode Success.
"""

import json
import os
import sys
import time
import traceback

TRANSFER_S, LEASE_S, PROBE_S = 1.5, 2.0, 0.2
os.environ.update(
    KVBRIDGE_SECRET="sglang-test-secret-0123456789",
    KVBRIDGE_SGLANG_TRANSFER_TIMEOUT_S=str(TRANSFER_S),
    KVBRIDGE_SGLANG_LEASE_S=str(LEASE_S),
    KVBRIDGE_SGLANG_PROBE_S=str(PROBE_S),
)

import numpy as np  # noqa: E402

import kvbridge.sglang  # noqa: E402
from sglang_pd import LAYERS, PD, failure_text, free_port, topology, until_done, wait_for  # noqa: E402

#: longer than the transfer deadline and the lease: the prefill computing this long is fine
COMPUTE_S = max(TRANSFER_S, LEASE_S) + 0.5


def prefill_gone(pd, room: int) -> dict:
    """What the prefill rank still holds of a room (nothing, once the request ended; SGLang
    keeps a failed room's bootstrap entry, without its sender, until it expires)."""
    state = pd.prefill.deferred_bootstrap.rooms.get(room)
    return {
        "status": room in pd.prefill.request_status,
        "transfer_infos": room in pd.prefill.transfer_infos,
        "bootstrap_owner": state is not None and state.owner is not None,
    }


def order(pd) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll

    src, dst = [1, 2, 3, 9], [5, 6, 20, 33]
    received = pd.decode.stats["kv_received"]
    room = pd.room()
    sender = pd.sender(room)
    receiver = pd.receiver(room)
    t0 = time.monotonic()
    while time.monotonic() - t0 < COMPUTE_S:  # the prefill computes: no deadline, no lease
        assert (sender.poll(), receiver.poll()) == (KVPoll.Bootstrapping, KVPoll.Bootstrapping)
        time.sleep(0.05)
    sender.mark_prefill_complete()
    wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput, 5, "the prefill's readiness at the decode")
    receiver.send_metadata(np.array(dst, dtype=np.int32), aux_index=3)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 5, "the decode's indices")
    sender.init(len(src), aux_index=1)
    sender.send(np.array(src, dtype=np.int32))
    assert until_done(sender) == KVPoll.Success
    # the decode hears Success from the prefill's clear, once the scheduler freed the KV
    assert receiver.poll() == KVPoll.WaitingForInput
    sender.clear()
    assert until_done(receiver) == KVPoll.Success
    for buf in range(2 * LAYERS):
        for s, d in zip(src, dst):
            assert pd.dpool.page(buf, d) == pd.ppool.page(buf, s), (buf, s, d)
    for buf in range(2):
        assert pd.dpool.aux_slot(buf, 3) == pd.ppool.aux_slot(buf, 1)
    assert pd.decode.stats["kv_received"] == received + 1
    receiver.clear()
    left = {"grant": room in pd.decode._grants, "watched": room in pd.decode.room_peers}
    assert not any(left.values()), left
    assert not any(prefill_gone(pd, room).values()), prefill_gone(pd, room)
    return {"computed_s": round(COMPUTE_S, 1)}


def lease(pd) -> dict:
    """Computed, but the decode never sends its indices: the prefill frees the KV at its
    lease, counted from the end of the compute, and the decode hears why."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    room = pd.room()
    sender = pd.sender(room)
    receiver = pd.receiver(room)
    time.sleep(COMPUTE_S)
    sender.mark_prefill_complete()
    t0 = time.monotonic()
    wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput, 5, "the prefill's readiness at the decode")
    assert until_done(sender, timeout=LEASE_S + 5) == KVPoll.Failed
    took = time.monotonic() - t0
    assert LEASE_S - 0.3 < took < LEASE_S + 2.0, took
    sender_text = failure_text(sender)
    assert until_done(receiver, timeout=5) == KVPoll.Failed
    receiver_text = failure_text(receiver)
    assert "kvbridge: prefill" in receiver_text, receiver_text
    assert room not in pd.decode.room_peers
    assert not any(prefill_gone(pd, room).values()), prefill_gone(pd, room)
    return {"lease_s": round(took, 2), "sender": sender_text, "receiver": receiver_text}


def dead(pd) -> dict:
    """The prefill rank dies while it computes: the decode's probe fails the request within
    a few probes, not at SGLang's waiting timeout (300 s). The last case: it closes the
    pair's prefill rank."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    room = pd.room()
    pd.sender(room)
    receiver = pd.receiver(room)
    assert receiver.poll() == KVPoll.Bootstrapping
    t0 = time.monotonic()
    pd.prefill.close()
    pd.prefill.close = lambda: None  # closed once, here
    assert until_done(receiver, timeout=10) == KVPoll.Failed
    took = time.monotonic() - t0
    assert took < 3.0, took
    text = failure_text(receiver)
    assert "unreachable (step" in text and pd.prefill.kvbridge_peer_id in text, text
    assert room not in pd.decode.room_peers
    return {"failed_after_s": round(took, 2), "reason": text}


CASES = {"order": order, "lease": lease, "dead": dead}


def main() -> None:
    kvbridge.sglang.install()
    port = free_port()
    with topology(port, disaggregation_decode_allocation_policy="prefill_complete") as server_args:
        pd = PD(server_args, port)
        try:
            for case in sys.argv[1:]:
                try:
                    print("OK", case, json.dumps(CASES[case](pd)), flush=True)
                except Exception:  # noqa: BLE001 - reported to the test, with the traceback
                    print("FAIL", case, json.dumps(traceback.format_exc()), flush=True)
        finally:
            pd.close()


if __name__ == "__main__":
    main()
