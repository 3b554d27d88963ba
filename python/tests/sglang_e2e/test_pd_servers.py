"""A real prefill + decode pair of SGLang 0.5.23 servers on CPU over the kvbridge backend
(started with ``python -m kvbridge.sglang.launch_server``), against a single SGLang server:
the same greedy text for every prompt, requests sent to both servers at once as SGLang's
router does (``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``), and the decode's
log showing each request's KV came over kvbridge. Then the prefill server is killed: a
request waiting on it ends with an error within the backend's deadline, not SGLang's 300 s.

Then it comes back on the same ports and the next request is served.

Servers start one at a time (the single server, then the pair), each killed as a whole
process group; readiness is polled on /health with a deadline."""

from __future__ import annotations

import random
import re
import sys
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "vllm_e2e"))
import standins  # noqa: E402
import tiny_model  # noqa: E402
from sglang_servers import SglangServer, free_ports, http_json, pd_pair, prefill_server, wait_healthy  # noqa: E402

PROMPTS = [
    "the cat sat on the old stone by the river and",
    "one two three four five six seven eight nine ten and the",
    "where is the blue ship that was on the sea at night when the moon",
    "a long story of the red bird and the green tree in the rain " * 6,
]
MAX_NEW = 8


def body(prompt: str, **extra) -> dict:
    return {
        "text": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW},
        "return_logprob": True,
        "top_logprobs_num": 3,
        **extra,
    }


def top_logprobs(resp: dict) -> list:
    """[(token id, logprob)] of the top candidates at each output position."""
    rows = resp.get("meta_info", {}).get("output_top_logprobs") or []
    return [[(c[1], c[0]) for c in row] for row in rows if row]


def ids(resp: dict) -> list:
    return resp.get("output_ids") or resp["meta_info"].get("output_token_ids") or []


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_e2e")
    model = tiny_model.build(root / "model")
    return root, model, standins.write(root / "standins")


@pytest.fixture(scope="module")
def single_outputs(env):
    root, model, st = env
    (root / "logs").mkdir(exist_ok=True)
    port = free_ports(1)[0]
    s = SglangServer("single", model, port, root / "logs", st)
    try:
        took = wait_healthy([s])
        print(f"\nsingle SGLang server healthy in {took:.0f} s")
        out = []
        for p in PROMPTS:
            status, resp = http_json(f"{s.url}/generate", body(p))
            assert status == 200, resp
            out.append(resp)
        return out
    finally:
        s.kill()


def pd_generate(prefill, decode, bport, prompt, room, results, i):
    extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": room}
    got = {}

    def go(name, url):
        got[name] = http_json(f"{url}/generate", body(prompt, **extra), timeout=180)

    threads = [threading.Thread(target=go, args=(n, u)) for n, u in (("p", prefill.url), ("d", decode.url))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=200)
    results[i] = got


def test_pd_over_kvbridge_equals_a_single_server_and_a_dead_prefill_ends_requests(env, single_outputs):
    root, model, st = env
    prefill, decode, bport = pd_pair(model, root / "logs", st)
    try:
        took = wait_healthy([prefill, decode])
        print(f"prefill + decode healthy in {took:.0f} s")
        # sequential, then concurrent
        results = [None] * len(PROMPTS)
        for i, p in enumerate(PROMPTS):
            pd_generate(prefill, decode, bport, p, random.getrandbits(62), results, i)
        conc = [None] * len(PROMPTS)
        threads = [
            threading.Thread(target=pd_generate, args=(prefill, decode, bport, p, random.getrandbits(62), conc, i))
            for i, p in enumerate(PROMPTS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        for res in (results, conc):
            for want, got in zip(single_outputs, res):
                status, resp = got["d"]
                assert status == 200, resp
                assert resp["text"] == want["text"], (resp["text"], want["text"])
                assert ids(resp) == ids(want)
                got_top, want_top = top_logprobs(resp), top_logprobs(want)
                assert [[t for t, _ in row] for row in got_top] == [[t for t, _ in row] for row in want_top]
                diff = max((abs(a[1] - b[1]) for r1, r2 in zip(got_top, want_top) for a, b in zip(r1, r2)), default=0.0)
                assert diff < 0.05, diff
                print(f"  {resp['text']!r}: equal to the single server (top logprobs within {diff:.4f})")
        # the KV of every request came over kvbridge (decode log, one line a request)
        wait_log = time.monotonic() + 10
        while True:
            received = len(re.findall(r"kvbridge: room \d+: KV received over kvbridge", decode.tail(10**7)))
            if received >= 2 * len(PROMPTS) or time.monotonic() > wait_log:
                break
            time.sleep(0.2)
        assert received == 2 * len(PROMPTS), decode.tail(3000)

        # the prefill dies while a request waits on it: the decode ends it within its deadline
        room = random.getrandbits(62)
        extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": room}
        box = {}
        t = threading.Thread(target=lambda: box.update(r=http_json(f"{decode.url}/generate", body(PROMPTS[0], **extra), timeout=120)))
        t0 = time.monotonic()
        t.start()
        prefill.kill()
        t.join(timeout=150)
        took = time.monotonic() - t0
        assert "r" in box, "the decode request did not end"
        status, resp = box["r"]
        print(f"decode request with its prefill killed: HTTP {status} after {took:.1f} s: {str(resp)[:300]}")
        assert took < 90, took  # not SGLang's 300 s
        assert status != 200 or "abort" in str(resp).lower() or resp.get("meta_info", {}).get("finish_reason", {}).get("type") == "abort", resp
        assert "kvbridge: prefill" in str(resp), resp  # the reason names the peer and the step

        # the prefill comes back on the same ports: the next request is served, over kvbridge
        prefill = prefill_server(model, root / "logs", st, prefill.port, bport, name="prefill-restarted")
        took = wait_healthy([prefill])
        print(f"prefill restarted, healthy in {took:.0f} s")
        again = [None]
        pd_generate(prefill, decode, bport, PROMPTS[1], random.getrandbits(62), again, 0)
        status, resp = again[0]["d"]
        assert status == 200 and resp["text"] == single_outputs[1]["text"], resp
        print(f"  after the restart: {resp['text']!r}: equal to the single server")
    finally:
        prefill.kill()
        decode.kill()
