"""A real prefill + decode pair of SGLang 0.5.23 servers on CPU over the kvbridge backend
(started with ``python -m kvbridge.sglang.launch_server``), against a single SGLang server:
the same greedy text for every prompt, requests sent to both servers at once as SGLang's
router does (``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``), and the decode's
log showing each request's KV came over kvbridge. Then the prefill server is killed: a
request waiting on it ends with an error within the backend's deadline, not SGLang's 300 s.

Then it comes back on the same ports and the next request is served.

The servers are the session's (pool.py): the single server's answers are taken before the
pair starts; this test leaves a live prefill behind."""

from __future__ import annotations

import random
import threading
import time

from bodies import PROMPTS, generate, ids, top_logprobs
from sglang_servers import KV_RECEIVED, count_lines, http_json


def pd_generate(prefill, decode, bport, prompt, room, results, i):
    extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": room}
    got = {}

    def go(name, url):
        got[name] = http_json(f"{url}/generate", generate(prompt, **extra), timeout=180)

    threads = [threading.Thread(target=go, args=(n, u)) for n, u in (("p", prefill.url), ("d", decode.url))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=200)
    results[i] = got


def test_pd_over_kvbridge_equals_a_single_server_and_a_dead_prefill_ends_requests(pair, references):
    single_outputs = references.generate
    prefill, decode, bport = pair.prefill, pair.decode, pair.bport
    received_before = count_lines(decode, KV_RECEIVED)
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
        received = count_lines(decode, KV_RECEIVED) - received_before
        if received >= 2 * len(PROMPTS) or time.monotonic() > wait_log:
            break
        time.sleep(0.2)
    assert received == 2 * len(PROMPTS), decode.tail(3000)

    # the prefill dies while a request waits on it: the decode ends it within its deadline
    room = random.getrandbits(62)
    extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": room}
    box = {}
    t = threading.Thread(target=lambda: box.update(r=http_json(f"{decode.url}/generate", generate(PROMPTS[0], **extra), timeout=120)))
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
    took = pair.restart_prefill()
    prefill = pair.prefill
    print(f"prefill restarted, healthy in {took:.0f} s")
    again = [None]
    pd_generate(prefill, decode, bport, PROMPTS[1], random.getrandbits(62), again, 0)
    status, resp = again[0]["d"]
    assert status == 200 and resp["text"] == single_outputs[1]["text"], resp
    print(f"  after the restart: {resp['text']!r}: equal to the single server")
