"""MLA on real vLLM CPU servers: a prefiller and a decoder with KvbridgeConnector behind
``kvbridge proxy --flow vllm``, on a tiny DeepSeek-V2-shaped model made at test time
(tiny_model.build_mla: 2 heads, the 576-wide latent vLLM CPU's MLA backend serves, random
wide weights), against a single server.

vLLM CPU's MLA (``CPU_MLA``) keeps one latent per token, ``[blocks, 1, 16, 576]`` per layer
(blocks of 16 tokens, forced), the same on every TP rank. So a decoder rank reads each block
of the prompt once, from one prefiller rank, whatever the two TP sizes: the decoder's
``bytes_read`` must be exactly one copy of the prompt's blocks per decoder rank, never one
per prefiller rank.

Which pairs run: ``KVBRIDGE_VLLM_MLA_PAIRS`` (prefiller TP first; default ``1-1``, one pair
small enough for CI), e.g. ``1-1,2-1,1-2,2-2``. A TP=2 server computes on both cores
(``VLLM_CPU_OMP_THREADS_BIND='0|1'``), as in test_tp_pairs.py, whose request helpers this
reuses. The single servers answer every prompt first, one at a time, and stop before a pair
starts.

What equal means. vLLM CPU 0.32's MLA does not reproduce its own answers, on a single
server without any connector (measured, 1 layer, fp32, docs/results/vllm-mla-*.txt):

- its prefill (``CPU_SDPA_MLA``) and a decode step (``mla_decode_kvcache``) give a prompt's
  next token differently: another top token on 7 of 8 prompts at TP=1;
- its own answer parts from the same tokens computed one decode step at a time, a few tokens
  in, by 0.1 to 2 in a logprob or in the token, on 11 of 13 prompts;
- the same decode step sent 4 at once parts from it sent alone, by up to 10 in a logprob.

A P/D decoder takes a loaded prompt's first token from a decode step (vLLM recomputes the
last prompt token), so no pair equals a single server's answer bit for bit, and whatever
follows the first token is vLLM's own arithmetic, not the transfer's. What the transfer
decides is the first token: every row of the prompt's cache is attended to compute it. So
the single server answers each prompt as a decoder computes that token: the prompt less its
last token, that token forced (``logit_bias``), and the next token's raw logprobs (vLLM's
default ``raw_logprobs``). Each request answered alone must give that first token with the
same top-5 logprobs, bit for bit (fp32 and one layer: the cache holds only what the
embedding and ``kv_a_proj_with_mqa`` give, the same whichever way and at whichever TP size
vLLM computed the prompt; a pair of different TP sizes answers as the single server of the
decoder's TP). Its later tokens and the four sent at once are logged against the single
server's answers, not compared.

Equal output alone would pass if the decoder recomputed the prompt, so the decoder's
``loads_ok`` must grow by exactly requests x decoder ranks, each load checked against the
prefiller's digests, with no ``loads_recomputed`` and no failure; and ``bytes_read`` must be
one copy of each prompt's blocks per decoder rank.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import pytest

from servers import VllmServer, free_ports, kvbridge_binary, post, wait_healthy
from test_tp_pairs import (
    MAX_TOKENS,
    REQUEST_TIMEOUT_S,
    TOP,
    Pair,
    Shape,
    answer,
    cases,
    concurrent_prompts,
    request,
    server_env,
    wait_counters,
)
from tiny_model import MLA_KV_LORA_RANK, MLA_ROPE_DIM, build_mla

#: vLLM CPU's MLA forces blocks of 16 tokens (the platform overrides --block-size).
MLA_BLOCK = 16
#: One layer: the cache is what the embedding and kv_a_proj_with_mqa give (module docs).
LAYERS = 1
#: One token's latent, bytes (fp32).
LATENT_BYTES = (MLA_KV_LORA_RANK + MLA_ROPE_DIM) * 4

PAIRS = [Shape.parse(f"{p}@{MLA_BLOCK}-{MLA_BLOCK}") for p in os.environ.get("KVBRIDGE_VLLM_MLA_PAIRS", "1-1").split(",")]


def one_copy(prompt_tokens: int, layers: int = LAYERS) -> int:
    """The bytes of one copy of a prompt's KV as a decoder rank reads it: whole blocks of
    the prompt, every layer."""
    return layers * -(-prompt_tokens // MLA_BLOCK) * MLA_BLOCK * LATENT_BYTES


def prompt_tokens(base: str, api: str, prompt: str) -> int:
    """What vLLM counts in the prompt (chat: with its template), from a one-token answer."""
    path, doc = request(api, prompt, False)
    status, body = post(base + path, dict(doc, max_tokens=1), timeout=REQUEST_TIMEOUT_S)
    assert status == 200, body
    return int(body["usage"]["prompt_tokens"])


#: vLLM CPU's reference MLA backend, named (on a host with AMX tiles vLLM would take AMX_MLA,
#: another cache layout, which this does not test), in fp32 (the module's docs).
BACKEND = ["--attention-backend", "CPU_MLA", "--dtype", "float32"]


class MlaPair(Pair):
    """test_tp_pairs' pair, its servers on vLLM CPU's MLA backend."""

    def _server(self, name, port, ktc, tp, core, env=None, block=MLA_BLOCK) -> VllmServer:
        s = VllmServer(
            name, self.model, port, self.logs, ktc, env={**server_env(tp, core), **(env or {})},
            block_size=block, extra_args=["--tensor-parallel-size", str(tp), *BACKEND],
        )  # fmt: skip
        self.procs.append(s)
        return s


def prompt_ids(base: str, api: str, prompt: str) -> list[int]:
    """The prompt's token ids as vLLM serves them (chat: with its template)."""
    if api == "completions":
        doc = {"model": "tiny", "prompt": prompt}
    else:
        doc = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "add_generation_prompt": True}
    status, body = post(base + "/tokenize", doc)
    assert status == 200, body
    return list(body["tokens"])


def decode_step(base: str, ids: list[int]) -> tuple[str, dict[str, float]]:
    """The token after ``ids`` and its top logprobs as a decode step computes them: the
    prompt less its last token, that token forced, the next one's raw logprobs."""
    doc = {
        "model": "tiny", "prompt": ids[:-1], "max_tokens": 2, "temperature": 0, "ignore_eos": True,
        "logprobs": TOP, "logit_bias": {str(ids[-1]): 100}, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    status, body = post(base + "/v1/completions", doc, timeout=REQUEST_TIMEOUT_S)
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"][0] == f"token_id:{ids[-1]}", f"the forced token did not come: {lp['tokens']}"
    # the top TOP (vLLM adds the token it sampled, the forced one again, when outside them)
    top = dict(sorted(lp["top_logprobs"][1].items(), key=lambda kv: -kv[1])[:TOP])
    return max(top, key=top.get), top


def worst(a: dict, b: dict) -> float:
    """The largest difference of a top logprob both list (inf: none in common)."""
    return max((abs(a[t] - b[t]) for t in set(a) & set(b)), default=float("inf"))


def decode_steps(base: str, ids: list[int]) -> list[tuple[str, dict[str, float]]]:
    """The answer a P/D decoder computes for prompt ``ids``, one decode step at a time on a
    single server: each token and its top logprobs (:func:`decode_step`), greedy."""
    out: list[tuple[str, dict[str, float]]] = []
    ctx = list(ids)
    for _ in range(MAX_TOKENS):
        tok, top = decode_step(base, ctx)
        out.append((tok, top))
        ctx.append(int(tok.split(":", 1)[1]))
    return out


@dataclass
class Reference:
    steps: list  # the single server's decode steps (what the decoder must answer)
    answer: list  # the single server's own answer (its first token from its prefill)
    tokens: int  # the prompt's length


def single_server_answers(model, logs, tp: int) -> dict:
    """Every prompt's :class:`Reference` from one single server of TP ``tp``; the server
    stops before this returns."""
    (port,) = free_ports(1)
    ref = VllmServer(f"reference-mla-tp{tp}", model, port, logs, None, env=server_env(tp, 0),
                     block_size=MLA_BLOCK, extra_args=["--tensor-parallel-size", str(tp), *BACKEND])  # fmt: skip
    out: dict = {}
    try:
        took = wait_healthy([ref])
        print(f"\nsingle MLA server TP={tp} healthy in {took:.0f} s")
        log = ref.log_path.read_text(errors="replace")
        assert "Using CPU_MLA backend" in log, "the single server does not run vLLM CPU's MLA backend"
        keys = [(api, prompt) for api, prompt, _ in cases()] + [("completions", p) for p in concurrent_prompts()]
        for api, prompt in keys:
            ids = prompt_ids(ref.url, api, prompt)
            assert prompt_tokens(ref.url, api, prompt) == len(ids)
            out[(api, prompt)] = Reference(decode_steps(ref.url, ids), answer(ref.url, api, prompt, False), len(ids))
    finally:
        ref.kill()
    parted = sum(r.answer[0][0] != r.steps[0][0] for r in out.values())
    print(f"single MLA server TP={tp}: its prefill and its decode step pick different first tokens on {parted} of "
          f"{len(out)} prompts, and differ by up to "
          f"{max(worst(r.answer[0][1], r.steps[0][1]) for r in out.values()):.3f} in a top-5 logprob both list "
          "(inf: one with none in common)")  # fmt: skip
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    binary = kvbridge_binary()
    if binary is None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)("no kvbridge binary (cargo build -p kvbridge-cli)")
    root = tmp_path_factory.mktemp("mla")
    logs = root / "logs"
    logs.mkdir()
    model = build_mla(root / "model", layers=LAYERS)
    refs = {tp: single_server_answers(model, logs, tp) for tp in sorted({s.d_tp for s in PAIRS})}
    for r in refs.values():
        assert max(x.tokens for x in r.values()) > 4 * MLA_BLOCK, "no prompt longer than 4 blocks"
    return binary, model, logs, refs


def compare(got, ref: Reference, what: str) -> str | None:
    """The module's docs' check: the first failure, or None."""
    (gt, g), (wt, w) = got[0], ref.steps[0]
    if (gt, g) != (wt, w):
        return f"{what}: the first token {gt} {g} is not the single server's decode step's {wt} {w}"
    return None


def describe_difference(got, ref: Reference) -> str:
    """For the log: against the single server's decode steps, and its own answer."""
    rows = []
    for name, want in (("its decode steps", ref.steps), ("its own answer", ref.answer)):
        same = [t for t, _ in got] == [t for t, _ in want]
        d = max(worst(g, w) for (_, g), (_, w) in zip(got, want))
        rows.append(f"tokens {'equal' if same else 'differ from'} {name}, logprobs within {d:.4f}")
    return "; ".join(rows)


@pytest.mark.parametrize("shape", PAIRS, ids=[f"mla-tp{s.p_tp}-to-tp{s.d_tp}" for s in PAIRS])
def test_mla_pair_equals_a_single_server_reading_one_copy_of_the_kv(setup, shape):
    binary, model, logs, refs = setup
    want = refs[shape.d_tp]
    t0 = time.monotonic()
    pair = MlaPair(binary, model, logs, shape)
    try:
        print(f"\nMLA {shape}: servers healthy in {pair.startup_s:.0f} s")
        for server in (pair.prefiller, pair.decoder):
            log = server.log_path.read_text(errors="replace")
            assert "Using CPU_MLA backend" in log, server.name
            # the cache is described as MLA (read once, from one rank), not as whole pages
            assert "whole pages only" not in log, server.name
            assert '"mla": true' in log, server.name
        before = pair.loads()
        sent, want_bytes = 0, 0
        unequal: list[str | None] = []  # every answer is compared before the first failure
        for api, prompt, stream in cases():
            got = answer(pair.proxy.url, api, prompt, stream)
            ref = want[(api, prompt)]
            what = f"{api} {'streamed' if stream else 'whole'} {ref.tokens} tokens"
            print(f"  {what}: {describe_difference(got, ref)}")
            unequal.append(compare(got, ref, what))
            sent += 1
            want_bytes += one_copy(ref.tokens)
        results: dict[int, object] = {}

        def send(i: int, prompt: str) -> None:
            try:
                results[i] = answer(pair.proxy.url, "completions", prompt, False)
            except BaseException as e:  # noqa: BLE001 - reported below
                results[i] = e

        threads = [threading.Thread(target=send, args=(i, p), daemon=True) for i, p in enumerate(concurrent_prompts())]
        for t in threads:
            t.start()
        for t in threads:
            t.join(REQUEST_TIMEOUT_S + 30)
        assert not any(t.is_alive() for t in threads), "a concurrent request hangs"
        for i, prompt in enumerate(concurrent_prompts()):
            got = results[i]
            assert not isinstance(got, BaseException), got
            ref = want[("completions", prompt)]
            print(f"  concurrent {i} {ref.tokens} tokens (not compared): {describe_difference(got, ref)}")
            want_bytes += one_copy(ref.tokens)
        sent += len(threads)
        m = wait_counters(pair, before, sent * shape.d_tp)
        print(f"MLA {shape}: {sent} requests, {MAX_TOKENS} tokens each, decoder's counters moved: {m}")
        assert not any(unequal), "\n".join(u for u in unequal if u)
        # one load per request on every decoder rank (vLLM sums its workers' counts), each
        # checked against the prefiller's digests
        assert m.get("vllm:kvbridge_loads_ok_total") == sent * shape.d_tp, m
        assert m.get("vllm:kvbridge_loads_checked_total") == sent * shape.d_tp, m
        assert not any("load_failures" in k for k in m), m
        assert not m.get("vllm:kvbridge_loads_recomputed_total"), m
        # one copy of each prompt's KV per decoder rank, whatever the prefiller's TP
        assert m.get("vllm:kvbridge_bytes_read_total") == shape.d_tp * want_bytes, (
            f"read {m.get('vllm:kvbridge_bytes_read_total')} bytes, one copy per decoder rank is "
            f"{shape.d_tp * want_bytes}: {m}"
        )
        print(f"MLA {shape}: passed in {time.monotonic() - t0:.0f} s (pair start included)")
    except BaseException:
        print(pair.tails())
        raise
    finally:
        pair.stop()
