"""``kvbridge proxy --flow sglang`` in front of the session's real prefill + decode pair over
kvbridge (pool.py), as SGLang's router would be: OpenAI completions and chat, whole and
streamed, one after another and all at once, each answer equal to the single server's (text,
tokens, top logprobs), and each request's KV counted once as sent by the prefill and once as
received by the decode (the backend's line per request in each log): the decode attended to
the prefill's KV, it did not compute the prompt.

Then the prefill server is killed as a whole process group while a long prompt's KV is
leaving it chunk by chunk: the client gets the proxy's 502 ``prefill_failed`` at once, the
decode request ends (the proxy cancels it, or the decode fails it first), and once a new prefill is up on the same ports the next
request through the proxy is served over kvbridge."""

from __future__ import annotations

import os
import threading
import time

import pytest

from bodies import CASES, LONG_PROMPT, PROXY_PROMPTS, assert_same_answer, openai, openai_answer
from sglang_servers import (
    DECODE_ROOM_FAILED,
    KV_RECEIVED,
    KV_SENT,
    PREFILL_STEP,
    SglangProxy,
    count_lines,
    http_status,
    kv_lines_reach,
    kvbridge_binary,
    post,
)

#: The proxy's --prefill-timeout and --decode-timeout: generous, the host is shared.
PROXY_TIMEOUT_S = 180
#: Longest the client may wait for the proxy's error once the prefill is dead: the proxy
#: answers when the prefill's connection breaks, not at a deadline.
ERROR_WITHIN_S = 30


@pytest.fixture(scope="module")
def proxy(env, pair):
    binary = kvbridge_binary()
    if binary is None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(
            "no kvbridge binary (cargo build -p kvbridge-cli, or KVBRIDGE_BIN)"
        )
    px = SglangProxy(
        binary, pair.prefill, pair.bport, pair.decode, env.logs,
        "--prefill-timeout", str(PROXY_TIMEOUT_S), "--decode-timeout", str(PROXY_TIMEOUT_S),
        "--health-interval", "0.5", "--health-timeout", "2",
    )  # fmt: skip
    try:
        print(f"\nkvbridge proxy --flow sglang healthy in {px.wait_healthy():.1f} s")
        yield px
    finally:
        px.kill()


def test_the_proxy_fronts_the_pair_equal_to_a_single_server_with_the_kv_over_kvbridge(proxy, pair, references, env):
    received0 = count_lines(pair.decode, KV_RECEIVED)
    sent0 = count_lines(pair.prefill, KV_SENT)

    def ask(case):
        api, i, stream = case
        return openai_answer(proxy.url, api, env.model, PROXY_PROMPTS[i], stream, timeout=PROXY_TIMEOUT_S + 60)

    t0 = time.monotonic()
    sequential = {c: ask(c) for c in CASES}
    seq_s = time.monotonic() - t0
    concurrent: dict = {}
    errors: list = []

    def one(case):
        try:
            concurrent[case] = ask(case)
        except BaseException as e:  # noqa: BLE001 - reported below, with the case
            errors.append((case, repr(e)))

    threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in CASES]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(PROXY_TIMEOUT_S + 120)
    conc_s = time.monotonic() - t0
    assert not any(t.is_alive() for t in threads), "a request through the proxy hangs"
    assert not errors, errors
    print(f"{len(CASES)} requests one after another in {seq_s:.1f} s, {len(CASES)} at once in {conc_s:.1f} s")
    for run, answers in (("sequential", sequential), ("concurrent", concurrent)):
        for (api, i, stream), got in sorted(answers.items()):
            diff = assert_same_answer(got, references.openai[(api, i)])
            how = "streamed" if stream else "whole"
            print(f"  {run} {api} {how} {got[0]!r}: equal to the single server (top logprobs within {diff:.4f})")

    n = 2 * len(CASES)
    received = kv_lines_reach(pair.decode, KV_RECEIVED, received0 + n) - received0
    sent = kv_lines_reach(pair.prefill, KV_SENT, sent0 + n) - sent0
    print(f"KV over kvbridge: {sent} requests sent by the prefill, {received} received by the decode")
    assert received == n, pair.decode.tail(3000)
    assert sent == n, pair.prefill.tail(3000)


def test_a_prefill_killed_mid_transfer_is_a_clear_error_at_once_and_a_restarted_one_serves(proxy, pair, references, env):
    prefill, decode = pair.prefill, pair.decode
    path, doc = openai("completions", env.model, LONG_PROMPT, stream=False)
    steps0, sent0 = count_lines(prefill, PREFILL_STEP), count_lines(prefill, KV_SENT)
    received0 = count_lines(decode, KV_RECEIVED)
    cancelled0 = proxy.counter("kvbridge_proxy_decodes_cancelled_total")
    decode_failed0 = count_lines(decode, DECODE_ROOM_FAILED)
    box: dict = {}

    def send():
        box["r"] = post(proxy.url + path, doc, timeout=PROXY_TIMEOUT_S + 60)
        box["at"] = time.monotonic()

    t = threading.Thread(target=send, daemon=True)
    t.start()
    # Two of the prompt's prefill steps logged: the first chunk's KV has been handed to the
    # backend, and about a hundred more are to come.
    deadline = time.monotonic() + PROXY_TIMEOUT_S
    while count_lines(prefill, PREFILL_STEP) < steps0 + 2:
        assert t.is_alive(), f"the request ended before its prefill ran: {box.get('r')}"
        assert time.monotonic() < deadline, f"the prefill never ran the long prompt:\n{prefill.tail(3000)}"
        time.sleep(0.02)
    prefill.kill()
    killed = time.monotonic()
    t.join(PROXY_TIMEOUT_S + 90)
    assert not t.is_alive(), "the request through the proxy hangs after its prefill died"
    status, body = box["r"]
    took = box["at"] - killed
    steps = count_lines(prefill, PREFILL_STEP) - steps0
    print(f"\nprefill killed after {steps} prefill steps of the long prompt: HTTP {status} after {took:.2f} s: {body}")
    # mid-transfer: the prefill had not sent the request's last chunk when it died
    assert count_lines(prefill, KV_SENT) == sent0, "the long prompt's KV was all sent before the kill"
    assert status == 502 and body["error"]["code"] == "prefill_failed", body
    assert took < ERROR_WITHIN_S, took
    # The decode request ended too: the proxy cancelled it (closed its connection), or the
    # decode failed it first, its kvbridge connection to the prefill lost (a race: the
    # proxy then reports the prefill's failure all the same).
    cancelled = proxy.counter("kvbridge_proxy_decodes_cancelled_total") - cancelled0
    decode_failed = count_lines(decode, DECODE_ROOM_FAILED) - decode_failed0
    print(f"the decode request: cancelled by the proxy {cancelled:.0f}, failed by the decode {decode_failed}")
    assert cancelled in (0, 1) and decode_failed in (0, 1) and cancelled + decode_failed >= 1, decode.tail(3000)
    # the proxy logged which prefiller failed; the decode got no KV for it and stays up
    failures = [ln for ln in proxy.tail(10**6).splitlines() if "prefill_failed" in ln]
    assert failures and f"127.0.0.1:{prefill.port}" in failures[-1], proxy.tail(3000)
    print(f"proxy's log: {failures[-1][-300:]}")
    assert count_lines(decode, KV_RECEIVED) == received0
    assert http_status(f"{decode.url}/health") == 200

    took = pair.restart_prefill()
    readmitted = proxy.wait_healthy()
    print(f"prefill restarted on the same ports, healthy in {took:.0f} s; the proxy took it back in {readmitted:.1f} s")
    got = openai_answer(proxy.url, "chat", env.model, PROXY_PROMPTS[0], stream=True, timeout=PROXY_TIMEOUT_S + 60)
    diff = assert_same_answer(got, references.openai[("chat", 0)])
    print(f"  after the restart: {got[0]!r}: equal to the single server (top logprobs within {diff:.4f})")
    assert kv_lines_reach(decode, KV_RECEIVED, received0 + 1) == received0 + 1, decode.tail(3000)
