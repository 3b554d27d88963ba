"""1P1D with real vLLM CPU servers: a prefiller and a decoder with ``KvbridgeConnector`` behind
``kvbridge proxy --flow vllm``, against a single colocated server on the same model and seed.

The model is a tiny Llama with random weights made locally (tiny_model.py). Its weights are
drawn wide, so every token's top logprobs depend sharply on the whole context: equal text
and logprobs mean the decoder attended to the prefiller's KV as the single server attended to
its own. The servers start once per module (on 2 busy cores, about 1-3 minutes together).
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from servers import (
    Proxy,
    VllmServer,
    choice_tokens,
    free_ports,
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

#: kvbridge's transport between the prefiller and the decoder behind the proxy: the engine's
#: default, or ``KVBRIDGE_E2E_TRANSPORT`` (``ucx``: UCX over its same-user transports, the
#: kill test's victim staying on TCP, which the decoder then falls back to).
TRANSPORT = os.environ.get("KVBRIDGE_E2E_TRANSPORT") or None
PAIR_ENV = {"UCX_TLS": "posix,cma,self"} if TRANSPORT == "ucx" else {}
#: ``KVBRIDGE_E2E_READ_GRANTS=1``: the prefillers confine reads to each request's grant
#: (``kvbridge_read_grants``); the decoder's reads then go over TCP under the grant.
READ_GRANTS = os.environ.get("KVBRIDGE_E2E_READ_GRANTS") == "1"

#: The decoder's read deadline and the prefiller's lease in these tests (seconds).
READ_TIMEOUT_S = 10.0
LEASE_S = 15.0
#: The proxy checks every worker this often and ejects one after this many failures in a row.
HEALTH_INTERVAL_S = 0.5
UNHEALTHY_AFTER = 2
MAX_TOKENS = 10
TOP = 4


def prompt(seed: int, words: int = 90) -> str:
    """A prompt of ``words`` tokens (three 32-token blocks and a partial one)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.model = build(root / "model")
        self.logs = root / "logs"
        self.logs.mkdir()
        self.ref_port, self.p_port, self.d_port, self.kv_port, self.v_port, self.v_kv_port = free_ports(6)
        self.procs: list = []
        self.ref = self._server("reference", self.ref_port, None)
        self.prefiller = self._prefiller("prefiller", self.p_port, self.kv_port, PAIR_ENV, TRANSPORT)
        # A second prefiller, not behind the proxy, for the kill test. Its blocks go over the
        # data connection (no cross-memory attach), so a decoder's read waits on the
        # prefiller process and can be caught in flight when it is killed.
        self.victim = self._prefiller("victim", self.v_port, self.v_kv_port, {"KVBRIDGE_CMA": "0"})
        self.decoder = self._server(
            "decoder",
            self.d_port,
            kvbridge_config(
                "kv_consumer", 0, kvbridge_read_timeout_s=READ_TIMEOUT_S, kvbridge_lease_s=LEASE_S,
                kvbridge_integrity=True, **({"kvbridge_transport": TRANSPORT} if TRANSPORT else {}),
            ),
            PAIR_ENV,
        )
        self.startup_s = wait_healthy([self.ref, self.prefiller, self.decoder, self.victim])
        binary = kvbridge_binary()
        assert binary is not None, "no kvbridge binary (cargo build -p kvbridge-cli, or KVBRIDGE_BIN)"
        self.proxy = Proxy(
            binary, [self.p_port], [self.d_port], self.logs,
            "--health-interval", str(HEALTH_INTERVAL_S), "--health-timeout", "1",
            "--unhealthy-after", str(UNHEALTHY_AFTER), "--prefill-timeout", "60", "--decode-timeout", "60",
        )  # fmt: skip
        self.procs.append(self.proxy)
        self.proxy.wait_healthy()

    def _server(self, name: str, port: int, ktc: dict | None, env: dict | None = None) -> VllmServer:
        # stats every second, so the connector's counters reach the log within a test
        # vLLM CPU's default thread binding, as a user starts it: every server's worker
        # computes on the same core(s), beside the others' (test_no_load_waits_...)
        env = {"VLLM_LOG_STATS_INTERVAL": "1", **(env or {})}
        s = VllmServer(name, self.model, port, self.logs, ktc, env=env)
        self.procs.append(s)
        return s

    def _prefiller(
        self, name: str, port: int, kv_port: int, env: dict | None = None, transport: str | None = None
    ) -> VllmServer:
        extra = {"kvbridge_transport": transport} if transport else {}
        if READ_GRANTS:
            extra["kvbridge_read_grants"] = True
        cfg = kvbridge_config("kv_producer", kv_port, kvbridge_lease_s=LEASE_S, kvbridge_integrity=True, **extra)
        return self._server(name, port, cfg, env)

    def restart_victim(self) -> float:
        """A new prefiller on the killed one's ports (the default transport this time)."""
        self.victim = self._prefiller(f"victim-{len(self.procs)}", self.v_port, self.v_kv_port)
        return wait_healthy([self.victim])

    def logs_text(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail(3000)}" for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            p.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if kvbridge_binary() is None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(
            "no kvbridge binary (cargo build -p kvbridge-cli, or KVBRIDGE_BIN)"
        )
    c = None
    try:
        c = Cluster(tmp_path_factory.mktemp("pd"))
        print(f"\n1P1D: four vLLM servers healthy in {c.startup_s:.1f} s")
        yield c
    finally:
        if c is not None:
            c.stop()


def request(api: str, text: str, stream: bool) -> tuple[str, dict]:
    if api == "completions":
        doc = {"prompt": text, "logprobs": TOP}
    else:
        doc = {"messages": [{"role": "user", "content": text}], "logprobs": True, "top_logprobs": TOP}
    doc.update(model="tiny", max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stream=stream)
    return f"/v1/{'completions' if api == 'completions' else 'chat/completions'}", doc


def tokens(api: str, base: str, text: str, stream: bool) -> list[tuple[str, dict[str, float]]]:
    """Each generated token with its top logprobs, from a streamed or whole answer."""
    path, doc = request(api, text, stream)
    if stream:
        status, events, raw = post_stream(base + path, doc)
        assert status == 200, raw[-2000:]
        choices = [c for e in events for c in e.get("choices", [])]
    else:
        status, body = post(base + path, doc)
        assert status == 200, body
        choices = body["choices"]
    return choice_tokens(api, choices)


#: How far a later token's logprob may part from the single server's: one bfloat16 step of
#: a logit below 16 (2**-4). The first token is computed over the loaded KV alone and must be
#: bit-equal; later steps also attend over KV each server computed itself, and on some hosts
#: (a 2-core AMD EPYC VM without AVX-512) the decoder's and the single server's decode steps
#: round one logit differently a few tokens in: token 8 of both 90-word completions prompts,
#: 0.033 and 0.055 on one top token, the same tokens, KV digest-checked, tokens 0-7
#: bit-equal. The cause inside vLLM CPU is not found.
LATER_TOKEN_LOGPROB_TOL = 2.0**-4


def assert_same(got, want):
    assert [t for t, _ in got] == [t for t, _ in want], "generated tokens differ"
    for i, ((_, g), (_, w)) in enumerate(zip(got, want)):
        if i == 0:
            assert g == w, f"token 0: top logprobs differ: {g} != {w}"
            continue
        assert g.keys() == w.keys(), f"token {i}: top tokens differ: {g} != {w}"
        worst = max(abs(g[k] - w[k]) for k in g)
        assert worst <= LATER_TOKEN_LOGPROB_TOL, f"token {i}: top logprobs differ by {worst}: {g} != {w}"


LOADS_OK = "vllm:kvbridge_loads_ok_total"
RECOMPUTED = "vllm:kvbridge_loads_recomputed_total"
BYTES_READ = "vllm:kvbridge_bytes_read_total"
#: The tiny model's KV bytes per 32-token block: K and V, 32 tokens, 2 KV heads, head_dim 32,
#: bf16, in each of its 2 layers.
BLOCK_TOKENS = 32
BLOCK_BYTES = 2 * BLOCK_TOKENS * 2 * 32 * 2 * 2


def decoder_moved(cluster: Cluster, before: dict[str, float], loads: int) -> dict[str, float]:
    """The decoder's counters moved since ``before``, once ``loads`` loads are counted (they
    reach /metrics with a step's output), or after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        moved = counters_moved(before, kvbridge_counters(cluster.decoder.url))
        if moved.get(LOADS_OK, 0) >= loads or time.monotonic() > deadline:
            return moved
        time.sleep(0.2)


def assert_loaded(cluster: Cluster, before: dict[str, float], loads: int) -> dict[str, float]:
    """Equal answers also come from a decoder that computed the prompt itself: each request
    must have been a load (loads_ok), none recomputed, none failed."""
    moved = decoder_moved(cluster, before, loads)
    assert moved.get(LOADS_OK, 0) == loads, f"{loads} request(s), decoder's counters moved: {moved}"
    # every load checked against the prefiller's digests (kvbridge_integrity, on in these servers)
    assert moved.get("vllm:kvbridge_loads_checked_total", 0) == loads, moved
    if READ_GRANTS:
        # reads under a grant go over TCP, where the prefiller checks them: none copied
        assert not moved.get("vllm:kvbridge_cma_batches_total"), moved
    assert not moved.get(RECOMPUTED), moved
    assert not any(k.startswith("vllm:kvbridge_load_failures_total[") for k in moved), moved
    return moved


def token_count(server: VllmServer, text: str) -> int:
    status, body = post(server.url + "/tokenize", {"model": "tiny", "prompt": text})
    assert status == 200, body
    return body["count"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_pd_answer_equals_single_server(cluster, api, stream):
    seed = {"completions": 0, "chat": 10}[api] + stream
    text = prompt(seed)
    want = tokens(api, cluster.ref.url, text, stream=False)
    assert len(want) == MAX_TOKENS
    before = kvbridge_counters(cluster.decoder.url)
    got = tokens(api, cluster.proxy.url, text, stream)
    assert_same(got, want)
    assert_loaded(cluster, before, 1)


def test_decoder_prefix_hit_reads_only_the_tail_and_still_equals(cluster):
    """The decoder already holds the first blocks of this prompt (an earlier request with the
    same head, in its prefix cache), so it reads only the prefiller's tail blocks: its
    bytes_read grows by exactly the tail's blocks, not the prompt's."""
    head = prompt(20, words=64)
    n_head = token_count(cluster.ref, head)
    assert n_head % BLOCK_TOKENS == 0, n_head  # whole blocks: each enters the prefix cache
    before = kvbridge_counters(cluster.decoder.url)
    tokens("completions", cluster.proxy.url, head, stream=False)
    moved = assert_loaded(cluster, before, 1)
    assert moved.get(BYTES_READ) == n_head // BLOCK_TOKENS * BLOCK_BYTES, moved  # the whole head
    text = head + " " + prompt(21, words=40)
    n = token_count(cluster.ref, text)
    tail_blocks = -(-n // BLOCK_TOKENS) - n_head // BLOCK_TOKENS
    assert tail_blocks > 0 and n > n_head, (n, n_head)
    want = tokens("completions", cluster.ref.url, text, False)
    before = kvbridge_counters(cluster.decoder.url)
    assert_same(tokens("completions", cluster.proxy.url, text, False), want)
    moved = assert_loaded(cluster, before, 1)
    assert moved.get(BYTES_READ) == tail_blocks * BLOCK_BYTES, (
        f"read {moved.get(BYTES_READ)} bytes, the {tail_blocks} tail blocks are {tail_blocks * BLOCK_BYTES} "
        f"(the whole prompt's {-(-n // BLOCK_TOKENS)} blocks: {-(-n // BLOCK_TOKENS) * BLOCK_BYTES}): {moved}"
    )


def test_proxy_keeps_the_decoder_past_the_health_ejection_threshold(cluster):
    """`kvbridge proxy --flow vllm` must not eject vLLM decoders, which have no KV init port:
    requests keep succeeding for many times the ejection threshold."""
    threshold_s = HEALTH_INTERVAL_S * UNHEALTHY_AFTER
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < 6 * threshold_s or n < 3:
        path, doc = request("completions", prompt(100 + n, words=40), False)
        doc["max_tokens"] = 2
        status, body = post(cluster.proxy.url + path, doc, timeout=60)
        assert status == 200, (n, round(time.monotonic() - t0, 1), body)
        n += 1
        assert n < 500
    assert http_status(f"{cluster.proxy.url}/health") == 200


def proxy_decoder_loads(proxy_url: str, decoder_url: str) -> dict[str, float]:
    """The proxy's figures of one decoder's loads (``kvbridge_proxy_decoder_kv_loads_total``
    by outcome), as its /metrics shows them."""
    worker = decoder_url.removeprefix("http://")
    with urllib.request.urlopen(f"{proxy_url}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for m in re.finditer(r'^kvbridge_proxy_decoder_kv_loads_total\{([^}]*)\} ([0-9.e+-]+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("worker") == worker:
            out[labels["outcome"]] = float(m.group(2))
    return out


def test_the_proxy_shows_each_decoders_loads_and_recomputes(cluster):
    """An operator reads at the proxy how many of a decoder's requests loaded their KV over
    kvbridge, were checked, or were computed again: the proxy's figures follow the decoder's
    own series (it reads them at each health check)."""
    tokens("completions", cluster.proxy.url, prompt(40), stream=False)
    theirs: dict[str, float] = {}
    ours: dict[str, float] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        c = kvbridge_counters(cluster.decoder.url)
        theirs = {
            "loaded": c.get(LOADS_OK, 0.0),
            "checked": c.get("vllm:kvbridge_loads_checked_total", 0.0),
            "recomputed": c.get(RECOMPUTED, 0.0),
        }
        ours = proxy_decoder_loads(cluster.proxy.url, cluster.decoder.url)
        if theirs["loaded"] >= 1 and all(ours.get(k) == v for k, v in theirs.items()):
            return
        time.sleep(0.5)
    raise AssertionError(f"the proxy shows {ours}, the decoder counts {theirs}")


def test_transfers_are_counted_in_vllms_connector_stats(cluster):
    """The decoder serves the connector's counters as Prometheus series, one load per
    request, and logs them each stats interval (1 s here). vLLM logs an interval in which the
    engine made no token (nor in the one before) at debug level, dropping its counts, so the
    log is checked for a line at all, with a request sent every 3 s (at most 5) until one
    comes; the series must count every request."""
    before = kvbridge_counters(cluster.decoder.url)
    pat = re.compile(r"KV Transfer metrics: .*loads_ok=(\d+).*bytes_read=(\d+)")
    logged = len(pat.findall(cluster.decoder.log_path.read_text(errors="replace")))
    sent = 0
    while True:
        tokens("completions", cluster.proxy.url, prompt(30 + sent * 1000), stream=False)
        sent += 1
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            found = pat.findall(cluster.decoder.log_path.read_text(errors="replace"))
            if len(found) > logged:
                break
            time.sleep(0.2)
        if len(found) > logged or sent == 5:
            break
    assert len(found) > logged, f"no KV Transfer metrics line after {sent} requests:\n{cluster.decoder.tail()}"
    assert all(int(a) > 0 and int(b) > 0 for a, b in found[logged:])
    deadline = time.monotonic() + 10
    while True:
        after = kvbridge_counters(cluster.decoder.url)
        loads = after.get("vllm:kvbridge_loads_ok_total", 0) - before.get("vllm:kvbridge_loads_ok_total", 0)
        if loads >= sent or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert loads == sent, (loads, sent)
    assert after.get(RECOMPUTED, 0) == before.get(RECOMPUTED, 0), counters_moved(before, after)
    assert after.get("vllm:kvbridge_bytes_read_total", 0) > before.get("vllm:kvbridge_bytes_read_total", 0)
    if TRANSPORT == "ucx":
        moved = counters_moved(before, after)
        assert moved.get("vllm:kvbridge_ucx_batches_total", 0) >= sent, moved


#: The issue's shape: five requests one after another, then eight at once.
SEQUENTIAL_WORDS = (3, 20, 45, 70, 90)
CONCURRENT = 8


class Burners:
    """Processes that keep every core busy (bounded: each ends itself after ``limit_s``),
    as other work on the host would; killed with their process group."""

    def __init__(self, limit_s: float = 300.0):
        import subprocess
        import sys

        code = f"import time\nend = time.monotonic() + {limit_s}\nwhile time.monotonic() < end: pass\n"
        self.procs = [
            subprocess.Popen([sys.executable, "-c", code], start_new_session=True) for _ in range(os.cpu_count() or 1)
        ]

    def stop(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


@pytest.mark.parametrize("host", ["idle", "busy"])
def test_no_load_waits_on_another_engine_step_sequential_and_concurrent(cluster, host):
    """Every request of five sequential and eight concurrent ones answers 200, equal to the
    single server, its KV loaded over kvbridge (loads_ok counts each) with no failure and no
    load slower than a second, on the host as it is and with every core kept busy.

    The servers share the compute core (vLLM CPU's default binding). A prefiller holding
    blocks keeps stepping, and its worker spinning between steps kept the decoder's worker
    off the core: the decoder could not start the load until the lease ended (lease_ended
    after 30 s, half the requests of an idle host). Loads now start from the decoder's
    scheduler, the prefiller marks a request held in the step that computes it, and an
    idle step waits for its transfer instead of spinning."""
    burners = Burners() if host == "busy" else None
    try:
        before = kvbridge_counters(cluster.decoder.url)
        failures: list[str] = []
        texts = [prompt(500 + i, words=w) for i, w in enumerate(SEQUENTIAL_WORDS)]
        for text in texts:
            path, doc = request("completions", text, False)
            doc["max_tokens"] = 12
            status, body = post(cluster.proxy.url + path, doc, timeout=120)
            if status != 200:
                failures.append(f"sequential: {status} {str(body)[:300]}")
                continue
            _, want = post(cluster.ref.url + path, doc, timeout=120)
            assert_same(choice_tokens("completions", body["choices"]), choice_tokens("completions", want["choices"]))
        concurrent = [prompt(600 + i, words=5 + 11 * i) for i in range(CONCURRENT)]
        answers: dict[int, tuple[int, dict]] = {}

        def send(i: int) -> None:
            path, doc = request("completions", concurrent[i], False)
            answers[i] = post(cluster.proxy.url + path, dict(doc, max_tokens=12), timeout=120)

        threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(CONCURRENT)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        assert not any(t.is_alive() for t in threads), "a concurrent request hangs"
        for i in range(CONCURRENT):
            status, body = answers[i]
            if status != 200:
                failures.append(f"concurrent {i}: {status} {str(body)[:300]}")
                continue
            path, doc = request("completions", concurrent[i], False)
            _, want = post(cluster.ref.url + path, dict(doc, max_tokens=12), timeout=120)
            # in a batch of eight, compare the text: logprobs may differ in the last bits
            got_text = [t for t, _ in choice_tokens("completions", body["choices"])]
            assert got_text == [t for t, _ in choice_tokens("completions", want["choices"])], i
    finally:
        if burners is not None:
            burners.stop()
    sent = len(texts) + CONCURRENT
    deadline = time.monotonic() + 10
    while True:
        moved = counters_moved(before, kvbridge_counters(cluster.decoder.url))
        if moved.get("vllm:kvbridge_loads_ok_total", 0) >= sent - len(failures) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print(f"\n{host} host: decoder's counters moved: {moved}")
    assert not failures, f"{len(failures)} of {sent} requests failed: {failures}\n{cluster.logs_text()}"
    bad = {k: v for k, v in moved.items() if "load_failures" in k or k == "vllm:kvbridge_slow_loads_total"}
    assert not bad, f"failed or slow loads: {bad}"
    assert moved.get("vllm:kvbridge_loads_ok_total") == sent, moved
    assert moved.get("vllm:kvbridge_loads_checked_total") == sent, moved
    assert not moved.get(RECOMPUTED), moved


def counters_moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_prefiller_killed_mid_transfer_ends_the_request_and_the_decoder_recovers(cluster):
    """SIGKILL the prefiller while the decoder's read of its blocks is in flight: the request
    ends with an error within the read deadline, the decoder frees its blocks and serves the
    next request once a new prefiller is up."""
    # One request first, so that the decoder holds a session with this prefiller and the
    # kill below lands during a read, not during the handshake. Its outcome is not checked:
    # over the data connection a read has been seen to wait until the prefiller's engine
    # loop went idle (docs/vllm.md, "Not yet").
    path, doc = request("completions", prompt(39), False)
    counted = kvbridge_counters(cluster.decoder.url)
    warm = post(cluster.decoder.url + path, dict(doc, kv_transfer_params=prefill(cluster.victim.url, path, doc)))
    moved = counters_moved(counted, kvbridge_counters(cluster.decoder.url))
    print(f"\nfirst request over the data connection: {warm[0]}, decoder's counters moved: {moved}")
    # the premise: this prefiller's blocks cannot be copied without the prefiller's process
    assert not moved.get("vllm:kvbridge_cma_batches_total") and not moved.get("vllm:kvbridge_shm_batches_total"), moved

    text = prompt(40)
    path, doc = request("completions", text, False)
    params = prefill(cluster.victim.url, path, doc)

    # The prefiller stops answering: the decoder's read request waits in its socket.
    cluster.victim.signal(signal.SIGSTOP)
    before = tcp_rx_queue(cluster.v_kv_port)
    counted = kvbridge_counters(cluster.decoder.url)
    answer: dict = {}

    def decode():
        answer["result"] = post(cluster.decoder.url + path, dict(doc, kv_transfer_params=params), timeout=120)
        answer["at"] = time.monotonic()

    t = threading.Thread(target=decode, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while tcp_rx_queue(cluster.v_kv_port) <= before:
        assert time.monotonic() < deadline, "the decoder never sent the prefiller its read"
        if not t.is_alive():
            # What must happen: the decode waits on the stopped prefiller, its read request
            # in the prefiller's socket. An answer before that (seen once in a clean-clone CI
            # run, a 200 equal to the single server's) means the decoder did not read this
            # prefiller's blocks over the data connection: a defect, whatever the answer.
            status, body = answer["result"]
            moved = counters_moved(counted, kvbridge_counters(cluster.decoder.url))
            pytest.fail(
                f"the decode answered {status} while its prefiller was stopped, no read request in the "
                f"prefiller's socket; decoder's counters moved: {moved}; answer: {str(body)[:500]}\n"
                f"{cluster.decoder.tail(6000)}"
            )
        time.sleep(0.05)
    cluster.victim.signal(signal.SIGKILL)
    killed = time.monotonic()
    t.join(READ_TIMEOUT_S + 30)
    assert not t.is_alive(), "the decode request hangs after its prefiller died"
    took = answer["at"] - killed
    status, body = answer["result"]
    print(f"\nprefiller killed mid-read: the decoder answered {status} after {took:.2f} s: {str(body)[:300]}")
    assert took < READ_TIMEOUT_S + 5
    failed = status >= 400 or any(c.get("finish_reason") == "error" for c in body.get("choices", []))
    assert failed, f"a request whose KV never arrived was answered as a success: {body}"
    # the failure is counted, by cause (the counters reach /metrics with the step's output)
    deadline = time.monotonic() + 10
    while True:
        moved = counters_moved(counted, kvbridge_counters(cluster.decoder.url))
        failures = sum(v for k, v in moved.items() if k.startswith("vllm:kvbridge_load_failures_total["))
        if failures or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print(f"decoder's counters moved: {moved}")
    assert failures == 1 and not moved.get("vllm:kvbridge_loads_ok_total"), moved

    # The decoder stays up and gives back the request's blocks.
    assert http_status(f"{cluster.decoder.url}/health") == 200
    deadline = time.monotonic() + 30
    while kv_cache_usage(cluster.decoder.url) > 0:
        assert time.monotonic() < deadline, "the decoder keeps the failed request's blocks"
        time.sleep(0.2)

    # The proxy's pair still answers, and a new prefiller on the killed one's ports serves
    # the decoder (which forgets the dead session and connects to the new one).
    text = prompt(41)
    want = tokens("completions", cluster.ref.url, text, False)
    before = kvbridge_counters(cluster.decoder.url)
    assert_same(tokens("completions", cluster.proxy.url, text, False), want)
    assert_loaded(cluster, before, 1)
    started_in = cluster.restart_victim()
    print(f"new prefiller healthy in {started_in:.1f} s")
    text = prompt(42)
    want = tokens("completions", cluster.ref.url, text, False)
    path, doc = request("completions", text, False)
    params = prefill(cluster.victim.url, path, doc)
    before = kvbridge_counters(cluster.decoder.url)
    status, body = post(cluster.decoder.url + path, dict(doc, kv_transfer_params=params))
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert_same([(t, dict(top)) for t, top in zip(lp["tokens"], lp["top_logprobs"])], want)
    assert_loaded(cluster, before, 1)
