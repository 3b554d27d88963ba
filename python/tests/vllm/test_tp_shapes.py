"""Deployment shapes with real kvbridge channels: every TP rank of a prefiller and of a
decoder is its own worker, as vLLM runs them, and each decoder rank's blocks must end up
holding exactly its heads of the prompt's tokens, read from the prefiller ranks that hold
them: TP 2 -> 2, 1 -> 2, 2 -> 1, 1 -> 4, and MLA (read once, from one rank); blocks of
another size are refused (vLLM CPU keeps K transposed inside a block). A prefiller rank frees a request's blocks
only when every decoder rank that reads from it is done."""

from __future__ import annotations

import random
import socket
import time

import pytest
import torch

from kvbridge.vllm.metadata import KvbridgeConnectorMetadata, RecvJob

from vllm_helpers import LAYERS, NUM_BLOCKS, poll
from vllm_helpers import granted_meta, recv_job  # noqa: E402

HEADS, HEAD_SIZE, LATENT = 4, 32, 48


def free_ports(n: int) -> int:
    """A base port with ``n`` free ports from it (below the ephemeral range, as the soak's)."""
    for _ in range(200):
        base = random.randrange(20000, 30000)
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} free ports in a row")


def tokens_kv(n_tokens: int, seed: int, mla: bool) -> dict[str, torch.Tensor]:
    """The prompt's KV by token, per layer: [tokens, heads, 2 * head_size] (MLA: [tokens, latent])."""
    g = torch.Generator().manual_seed(seed)
    shape = (n_tokens, LATENT) if mla else (n_tokens, HEADS, 2 * HEAD_SIZE)
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name in LAYERS}


def heads_of(rank: int, tp: int) -> slice:
    per = max(1, HEADS // tp)
    first = rank * per if tp <= HEADS else rank * HEADS // tp
    return slice(first, first + per)


def readers(p_rank: int, p_tp: int, d_tp: int) -> set[int]:
    """The decoder ranks whose heads prefiller rank ``p_rank`` holds."""
    mine = heads_of(p_rank, p_tp)
    return {d for d in range(d_tp) if set(range(mine.start, mine.stop)) & set(range(*heads_of(d, d_tp).indices(HEADS)))}


def rank_cache(kv, rank, tp, block, blocks, mla):
    """One rank's KV cache with the prompt's tokens in ``blocks`` (vLLM CPU's layout; MLA's
    as vLLM 0.32 registers it: its [blocks, heads, tokens, content] view, one head)."""
    out = {}
    for name, t in kv.items():
        if mla:
            cache = torch.zeros((NUM_BLOCKS * 2, 1, block, LATENT), dtype=torch.bfloat16)
        else:
            h = heads_of(rank, tp)
            cache = torch.zeros((NUM_BLOCKS * 2, h.stop - h.start, block, 2 * HEAD_SIZE), dtype=torch.bfloat16)
        for i in range(t.shape[0]):
            b, row = blocks[i // block], i % block
            if mla:
                cache[b, 0, row] = t[i]
            else:
                cache[b, :, row] = t[i, heads_of(rank, tp)]
        out[name] = cache
    return out


def blank(rank, tp, block, mla):
    return rank_cache({name: torch.zeros((0, 1)) for name in LAYERS}, rank, tp, block, [], mla)


SHAPES = {
    # id: (prefiller TP, decoder TP, prefiller block, decoder block, MLA)
    "tp2-to-tp2": (2, 2, 32, 32, False),
    "tp1-to-tp2": (1, 2, 32, 32, False),
    "tp2-to-tp1": (2, 1, 32, 32, False),
    "tp1-to-tp4": (1, 4, 32, 32, False),
    "mla-tp2-to-tp1": (2, 1, 32, 32, True),
    "mla-tp1-to-tp2": (1, 2, 32, 32, True),
    "mla-tp2-to-tp2": (2, 2, 32, 32, True),
}


@pytest.mark.parametrize("read_grants", [False, True], ids=["open", "read-grants"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_decoder_rank_gets_exactly_its_heads_and_every_prefiller_rank_frees(workers, shape, read_grants):
    # read_grants: each prefiller rank opens only the request's blocks to its grant
    # (read_grants.py), and every decoder rank reads them under it
    p_tp, d_tp, p_block, d_block, mla = SHAPES[shape]
    n_tokens = 3 * d_block + 5
    kv = tokens_kv(n_tokens, seed=len(shape), mla=mla)
    src = [9, 2, 30, 31, 4, 17, 8, 5, 6, 7][: -(-n_tokens // p_block)]
    dst = [3, 12, 13, 1]  # four decoder blocks, the middle two adjacent
    base = free_ports(p_tp)
    facts = dict(total_kv_heads=1 if mla else HEADS, head_size=LATENT if mla else HEAD_SIZE, mla=mla)
    prefillers = [
        workers(
            "kv_producer", rank_cache(kv, r, p_tp, p_block, src, mla), tp_rank=r, engine_id="P", tp_size=p_tp,
            block_size=p_block, extra={"kvbridge_port": base, "kvbridge_read_grants": read_grants}, **facts,
        )  # fmt: skip
        for r in range(p_tp)
    ]
    decoders = [
        workers("kv_consumer", blank(r, d_tp, d_block, mla), tp_rank=r, engine_id="D", tp_size=d_tp,
                block_size=d_block, **facts)  # fmt: skip
        for r in range(d_tp)
    ]
    for p in prefillers:
        assert p.layout.tp is not None, p.layout.why_not
        p.start_load_kv(granted_meta(reqs_to_send={"p-1": 30.0}, hold_blocks={"p-1": src}))
    job = recv_job(dst, src, "P", "p-1", "127.0.0.1", base, remote_tp_size=p_tp, prompt_tokens=n_tokens)
    for i, d in enumerate(decoders):
        d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job}))
        if i == 0 and d_tp > 1:
            # a prefiller rank that another decoder rank still reads from keeps the blocks
            poll(d, want_recving={"d-1"})
            for p in prefillers:
                if mla or readers(p.tp_rank, p_tp, d_tp) == {0}:
                    continue
                sending, _ = p.get_finished(set())
                assert not sending, f"prefiller rank {p.tp_rank} freed before every reader was done"
    for d in decoders:
        if d.tp_rank > 0 or d_tp == 1:
            poll(d, want_recving={"d-1"})
        assert d.take_failed_recving() == set(), d.stats
        assert d.stats["loads_ok"] == 1
        want = rank_cache(kv, d.tp_rank, d_tp, d_block, dst, mla)
        for name in LAYERS:
            assert torch.equal(d._tensors[LAYERS.index(name)], want[name]), (shape, d.tp_rank, name)
        per_token = (LATENT if mla else (heads_of(d.tp_rank, d_tp).stop - heads_of(d.tp_rank, d_tp).start)
                     * 2 * HEAD_SIZE) * 2  # fmt: skip
        # whole decoder blocks where the prefiller's blocks reach: never more than 4 blocks
        assert n_tokens * per_token * len(LAYERS) <= d.stats["bytes_read"] <= 4 * d_block * per_token * len(LAYERS)
    for p in prefillers:
        sending, _ = poll(p, want_sending={"p-1"})
        assert p.stats["blocks_freed_on_notify"] == 1 and p.stats["leases_expired"] == 0, (p.tp_rank, p.stats)
        if read_grants:
            assert len(p._read_grants) == 0 and p.channel.stats()["access_denied"] == 0, p.channel.stats()


def test_mla_reads_each_block_once_from_one_prefiller_rank(workers):
    """Pure MLA: the latent is the same on every prefiller rank, so a decoder rank reads it
    once, not once per prefiller rank (bytes read = the prompt's blocks, once)."""
    kv = tokens_kv(64, seed=3, mla=True)
    base = free_ports(2)
    facts = dict(total_kv_heads=1, head_size=LATENT, mla=True)
    ps = [workers("kv_producer", rank_cache(kv, r, 2, 32, [4, 5], True), tp_rank=r, engine_id="P", tp_size=2,
                  extra={"kvbridge_port": base}, **facts) for r in range(2)]  # fmt: skip
    d = workers("kv_consumer", blank(0, 1, 32, True), engine_id="D", **facts)
    assert d.layout.tp is not None, d.layout.why_not  # translated, not whole pages
    for p in ps:
        p.start_load_kv(granted_meta(reqs_to_send={"p-1": 30.0}, blocks=2 * NUM_BLOCKS))
    job = recv_job([1, 2], [4, 5], "P", "p-1", "127.0.0.1", base, remote_tp_size=2, prompt_tokens=64)
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job}))
    poll(d, want_recving={"d-1"})
    assert d.stats["loads_ok"] == 1 and d.stats["bytes_read"] == 64 * LATENT * 2 * len(LAYERS)
    # both prefiller ranks free on notice: the one nobody read from is told too
    for p in ps:
        poll(p, want_sending={"p-1"})
        assert p.stats["blocks_freed_on_notify"] == 1


def test_a_tp_size_in_kv_transfer_params_that_the_prefiller_does_not_have_fails_typed(workers):
    kv = tokens_kv(32, seed=4, mla=False)
    base = free_ports(2)
    p = workers("kv_producer", rank_cache(kv, 0, 1, 32, [1], False), engine_id="P", extra={"kvbridge_port": base},
                total_kv_heads=HEADS)  # fmt: skip
    d = workers("kv_consumer", blank(0, 1, 32, False), engine_id="D", total_kv_heads=HEADS)
    p.start_load_kv(granted_meta(reqs_to_send={"p-1": 30.0}, blocks=2 * NUM_BLOCKS))
    # the params claim TP 2: this rank of the decoder reads heads from rank 0 and rank 1;
    # rank 0 says it is rank 0 of 1
    job = recv_job([2], [1], "P", "p-1", "127.0.0.1", base, remote_tp_size=2, prompt_tokens=32)
    d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job}))
    poll(d, want_recving={"d-1"})
    assert d.take_failed_recving() == {"d-1"}
    assert d.stats["loads_failed_bad_params"] == 1


def test_a_decoder_rank_that_fails_still_counts_and_the_prefiller_frees_when_all_said_done(workers):
    """TP 1 -> 2: the prefiller waits for both decoder ranks; one whose load fails (blocks out
    of range) still says done, so the blocks are freed by notice, not by the lease."""
    kv = tokens_kv(32, seed=5, mla=False)
    base = free_ports(1)
    p = workers("kv_producer", rank_cache(kv, 0, 1, 32, [1], False), engine_id="P", extra={"kvbridge_port": base},
                total_kv_heads=HEADS)  # fmt: skip
    ds = [workers("kv_consumer", blank(r, 2, 32, False), tp_rank=r, engine_id="D", tp_size=2, total_kv_heads=HEADS)
          for r in range(2)]  # fmt: skip
    p.start_load_kv(granted_meta(reqs_to_send={"p-1": 30.0}, blocks=2 * NUM_BLOCKS))
    good = recv_job([2], [1], "P", "p-1", "127.0.0.1", base, prompt_tokens=32)
    bad = recv_job([2], [10_000], "P", "p-1", "127.0.0.1", base, prompt_tokens=32)
    ds[0].start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": good}))
    ds[1].start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": bad}))
    for d in ds:
        poll(d, want_recving={"d-1"})
    assert ds[0].take_failed_recving() == set() and ds[1].take_failed_recving() == {"d-1"}
    t0 = time.monotonic()
    poll(p, want_sending={"p-1"})
    assert time.monotonic() - t0 < 5 and p.stats["blocks_freed_on_notify"] == 1


# (prefiller TP, decoder TP, reads per layer for 4 blocks adjacent on both sides): the same
# heads on both sides read the run as one range; a part of the other side's heads (1->2: half
# of each prefiller block; 2->1: half of each decoder block, from each prefiller rank) is one
# range per block
@pytest.mark.parametrize("p_tp,d_tp,per_layer", [(1, 1, 1), (1, 2, 4), (2, 1, 8)])
def test_reads_are_one_range_per_run_of_blocks_per_prefiller_rank_and_layer(workers, p_tp, d_tp, per_layer):
    """No read per head or per token: vLLM CPU's heads-outermost blocks take one range per
    block (adjacent blocks on both sides merged) from each prefiller rank, for each layer."""
    kv = tokens_kv(4 * 32, seed=6, mla=False)
    src, dst = [4, 5, 6, 7], [8, 9, 10, 11]  # adjacent on both sides: one run
    base = free_ports(p_tp)
    ps = [workers("kv_producer", rank_cache(kv, r, p_tp, 32, src, False), tp_rank=r, engine_id="P", tp_size=p_tp,
                  extra={"kvbridge_port": base}, total_kv_heads=HEADS) for r in range(p_tp)]  # fmt: skip
    ds = [workers("kv_consumer", blank(r, d_tp, 32, False), tp_rank=r, engine_id="D", tp_size=d_tp,
                  total_kv_heads=HEADS) for r in range(d_tp)]  # fmt: skip
    for p in ps:
        p.start_load_kv(granted_meta(reqs_to_send={"p-1": 30.0}, blocks=2 * NUM_BLOCKS))
    job = recv_job(dst, src, "P", "p-1", "127.0.0.1", base, remote_tp_size=p_tp, prompt_tokens=4 * 32)
    for d in ds:
        d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={"d-1": job}))
        poll(d, want_recving={"d-1"})
        assert d.stats["read_ops"] == per_layer * len(LAYERS), d.stats


@pytest.mark.parametrize("p_block", [16, 64])
def test_blocks_of_another_size_are_refused_once_naming_both(workers, p_block, caplog):
    """vLLM CPU's attention keeps K transposed inside a block, so a block's tokens are not rows
    a ranged read can cut: a prefiller with other blocks is refused at the first handshake
    (typed, counted, logged once), and its blocks are freed on the decoder's notice."""
    kv = tokens_kv(64, seed=7, mla=False)
    base = free_ports(1)
    p = workers("kv_producer", rank_cache(kv, 0, 1, p_block, list(range(64 // p_block)), False), engine_id="P",
                block_size=p_block, extra={"kvbridge_port": base}, total_kv_heads=HEADS)  # fmt: skip
    d = workers("kv_consumer", blank(0, 1, 32, False), engine_id="D", total_kv_heads=HEADS)
    for i in (1, 2):
        p.start_load_kv(granted_meta(reqs_to_send={f"p-{i}": 30.0}, blocks=2 * NUM_BLOCKS))
        job = recv_job([1, 2], list(range(64 // p_block)), "P", f"p-{i}", "127.0.0.1", base, prompt_tokens=64)
        d.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={f"d-{i}": job}))
        poll(d, want_recving={f"d-{i}"})
        assert d.take_failed_recving() == {f"d-{i}"}
        poll(p, want_sending={f"p-{i}"})
    assert d.stats["loads_failed_refused"] == 2 and p.stats["blocks_freed_on_notify"] == 2
    refusals = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "incompatible" in r.getMessage()]
    assert len(refusals) == 1 and f"hold {p_block} tokens, this rank's 32" in refusals[0], refusals
