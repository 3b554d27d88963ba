"""Deployment shapes on real vLLM CPU servers: a prefiller and a decoder of TP sizes
(prefiller -> decoder) 2 -> 2, 1 -> 2 and 2 -> 1 behind ``kvbridge proxy --flow vllm``, with
KvbridgeConnector, against single servers on the same tiny Llama (2 KV heads, so TP=2 splits
them).

Two cores hold two vLLM servers, not three, once one runs at TP=2 (the third starves the
others: ../shared/design/cpu-real-engines.md, section 8). So a single TP=1 and a single
TP=2 server answer every prompt first and stop; then each pair starts, answers the same
prompts, and stops. A TP=2 server computes on both cores (``VLLM_CPU_OMP_THREADS_BIND='0|1'``),
a TP=1 server beside it on one, and the health checks and deadlines leave room for a
saturated host.

What equal means: TP=2 sums in another order than TP=1, and this model's wide weights turn
that into logprob differences of tenths between the two single servers (measured in the same
run), with a near tie broken either way. A pair of equal TP sizes must answer bit for bit as
the single server of that size does (its KV is the bytes that server would have computed).
A pair of different sizes must follow the TP=1 server's tokens (or the TP=2 server's where
the two part) with logprobs within the two single servers' largest difference plus 0.05. A
wrong head or block changes the answer by far more. Equal output alone would also pass if
the decoder recomputed the prompt, so the decoder's ``loads_ok`` must grow by one load per
request on every decoder rank, with no ``loads_recomputed`` and no failed load.

Which pairs run: ``KVBRIDGE_VLLM_TP_PAIRS`` (default ``1-2``: the pair CI runs), for example
``2-2,1-2,2-1`` (about 5 minutes a pair here), or with block sizes (prefiller's first)
``1-1@32-64``: blocks of another size are refused (vLLM CPU keeps K transposed inside a
block), each decoder rank's load failing as ``refused`` and the request with an error.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from servers import (
    Proxy,
    VllmServer,
    choice_tokens,
    free_ports,
    free_run,
    http_status,
    kv_cache_usage,
    kvbridge_binary,
    kvbridge_config,
    kvbridge_counters,
    post,
    post_stream,
    prefill,
    tcp_rx_queue,
    wait_healthy,
)
from tiny_model import WORDS, build

BLOCK = 32


@dataclass(frozen=True)
class Shape:
    """A pair's TP sizes and block sizes (tokens), prefiller first."""

    p_tp: int
    d_tp: int
    p_block: int = BLOCK
    d_block: int = BLOCK

    @staticmethod
    def parse(spec: str) -> Shape:
        """``P-D`` or ``P-D@PBLOCK-DBLOCK`` (vLLM CPU takes multiples of 32)."""
        tps, _, blocks = spec.partition("@")
        p_tp, d_tp = (int(x) for x in tps.split("-"))
        p_block, d_block = (int(x) for x in blocks.split("-")) if blocks else (BLOCK, BLOCK)
        return Shape(p_tp, d_tp, p_block, d_block)

    def __str__(self) -> str:
        blocks = f"-blocks{self.p_block}-to-{self.d_block}" if (self.p_block, self.d_block) != (BLOCK, BLOCK) else ""
        return f"tp{self.p_tp}-to-tp{self.d_tp}{blocks}"


PAIRS = [Shape.parse(p) for p in os.environ.get("KVBRIDGE_VLLM_TP_PAIRS", "1-2").split(",")]
MAX_TOKENS = 8
TOP = 5
READ_TIMEOUT_S = 20.0
LEASE_S = 40.0
#: Words (= tokens) of the prompts: one block, two, three and a part, more than four.
WORDS_PER_PROMPT = (20, 60, 90, 150)
CONCURRENT_WORDS = (30, 70, 110, 140)
#: A saturated 2-core host: a TP=2 server's first requests take tens of seconds.
REQUEST_TIMEOUT_S = 300.0


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def request(api: str, prompt: str, stream: bool) -> tuple[str, dict]:
    if api == "completions":
        doc = {"prompt": prompt, "logprobs": TOP}
    else:
        doc = {"messages": [{"role": "user", "content": prompt}], "logprobs": True, "top_logprobs": TOP}
    doc.update(
        model="tiny", max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stream=stream,
        return_tokens_as_token_ids=True,
    )  # fmt: skip
    return f"/v1/{'completions' if api == 'completions' else 'chat/completions'}", doc


def answer(base: str, api: str, prompt: str, stream: bool) -> list[tuple[str, dict[str, float]]]:
    """Each generated token id with its top logprobs (ids as ``token_id:N``)."""
    path, doc = request(api, prompt, stream)
    if stream:
        status, events, raw = post_stream(base + path, doc, timeout=REQUEST_TIMEOUT_S)
        assert status == 200, raw[-2000:]
        choices = [c for e in events for c in e.get("choices", [])]
    else:
        status, body = post(base + path, doc, timeout=REQUEST_TIMEOUT_S)
        assert status == 200, body
        choices = body["choices"]
    out = choice_tokens(api, choices)
    assert len(out) == MAX_TOKENS, out
    return out


def differences(got, want) -> float:
    """The largest difference between the logprobs both answers list, up to the first token
    where they part (the rest follows another context)."""
    worst = 0.0
    for (gt, gtop), (wt, wtop) in zip(got, want):
        for tok in set(gtop) & set(wtop):
            worst = max(worst, abs(gtop[tok] - wtop[tok]))
        if gt != wt:
            break
    return worst


def assert_exactly_equal(got, want, what: str) -> None:
    assert [t for t, _ in got] == [t for t, _ in want], f"{what}: generated tokens differ"
    for i, ((_, g), (_, w)) in enumerate(zip(got, want)):
        assert g == w, f"{what}: token {i}: top logprobs differ: {g} != {w}"


def assert_within_tp_noise(got, tp1, tp2, tol: float, what: str) -> None:
    """``got`` follows the TP=1 server's tokens, or the TP=2 server's where the two part (a
    near tie TP breaks either way), and its logprobs stay within ``tol`` of the TP=1
    server's up to there."""
    for i, ((gt, gtop), (t1, top1), (t2, _)) in enumerate(zip(got, tp1, tp2)):
        assert gt in (t1, t2), f"{what}: token {i}: {gt} is neither server's ({t1}, {t2})"
        for tok in set(gtop) & set(top1):
            assert abs(gtop[tok] - top1[tok]) <= tol, f"{what}: token {i}: {tok}: {gtop[tok]} vs {top1[tok]} (tol {tol})"
        if t1 != t2 or gt != t1:
            return  # past here each answer follows its own context


def cases() -> list[tuple[str, str, bool]]:
    """(name, prompt, streamed) of every request a pair answers one at a time."""
    out = []
    for i, ((api, stream), words) in enumerate(
        zip(itertools.product(("completions", "chat"), (False, True)), itertools.cycle(WORDS_PER_PROMPT))
    ):
        out.append((api, text(100 + i, words), stream))
    return out


def concurrent_prompts() -> list[str]:
    return [text(200 + i, w) for i, w in enumerate(CONCURRENT_WORDS)]


def server_env(tp: int, core: int) -> dict[str, str]:
    """TP=2 computes on both cores; a TP=1 server on one (``core``)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp == 2 else str(core), "VLLM_LOG_STATS_INTERVAL": "1"}


class References:
    """Every prompt's answer from a single TP=1 and a single TP=2 server, and how far apart
    they are: TP changes the order of sums, and this model's wide weights turn that into
    logprob differences of tenths (``tol``: the largest, plus a margin)."""

    MARGIN = 0.05

    def __init__(self, tp1: dict, tp2: dict):
        self.by_tp = {1: tp1, 2: tp2}
        self.noise = max(differences(tp2[k], tp1[k]) for k in tp1)
        self.tol = self.noise + self.MARGIN

    def check(self, got, key, shape: Shape, what: str, batched: bool = False) -> None:
        """A pair of equal TP sizes and the single servers' block size computes what the
        single server of that size computes: equal to it, bit for bit, when it answered
        alone; any other pair (or one in a batch) within TP's noise of the TP=1 server's
        answer."""
        same = shape.p_tp == shape.d_tp and shape.p_block == shape.d_block == BLOCK
        if same and not batched:
            assert_exactly_equal(got, self.by_tp[shape.d_tp][key], what)
        else:
            assert_within_tp_noise(got, self.by_tp[1][key], self.by_tp[2][key], self.tol, what)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    binary = kvbridge_binary()
    if binary is None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)("no kvbridge binary (cargo build -p kvbridge-cli)")
    root = tmp_path_factory.mktemp("tp")
    model = build(root / "model")  # 2 KV heads
    logs = root / "logs"
    logs.mkdir()
    ports = free_ports(2)
    refs = [
        VllmServer(f"reference-tp{tp}", model, port, logs, None, env=server_env(tp, 0),
                   extra_args=["--tensor-parallel-size", str(tp)])  # fmt: skip
        for tp, port in zip((1, 2), ports)
    ]
    answers: list[dict] = [{}, {}]
    try:
        wait_healthy(refs)
        for ref, want in zip(refs, answers):
            for api, prompt, _ in cases():
                want[(api, prompt)] = answer(ref.url, api, prompt, False)
            for prompt in concurrent_prompts():
                want[("completions", prompt)] = answer(ref.url, "completions", prompt, False)
    finally:
        for ref in refs:
            ref.kill()
    references = References(*answers)
    print(f"\nTP=2 and TP=1 single servers differ by up to {references.noise:.3f} in a logprob")
    return binary, model, logs, references


class Pair:
    """A prefiller of TP ``p_tp`` and a decoder of TP ``d_tp`` with KvbridgeConnector, and the
    proxy in front of them. The prefiller's blocks go over the data connection (no
    cross-memory attach), so that a read waits on the prefiller process and a kill lands
    during it; its restart uses the default transport."""

    def __init__(self, binary: Path, model: Path, logs: Path, shape: Shape):
        self.model, self.logs, self.shape = model, logs / str(shape), shape
        self.p_tp, self.d_tp = shape.p_tp, shape.d_tp
        self.logs.mkdir()
        self.p_port, self.d_port = free_ports(2)
        self.kv_port = free_run(shape.p_tp)  # prefiller rank r listens on kv_port + r
        self.procs: list = []
        self.prefiller = self._prefiller("prefiller", {"KVBRIDGE_CMA": "0"})
        dcfg = kvbridge_config(
            "kv_consumer", 0, kvbridge_read_timeout_s=READ_TIMEOUT_S, kvbridge_lease_s=LEASE_S, kvbridge_integrity=True
        )
        self.decoder = self._server("decoder", self.d_port, dcfg, shape.d_tp, core=1, block=shape.d_block)
        self.startup_s = wait_healthy([self.prefiller, self.decoder])
        self.proxy = Proxy(
            binary, [self.p_port], [self.d_port], self.logs,
            "--health-interval", "2", "--health-timeout", "10", "--unhealthy-after", "5",
            "--prefill-timeout", str(REQUEST_TIMEOUT_S), "--decode-timeout", str(REQUEST_TIMEOUT_S),
        )  # fmt: skip
        self.procs.append(self.proxy)
        self.proxy.wait_healthy()

    def _server(
        self, name: str, port: int, ktc: dict, tp: int, core: int, env: dict | None = None, block: int = BLOCK
    ) -> VllmServer:
        s = VllmServer(
            name, self.model, port, self.logs, ktc, env={**server_env(tp, core), **(env or {})},
            block_size=block, extra_args=["--tensor-parallel-size", str(tp)],
        )  # fmt: skip
        self.procs.append(s)
        return s

    def _prefiller(self, name: str, env: dict | None = None) -> VllmServer:
        cfg = kvbridge_config("kv_producer", self.kv_port, kvbridge_lease_s=LEASE_S, kvbridge_integrity=True)
        return self._server(name, self.p_port, cfg, self.p_tp, core=0, env=env, block=self.shape.p_block)

    def restart_prefiller(self) -> float:
        self.prefiller = self._prefiller(f"prefiller-{len(self.procs)}")
        return wait_healthy([self.prefiller])

    def loads(self) -> dict[str, float]:
        return kvbridge_counters(self.decoder.url)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.kill()

    def tails(self) -> str:
        """Each process's warnings and errors (the last 60), then its last lines."""
        out = []
        for p in self.procs:
            text = p.tail(1 << 22)
            flagged = [ln for ln in text.splitlines() if any(w in ln for w in ("WARN", "ERROR", "Error", "kvbridge"))]
            out.append(f"--- {p.name}: flagged\n" + "\n".join(flagged[-60:]) + f"\n--- {p.name}: last lines\n{text[-3000:]}")
        return "\n".join(out)


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def wait_counters(pair: Pair, before: dict, loads: int) -> dict[str, float]:
    """The decoder's counters once ``loads`` loads are counted (they reach /metrics with a
    step's output), or after 20 s."""
    deadline = time.monotonic() + 20
    while True:
        m = moved(before, pair.loads())
        if m.get("vllm:kvbridge_loads_ok_total", 0) >= loads or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


@pytest.mark.parametrize("shape", PAIRS, ids=[str(s) for s in PAIRS])
def test_pair_answers_equal_a_single_server_with_the_kv_loaded_on_every_rank(setup, shape):
    binary, model, logs, refs = setup
    pair = Pair(binary, model, logs, shape)
    p_tp, d_tp = shape.p_tp, shape.d_tp
    try:
        if shape.p_block != shape.d_block:
            blocks_of_another_size_are_refused(pair)
            return
        print(f"\n{shape}: servers healthy in {pair.startup_s:.0f} s")
        for server in (pair.prefiller, pair.decoder):
            assert "whole pages only" not in server.log_path.read_text(errors="replace"), server.name
        before = pair.loads()
        sent = 0
        for api, prompt, stream in cases():
            got = answer(pair.proxy.url, api, prompt, stream)
            refs.check(got, (api, prompt), shape, f"{api} {'streamed' if stream else 'whole'} {len(prompt.split())} words")
            sent += 1
        # four at once
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
            refs.check(got, ("completions", prompt), shape, f"concurrent {i}", batched=True)
        sent += len(threads)
        m = wait_counters(pair, before, sent * d_tp)
        print(f"{shape}: decoder's counters moved: {m}")
        # one load per request on every decoder rank (vLLM sums its workers' counts)
        assert m.get("vllm:kvbridge_loads_ok_total") == sent * d_tp, m
        # each checked against the prefiller's digests, head by head (kvbridge_integrity)
        assert m.get("vllm:kvbridge_loads_checked_total") == sent * d_tp, m
        assert not any("load_failures" in k for k in m), m
        assert not m.get("vllm:kvbridge_loads_recomputed_total"), m
        assert m.get("vllm:kvbridge_bytes_read_total", 0) > 0
        if (p_tp, d_tp) != (1, 1):
            kill_mid_load_then_restart(pair, refs)
    except BaseException:
        print(pair.tails())
        raise
    finally:
        pair.stop()


def blocks_of_another_size_are_refused(pair: Pair) -> None:
    """vLLM CPU keeps K transposed inside a block, so blocks of another size cannot be cut
    into token rows: each decoder rank refuses the prefiller at its first load, by cause,
    naming both block sizes, and the request ends with an error (no garbage answer)."""
    before = pair.loads()
    path, doc = request("completions", text(300, 40), False)
    status, body = post(pair.proxy.url + path, doc, timeout=REQUEST_TIMEOUT_S)
    print(f"{pair.shape}: the decode answered {status}: {str(body)[:200]}")
    assert status >= 400, body
    m = wait_counters(pair, before, 0)
    deadline = time.monotonic() + 20
    while m.get("vllm:kvbridge_load_failures_total[refused]", 0) < pair.d_tp and time.monotonic() < deadline:
        time.sleep(0.2)
        m = moved(before, pair.loads())
    assert m.get("vllm:kvbridge_load_failures_total[refused]") == pair.d_tp, m
    log = pair.decoder.log_path.read_text(errors="replace")
    assert f"its blocks hold {pair.shape.p_block} tokens, this rank's {pair.shape.d_block}" in log


def proxy_admits(pair: Pair) -> bool:
    """A one-token request through the proxy does not find every prefiller ejected."""
    path, doc = request("completions", "the cat", False)
    status, body = post(pair.proxy.url + path, dict(doc, max_tokens=1, logprobs=None), timeout=REQUEST_TIMEOUT_S)
    return not (status == 503 and "no_healthy_worker" in str(body))


def kill_mid_load_then_restart(pair: Pair, refs: References) -> None:
    """SIGKILL the prefiller's process group while a decoder's read of its blocks is in
    flight: the request ends with an error within the read deadline (on every decoder rank),
    the decoder frees its blocks and answers again once a new prefiller is up."""
    api, prompt, _ = cases()[2]
    path, doc = request(api, prompt, False)
    params = prefill(pair.prefiller.url, path, doc, REQUEST_TIMEOUT_S)
    assert params.get("tp_size") == pair.p_tp, params
    pair.prefiller.signal(signal.SIGSTOP)
    kv_ports = [pair.kv_port + r for r in range(pair.p_tp)]
    queued = {p: tcp_rx_queue(p) for p in kv_ports}
    before = pair.loads()
    result: dict = {}

    def decode() -> None:
        result["answer"] = post(pair.decoder.url + path, dict(doc, kv_transfer_params=params), timeout=REQUEST_TIMEOUT_S)
        result["at"] = time.monotonic()

    t = threading.Thread(target=decode, daemon=True)
    t.start()
    deadline = time.monotonic() + 120
    while all(tcp_rx_queue(p) <= queued[p] for p in kv_ports):
        assert t.is_alive(), f"the decode ended before any read reached the stopped prefiller: {result}"
        assert time.monotonic() < deadline, "the decoder never sent the prefiller its read"
        time.sleep(0.05)
    pair.prefiller.signal(signal.SIGKILL)
    killed = time.monotonic()
    t.join(READ_TIMEOUT_S + 60)
    assert not t.is_alive(), "the decode request hangs after its prefiller died"
    status, body = result["answer"]
    took = result["at"] - killed
    print(f"TP {pair.p_tp} -> {pair.d_tp}: prefiller killed mid-read, decoder answered {status} after {took:.1f} s")
    failed = status >= 400 or any(c.get("finish_reason") == "error" for c in body.get("choices", []))
    assert failed, f"a request whose KV never arrived was answered as a success: {body}"
    assert took < READ_TIMEOUT_S + 10
    m = wait_counters(pair, before, 0)
    deadline = time.monotonic() + 20
    while sum(v for k, v in m.items() if "load_failures" in k) < pair.d_tp and time.monotonic() < deadline:
        time.sleep(0.2)
        m = moved(before, pair.loads())
    print(f"decoder's counters moved: {m}")
    # every decoder rank's load ended, failed (a rank that read from no killed rank would
    # not exist here: every rank reads from the prefiller)
    assert sum(v for k, v in m.items() if "load_failures" in k) == pair.d_tp, m
    assert not m.get("vllm:kvbridge_loads_ok_total"), m
    assert http_status(f"{pair.decoder.url}/health") == 200
    deadline = time.monotonic() + 30
    while kv_cache_usage(pair.decoder.url) > 0:
        assert time.monotonic() < deadline, "the decoder keeps the failed request's blocks"
        time.sleep(0.2)
    started = pair.restart_prefiller()
    print(f"new prefiller healthy in {started:.0f} s")
    # the proxy ejected the dead prefiller; it takes the new one back at a health check
    deadline = time.monotonic() + 60
    while http_status(f"{pair.proxy.url}/health") != 200 or not proxy_admits(pair):
        assert time.monotonic() < deadline, "the proxy never took the restarted prefiller back"
        time.sleep(0.5)
    api, prompt, stream = cases()[3]
    refs.check(answer(pair.proxy.url, api, prompt, stream), (api, prompt), pair.shape, "after restart")
