"""SGLang's own router (``sglang_router.launch_router --pd-disaggregation``, sglang-router
0.3.2) in front of the same prefill + decode pair over kvbridge (pool.py): the backend needs
nothing of the router but SGLang's bootstrap fields, so OpenAI completions and chat, whole and
streamed, equal the single server's answers, each request's KV counted once as sent by the
prefill and once as received by the decode."""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import pytest

from bodies import CASES, PROXY_PROMPTS, assert_same_answer, openai_answer
from sglang_servers import KV_RECEIVED, KV_SENT, Proc, count_lines, free_ports, http_status, kv_lines_reach

START_DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def router(env, pair):
    if importlib.util.find_spec("sglang_router") is None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(
            "sglang-router not installed (scripts/test-sglang.sh installs it)"
        )
    port = free_ports(1)[0]
    argv = [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", pair.prefill.url, str(pair.bport), "--decode", pair.decode.url,
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    r = Proc("sglang-router", argv, env.logs / "sglang-router.log")
    r.url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        # /health answers before the router has registered its workers; /readiness after
        while http_status(f"{r.url}/readiness") != 200:
            if not r.alive():
                raise RuntimeError(f"sglang-router exited ({r.p.returncode}):\n{r.tail()}")
            if time.monotonic() - t0 > START_DEADLINE_S:
                raise TimeoutError(f"sglang-router not ready in {START_DEADLINE_S} s:\n{r.tail()}")
            time.sleep(0.2)
        print(f"\nSGLang's router ready in {time.monotonic() - t0:.1f} s")
        yield r
    finally:
        r.kill()


def test_sglangs_router_fronts_the_same_pair_equal_to_a_single_server(router, pair, references, env):
    received0 = count_lines(pair.decode, KV_RECEIVED)
    sent0 = count_lines(pair.prefill, KV_SENT)
    for api, i, stream in CASES:
        got = openai_answer(router.url, api, env.model, PROXY_PROMPTS[i], stream)
        diff = assert_same_answer(got, references.openai[(api, i)])
        how = "streamed" if stream else "whole"
        print(f"  {api} {how} {got[0]!r}: equal to the single server (top logprobs within {diff:.4f})")
    n = len(CASES)
    received = kv_lines_reach(pair.decode, KV_RECEIVED, received0 + n) - received0
    sent = kv_lines_reach(pair.prefill, KV_SENT, sent0 + n) - sent0
    print(f"KV over kvbridge: {sent} requests sent by the prefill, {received} received by the decode")
    assert received == n, pair.decode.tail(3000)
    assert sent == n, pair.prefill.tail(3000)
