"""KV-aware routing of text and chat requests with real vLLM CPU servers:
``kvbridge proxy --routing kv-events --kv-events-tokenize http`` in front of two colocated
vLLM servers with prefix caching, each publishing its KV cache events (ZMQ PUB, vLLM's
``--kv-events-config``). The proxy gets a chat's or a text prompt's token ids from a
worker's ``POST /tokenize`` and matches them against the blocks each worker reported, so a
follow-up that shares a document goes to the worker holding it, which then reuses its
prefix cache. With ``--kv-events-tokenize off`` the same requests match nothing.

Which worker served a request is read from the workers' own ``/metrics``
(``vllm:request_success_total``), what the proxy knew from its ``/metrics``. Every request
goes to a worker alone (the decider's threshold is above any prompt): no KV connector.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import statistics
import time
from pathlib import Path

import pytest

from servers import (
    Proxy,
    VllmEventsServer,
    free_ports,
    http_status,
    kvbridge_binary,
    post,
    prometheus_sum,
    wait_healthy,
)
from tiny_model import WORDS, build

BLOCK = 32
#: Words of each shared document: about 9 blocks of the tiny model's word-level tokenizer.
DOC_WORDS = 300
#: Longest wait for the proxy to see a worker's KV events after a request.
EVENTS_DEADLINE_S = 60.0
MATCHED = 'kvbridge_proxy_routing_decisions_total{role="decode",policy="kv-events",matched="true"}'


def doc(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(DOC_WORDS))


def chat_body(document: str, question: str, **extra) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "system", "content": document}, {"role": "user", "content": question}],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }


def text_body(prompt: str) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}


def metrics_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        return r.read().decode()


def sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


class Workers:
    def __init__(self, root: Path):
        self.model = build(root / "model")
        self.logs = root / "logs"
        self.logs.mkdir()
        ports = free_ports(2)
        self.servers = [
            VllmEventsServer(f"worker{i}", self.model, ports[i], self.logs, env=self._env(i))
            for i in range(2)
        ]
        self.startup_s = wait_healthy(self.servers)

    @staticmethod
    def _env(i: int) -> dict[str, str]:
        env = {"VLLM_LOG_STATS_INTERVAL": "1"}
        if (os.cpu_count() or 1) >= 2:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(i)
        return env

    def served(self) -> list[float]:
        return [prometheus_sum(s.url, "vllm:request_success_total") for s in self.servers]

    def hits(self) -> list[float]:
        return [prometheus_sum(s.url, "vllm:prefix_cache_hits_total") for s in self.servers]

    def wait_hits(self, i: int, at_least: float, deadline_s: float = 30.0) -> None:
        """Waits until worker ``i`` counted ``at_least`` prompt tokens served from its prefix
        cache (its counters reach ``/metrics`` with its step's stats)."""
        deadline = time.monotonic() + deadline_s
        while (h := self.hits()[i]) < at_least:
            assert time.monotonic() < deadline, f"worker {i}'s prefix cache hits stayed at {h} < {at_least}"
            time.sleep(0.05)

    def stop(self) -> None:
        for s in self.servers:
            s.kill()


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    if kvbridge_binary() is None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(
            "no kvbridge binary (cargo build -p kvbridge-cli, or KVBRIDGE_BIN)"
        )
    w = None
    try:
        w = Workers(tmp_path_factory.mktemp("kvevents"))
        print(f"\nkv-events: two vLLM servers healthy in {w.startup_s:.1f} s")
        yield w
    finally:
        if w is not None:
            w.stop()


def start_proxy(w: Workers, logdir: Path, tokenize: str) -> Proxy:
    logdir.mkdir()
    ports = [s.port for s in w.servers]
    p = Proxy(
        kvbridge_binary(), ports[:1], ports, logdir,
        "--routing", "kv-events",
        "--decoder-kv-events-endpoint", ",".join(s.events for s in w.servers),
        # A deadline far above a call's cost: this test is about what the ids route, and a
        # busy CI host has stretched single calls to 100 ms.
        "--kv-events-tokenize", tokenize, "--kv-events-tokenize-timeout", "10",
        "--disaggregate-min-uncached-tokens", "1000000000",
        "--health-interval", "0.5", "--prefill-timeout", "120", "--decode-timeout", "120",
    )  # fmt: skip
    p.wait_healthy()
    # The proxy subscribes once its workers are known; vLLM's PUB drops what it publishes
    # before a subscriber is in. Wait for both subscriptions.
    deadline = time.monotonic() + EVENTS_DEADLINE_S
    while sample(metrics_text(p.url), 'kvbridge_proxy_kv_events_connects_total{role="decode"}') < 2:
        assert time.monotonic() < deadline, f"the proxy did not subscribe:\n{p.tail()}"
        time.sleep(0.1)
    return p


class Router:
    """Requests through a proxy, each one's serving worker read from the workers."""

    def __init__(self, w: Workers, proxy: Proxy):
        self.w, self.proxy = w, proxy

    def send(self, path: str, body: dict) -> tuple[int, dict]:
        before = self.w.served()
        status, answer = post(f"{self.proxy.url}{path}", body)
        assert status == 200, answer
        deadline = time.monotonic() + 30
        while True:
            delta = [a - b for a, b in zip(self.w.served(), before)]
            if sum(delta) >= 1:
                break
            assert time.monotonic() < deadline, "no worker counted the request"
            time.sleep(0.05)
        assert sorted(delta) == [0, 1], delta
        return delta.index(1), answer

    def blocks(self, i: int) -> float:
        name = f'kvbridge_proxy_kv_events_blocks{{role="decode",worker="127.0.0.1:{self.w.servers[i].port}"}}'
        return sample(metrics_text(self.proxy.url), name)

    def wait_blocks(self, i: int) -> None:
        deadline = time.monotonic() + EVENTS_DEADLINE_S
        while self.blocks(i) < 1:
            assert time.monotonic() < deadline, f"no KV events of worker {i} reached the proxy:\n{self.proxy.tail()}"
            time.sleep(0.05)

    def metric(self, name: str) -> float:
        return sample(metrics_text(self.proxy.url), name)


def tokenize_round_trips(url: str, body: dict, n: int = 30) -> list[float]:
    """Seconds of ``n`` ``POST /tokenize`` round trips on one kept-alive connection."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    data = json.dumps(body).encode()
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            conn.request("POST", "/tokenize", data, {"content-type": "application/json"})
            r = conn.getresponse()
            r.read()
            out.append(time.perf_counter() - t0)
            assert r.status == 200
    finally:
        conn.close()
    return out


def test_tokenized_text_and_chat_follow_ups_go_to_the_worker_holding_their_prefix(workers, tmp_path, monkeypatch):
    # The timeline logs each /tokenize call's time (`proxy.tokenized ... took_us`).
    monkeypatch.setenv("RUST_LOG", "warn,kvbridge::timeline=debug")
    proxy = start_proxy(workers, tmp_path / "proxy-http", "http")
    r = Router(workers, proxy)
    try:
        d1, d2, d3 = doc(1), doc(2), doc(3)
        # Two documents on two workers: the second, which no worker holds, goes to the one
        # holding the fewest blocks (docs/proxy.md, "Routing").
        x, _ = r.send("/v1/chat/completions", chat_body(d1, "what is the first story"))
        r.wait_blocks(x)
        y, _ = r.send("/v1/chat/completions", chat_body(d2, "what is the first story"))
        assert y != x, "a document no worker holds went to the warm worker"
        r.wait_blocks(y)
        assert r.metric(MATCHED) == 0

        # Follow-ups sharing a document go where it is, and that worker's cache serves it.
        for n, (document, want) in enumerate([(d1, x), (d2, y), (d1, x), (d2, y)]):
            hits = workers.hits()
            got, _ = r.send("/v1/chat/completions", chat_body(document, f"and what of the {WORDS[n]} one"))
            assert got == want, f"follow-up {n} went to worker {got}, its prefix is on {want}"
            assert r.metric(MATCHED) == n + 1
            workers.wait_hits(want, hits[want] + BLOCK * 8)

        # Text completions: the prompt tokenized as the server does (add_special_tokens).
        z, _ = r.send("/v1/completions", text_body(d3 + " the first question"))
        r.wait_blocks(z)
        matched = r.metric(MATCHED)
        got, _ = r.send("/v1/completions", text_body(d3 + " the second question"))
        assert got == z
        assert r.metric(MATCHED) == matched + 1

        # The ids the proxy was given are the ones the engine computed for the chat.
        body = chat_body(d1, "which tokens", return_token_ids=True)
        _, answer = r.send("/v1/chat/completions", body)
        tok_body = {k: v for k, v in body.items() if k in ("model", "messages")}
        status, tok = post(f"{workers.servers[0].url}/tokenize", tok_body)
        assert status == 200, tok
        assert tok["tokens"] == answer["prompt_token_ids"]

        ok = r.metric('kvbridge_proxy_tokenize_total{result="ok"}')
        assert ok == 9, metrics_text(proxy.url)
        # The cost of one call: the proxy's mean, and direct round trips (median).
        mean_ms = r.metric("kvbridge_proxy_tokenize_ok_seconds_total") / ok * 1e3
        log = re.sub(r"\x1b\[[0-9;]*m", "", proxy.tail(1 << 20))
        took = [int(t) / 1e3 for t in re.findall(r"proxy\.tokenized.*took_us=(\d+)", log)]
        assert len(took) == ok, log
        print(
            f"\n/tokenize from the proxy: mean {mean_ms:.2f} ms over {ok:.0f} calls (chats and texts of 300-320 "
            f"tokens), median {statistics.median(took):.2f} ms; each, in order: {', '.join(f'{t:.1f}' for t in took)} ms"
        )
        long_text = " ".join(random.Random(9).choice(WORDS) for _ in range(1000))
        for what, body in [(f"{len(tok['tokens'])}-token chat", tok_body), ("1000-token text", {"model": "tiny", "prompt": long_text})]:
            rt = sorted(tokenize_round_trips(workers.servers[0].url, body, n=50))
            print(
                f"/tokenize of a {what}, 50 round trips on one kept-alive loopback connection: "
                f"median {statistics.median(rt) * 1e3:.2f} ms, p90 {rt[44] * 1e3:.2f}, max {rt[-1] * 1e3:.2f} ms "
                f"(load average {os.getloadavg()[0]:.1f})"
            )
    finally:
        proxy.kill()


def test_without_tokenize_a_chat_matches_nothing(workers, tmp_path):
    proxy = start_proxy(workers, tmp_path / "proxy-off", "off")
    r = Router(workers, proxy)
    try:
        d4 = doc(4)
        x, _ = r.send("/v1/chat/completions", chat_body(d4, "what is the first story"))
        r.wait_blocks(x)
        for n in range(3):
            r.send("/v1/chat/completions", chat_body(d4, f"and what of the {WORDS[n]} one"))
        assert r.metric(MATCHED) == 0
        assert r.metric('kvbridge_proxy_tokenize_total{result="ok"}') == 0
        assert http_status(f"{proxy.url}/health") == 200
    finally:
        proxy.kill()
