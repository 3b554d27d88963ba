"""Prefill and decode ranks of the kvbridge backend with attention TP on each side, in one
process of its own (the runtime context is per process), for test_tp.py:

    python tp_process.py CASE...    CASE: P,D,mha|mla,HEADS[,refuse][,bound]

runs the cases one after another (SGLang imported once) and prints, for each, ``OK CASE
{json of what was counted}`` or ``FAIL CASE {the traceback as JSON}``.

MHA (any P, D): the model's KV is one array per buffer of ``[pages, tokens, HEADS heads,
HEAD_BYTES]``; prefill rank r's pool holds the heads SGLang gives it at TP P. After the
transfer, each decode rank's whole pool (every buffer, every page) must equal what a
same-TP transfer gives it: the model's KV of the heads it holds at TP D in the request's
pages, zeros elsewhere (``test_tp_pairs_that_work[2-2-mha]`` is that same-TP transfer). Ops
and bytes are counted against what the heads require: one op per token and buffer where a
decode rank's heads are part of a prefill rank's row (or the other way), one per run of
pages where the rows are the same heads, each head written once, and the metadata once per
prefill rank and decode rank that SGLang pairs.

MLA (the same KV on every rank): every decode rank receives prefill rank 0's.

``refuse``: the decode's pages hold heads of another size; each prefill rank refuses each
decode rank once, at its registration, and every request fails at once with the reason.

``bound``: the prefill ranks have ids bound to the prefill's own key, and the decodes
require bound prefills (``KVBRIDGE_SGLANG_REQUIRE_BOUND_PREFILL``): each decode rank checks
every prefill rank it hears from, and opens its pages to each of their ids.
"""

import json
import os
import sys
import tempfile
import traceback

import numpy as np

import kvbridge.sglang
from kvbridge.sglang.head_slices import prefill_ranks_of
from sglang_pd import AUX_ITEM, LAYERS, PAGE_TOKENS, PAGES, Pool, failure_text, free_port, kv_args, topology, until_done
from sglang_pd import wait_for

HEAD_BYTES = 16  # head_dim 8, fp16
BUFFERS = 2 * LAYERS
SRC, DST = [3, 4, 8], [10, 11, 30]  # pages 3 and 4 land in adjacent pages: one run, then another
BOUND_KEY = "key-of-the-tp-prefill-server-0123"


def set_env(**values) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def heads_of(rank: int, tp: int, total: int) -> range:
    per = max(1, total // tp)
    first = rank * per if tp <= total else rank * total // tp
    return range(first, first + per)


def model_kv(total: int) -> list:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, (PAGES, PAGE_TOKENS, total, HEAD_BYTES), dtype=np.uint8) for _ in range(BUFFERS)]


def rank_pool(model: list, rank: int, tp: int, total: int) -> Pool:
    hs = heads_of(rank, tp, total)
    pool = Pool.make(item=PAGE_TOKENS * len(hs) * HEAD_BYTES)
    for b in range(BUFFERS):
        pool.kv[b][:] = model[b][:, :, hs.start : hs.stop].reshape(-1)
    rng = np.random.default_rng(99)  # metadata: the same on every prefill rank, as in SGLang
    for a in pool.aux:
        a[:] = rng.integers(0, 256, a.size, dtype=np.uint8)
    return pool


def expected_pool(model: list, rank: int, tp: int, total: int) -> Pool:
    """What a same-TP transfer leaves in decode rank ``rank``: its heads in the request's pages."""
    hs = heads_of(rank, tp, total)
    want = Pool.make(item=PAGE_TOKENS * len(hs) * HEAD_BYTES)
    for b in range(BUFFERS):
        view = want.kv[b].reshape(PAGES, PAGE_TOKENS, len(hs), HEAD_BYTES)
        for s, d in zip(SRC, DST):
            view[d] = model[b][s, :, hs.start : hs.stop]
    return want


def expected_ops(ptp: int, dtp: int, total: int) -> tuple:
    """(ops, bytes) of all prefill ranks together, from the heads alone."""
    tokens = len(SRC) * PAGE_TOKENS
    runs = 2
    hp, hd = max(1, total // ptp), max(1, total // dtp)
    ops = nbytes = 0
    for d in range(dtp):
        if hp == hd:
            ops += BUFFERS * runs  # whole rows: one op per run of pages
        elif hd < hp:
            ops += BUFFERS * tokens  # a part of one prefill rank's row, per token
        else:
            ops += (hd // hp) * BUFFERS * tokens  # a part of the decode's row from each source
        nbytes += BUFFERS * tokens * hd * HEAD_BYTES
        pairs = len(prefill_ranks_of(d, dtp, ptp))
        ops += pairs * 2  # the metadata, both aux buffers, from each prefill rank paired
        nbytes += pairs * 2 * AUX_ITEM
    return ops, nbytes


def main() -> None:
    kvbridge.sglang.install()
    for case in sys.argv[1:]:
        try:
            counted = run_case(case)
        except BaseException:  # noqa: BLE001 - reported, and the next case runs
            print(f"FAIL {case} " + json.dumps(traceback.format_exc()), flush=True)
        else:
            print(f"OK {case} " + json.dumps(counted), flush=True)


def run_case(case: str) -> dict:
    fields = case.split(",")
    ptp, dtp, mla, total = int(fields[0]), int(fields[1]), fields[2] == "mla", int(fields[3])
    refuse, bound = "refuse" in fields[4:], "bound" in fields[4:]
    set_env(KVBRIDGE_PEER_ID=None, KVBRIDGE_PEER_KEY=None, KVBRIDGE_PEER_KEYS=None, KVBRIDGE_SGLANG_REQUIRE_BOUND_PREFILL=None)
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class
    from sglang.srt.runtime_context import get_parallel

    cls = {t: get_kv_class(TransferBackend("kvbridge"), t) for t in KVClassType}
    port = free_port()
    addr = f"127.0.0.1:{port}"
    model = model_kv(total)
    if mla:
        ppools = [Pool.make(fill=10 + r) for r in range(ptp)]
        dpools = [Pool.make() for _ in range(dtp)]
    else:
        ppools = [rank_pool(model, r, ptp, total) for r in range(ptp)]
        head_bytes = HEAD_BYTES * 2 if refuse else HEAD_BYTES
        dpools = [Pool.make(item=PAGE_TOKENS * len(heads_of(r, dtp, total)) * head_bytes) for r in range(dtp)]
    with topology(port, tp_size=dtp) as server_args:
        if bound:  # the prefill server's environment, its bootstrap server's too
            set_env(KVBRIDGE_PEER_ID="tp-bound-{role}-r{rank}", KVBRIDGE_PEER_KEY=BOUND_KEY)
        server = cls[KVClassType.BOOTSTRAP_SERVER](host="127.0.0.1", port=port)
        pm, dm = [], []
        for r in range(ptp):
            with get_parallel().override(tp_size=ptp, attn_tp_size=ptp, moe_tp_size=ptp, tp_rank=r, attn_tp_rank=r):
                args = kv_args(ppools[r], rank=r, heads=len(heads_of(r, ptp, total)), total_heads=total)
                pm.append(cls[KVClassType.MANAGER](args, DisaggregationMode.PREFILL, server_args, mla))
        ring = tempfile.NamedTemporaryFile("w", suffix=".keys")
        if bound:  # the decode server's: a keyring naming every prefill rank, and the requirement
            ring.write("".join(f"{m.kvbridge_peer_id} {BOUND_KEY}\n" for m in pm))
            ring.flush()
            set_env(KVBRIDGE_PEER_ID=None, KVBRIDGE_PEER_KEY=None, KVBRIDGE_PEER_KEYS=ring.name)
            set_env(KVBRIDGE_SGLANG_REQUIRE_BOUND_PREFILL="1")
        for r in range(dtp):
            with get_parallel().override(tp_rank=r, attn_tp_rank=r):
                dm.append(cls[KVClassType.MANAGER](kv_args(dpools[r], rank=r), DisaggregationMode.DECODE, server_args, mla))
        set_env(KVBRIDGE_PEER_KEYS=None, KVBRIDGE_SGLANG_REQUIRE_BOUND_PREFILL=None)
        assert all((m.prefill_keys is not None) == bound for m in dm)

        def request(room):
            senders = [cls[KVClassType.SENDER](pm[r], addr, room) for r in range(ptp)]
            receivers = []
            for r in range(dtp):
                with get_parallel().override(tp_rank=r, attn_tp_rank=r):
                    wait_for(lambda: dm[r].try_ensure_parallel_info(addr), 20, "the prefill ranks")
                    rcv = cls[KVClassType.RECEIVER](dm[r], addr, room)
                    rcv.init(0)
                    receivers.append(rcv)
            for r in range(dtp):
                if receivers[r].poll() == KVPoll.Failed:
                    receivers[r].failure_exception()
                receivers[r].send_metadata(np.array(DST, dtype=np.int32), aux_index=2)
            return senders, receivers

        if refuse:
            for room in (77, 78):
                senders, receivers = request(room)
                for r in range(dtp):
                    assert until_done(receivers[r]) == KVPoll.Failed
                    text = failure_text(receivers[r])
                    assert "Incompatible (step layout)" in text and f"of {dtp}" in text and f"of {ptp}" in text, text
                    receivers[r].clear()
                for s in senders:
                    assert until_done(s) == KVPoll.Failed
            refused = [m.stats["layouts_refused"] for m in pm]
            # once per decode rank that registered with it, not once per request
            assert refused == [sum(r in prefill_ranks_of(d, dtp, ptp) for d in range(dtp)) for r in range(ptp)], refused
            counted = {"layouts_refused": refused, "failure": text}
        else:
            senders, receivers = request(77)
            for r in range(ptp):
                wait_for(lambda: senders[r].poll() == KVPoll.WaitingForInput, 20, f"rank {r}'s indices")
                senders[r].init(len(SRC), aux_index=1)
                senders[r].send(np.array(SRC[:2], dtype=np.int32))  # two chunks
                senders[r].send(np.array(SRC[2:], dtype=np.int32))
            for r in range(ptp):
                assert until_done(senders[r]) == KVPoll.Success
            # every prefill rank said Success (and may free its KV): every byte is in place
            for r in range(dtp):
                if mla:
                    for buf in range(BUFFERS):
                        for s, d in zip(SRC, DST):
                            assert dpools[r].page(buf, d) == ppools[0].page(buf, s), (r, buf, s, d)
                else:
                    want = expected_pool(model, r, dtp, total)
                    for buf in range(BUFFERS):
                        assert np.array_equal(dpools[r].kv[buf], want.kv[buf]), (r, buf)
                assert dpools[r].aux_slot(0, 2) == ppools[0].aux_slot(0, 1)
            for r in range(dtp):
                assert until_done(receivers[r]) == KVPoll.Success
                assert dm[r].stats["kv_received"] == 1
                assert 77 not in dm[r]._grants  # closed: no write lands in its pages any more
            counted = {
                "write_ops": sum(m.stats["write_ops"] for m in pm),
                "bytes_sent": sum(m.stats["bytes_sent"] for m in pm),
                "decode_ranks_sent": [m.stats["decode_ranks_sent"] for m in pm],
                "statuses_received": [m.stats["statuses_received"] for m in dm],
            }
            if not mla:
                assert (counted["write_ops"], counted["bytes_sent"]) == expected_ops(ptp, dtp, total), counted
                # every decode rank's outcome: written by each prefill rank SGLang pairs it with
                pairs = [[r for d in range(dtp) if r in prefill_ranks_of(d, dtp, ptp)] for r in range(ptp)]
                assert counted["decode_ranks_sent"] == [len(p) for p in pairs], counted
                assert counted["statuses_received"] == [len(prefill_ranks_of(d, dtp, ptp)) for d in range(dtp)], counted
        if bound:
            counted["unvouched"] = [m.stats["unvouched_lookups"] + m.stats["unbound_prefills"] for m in dm]
            assert counted["unvouched"] == [0] * dtp, counted
        for m in pm + dm:
            m.close()
        server.close()
        ring.close()
    return counted


if __name__ == "__main__":
    main()
