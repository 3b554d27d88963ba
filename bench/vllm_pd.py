"""TTFT of 1P1D vLLM CPU through ``kvbridge proxy --flow vllm``: KvbridgeConnector against
NixlConnector, both pairs of servers up at once (same model, prompts and proxy build), runs
alternated between them so drift on a shared host hits both. Driven by bench/vllm-pd.sh.

TTFT: from sending a streamed completion to the proxy to its first content chunk (the proxy
prefills on the prefiller, the decoder pulls the KV, then makes the first token). KV GiB/s:
the decoder's own transfer stats as vLLM logs them each second, median over the intervals
that moved KV (KvbridgeConnector: bytes_read over summed load time, from the load's start
to its last read, connect included; NixlConnector: its "Throughput (MB/s)", total bytes over
summed transfer time as NIXL's telemetry measures it).

Any failed request (non-200, an error event, no token) fails the run: no figures printed.
So does a request whose decoder did not read its KV: the kvbridge decoder's
`vllm:kvbridge_loads_ok_total` (its /metrics; vLLM's log drops idle intervals' counts) short
of the requests sent, a prefill's blocks freed at their lease, NixlConnector's expired or
invalid blocks (the servers' logs).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python/tests/vllm_e2e"))

from servers import (  # noqa: E402
    Proxy,
    VllmServer,
    free_ports,
    kvbridge_binary,
    kvbridge_config,
    kvbridge_counters,
    nixl_config,
    wait_healthy,
)
from tiny_model import WORDS, build  # noqa: E402


class Failed(RuntimeError):
    pass


def ttft(url: str, text: str, max_tokens: int) -> float:
    doc = {"model": "tiny", "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(doc).encode(), {"content-type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=120) as r:
        if r.status != 200:
            raise Failed(f"HTTP {r.status}")
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise Failed(f"error event: {ev}")
            for c in ev.get("choices", []):
                if c.get("finish_reason") == "error":
                    raise Failed(f"finish_reason error: {ev}")
                if c.get("text") and first is None:
                    first = time.perf_counter() - t0
    if first is None:
        raise Failed("no token")
    return first


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=900)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--connectors", default="kvbridge,nixl")
    a = ap.parse_args()

    work = a.work
    (work / "logs").mkdir(parents=True, exist_ok=True)
    model = build(work / "model", layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim)
    kv_bytes_per_token = a.layers * a.kv_heads * a.head_dim * 2 * 2  # K and V, bf16
    binary = kvbridge_binary()
    if binary is None:
        print("FAILED: no kvbridge binary", file=sys.stderr)
        return 1
    names = a.connectors.split(",")
    procs: list = []
    pairs: dict[str, tuple[VllmServer, VllmServer, Proxy]] = {}
    mml = a.prompt_tokens + a.max_tokens + 64
    try:
        servers = []
        for name in names:
            pp, dp, kvp, nixl_p, nixl_d = free_ports(5)
            if name == "kvbridge":
                pcfg, dcfg = kvbridge_config("kv_producer", kvp), kvbridge_config("kv_consumer", 0)
                penv, denv = {}, {}
            elif name == "nixl":
                pcfg, dcfg = nixl_config("kv_producer"), nixl_config("kv_consumer")
                penv = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl_p)}
                denv = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl_d)}
            else:
                raise SystemExit(f"unknown connector {name}")
            stats = {"VLLM_LOG_STATS_INTERVAL": "1"}
            p = VllmServer(f"{name}-prefill", model, pp, work / "logs", pcfg, {**penv, **stats}, max_model_len=mml)
            d = VllmServer(f"{name}-decode", model, dp, work / "logs", dcfg, {**denv, **stats}, max_model_len=mml)
            procs += [p, d]
            servers += [p, d]
            pairs[name] = (p, d, None)  # type: ignore[assignment]
        started = wait_healthy(servers)
        print(f"# {len(servers)} vLLM servers healthy in {started:.0f} s", flush=True)
        for name in names:
            p, d, _ = pairs[name]
            logdir = work / "logs" / f"proxy-{name}"
            logdir.mkdir(exist_ok=True)
            proxy = Proxy(binary, [p.port], [d.port], logdir)
            procs.append(proxy)
            proxy.wait_healthy()
            pairs[name] = (p, d, proxy)

        rng = random.Random(0)

        def text() -> str:
            return " ".join(rng.choice(WORDS) for _ in range(a.prompt_tokens))

        for name in names:  # warm-up: connect, first-request compilation
            for _ in range(3):
                ttft(pairs[name][2].url, text(), a.max_tokens)
        results: dict[str, list[float]] = {n: [] for n in names}
        for run in range(a.runs):
            for name in names if run % 2 == 0 else list(reversed(names)):
                samples = [ttft(pairs[name][2].url, text(), a.max_tokens) for _ in range(a.requests)]
                p50 = statistics.median(samples)
                results[name].append(p50)
                print(f"run {run + 1} {name}: TTFT p50 {p50 * 1e3:.1f} ms over {len(samples)} requests "
                      f"(min {min(samples) * 1e3:.1f}, max {max(samples) * 1e3:.1f})", flush=True)  # fmt: skip
        time.sleep(2.5)  # one more stats interval, so the last transfers reach the logs
        # the kvbridge decoder's own count of its loads (vLLM's log drops idle intervals)
        loads_ok = {
            name: kvbridge_counters(pairs[name][1].url).get("vllm:kvbridge_loads_ok_total", 0)
            for name in names
            if name == "kvbridge"
        }
    except Failed as e:
        print(f"FAILED: a request failed ({e}); no figures", file=sys.stderr)
        return 1
    finally:
        for p in procs:
            p.kill()

    # A request whose decoder did not read its KV (recomputed it, or read blocks its
    # prefiller had already freed) is a failed request for this benchmark, though HTTP said 200.
    sent = 3 + a.runs * a.requests
    problems = []
    for name in names:
        p, d, _ = pairs[name]
        problems += kv_not_moved(
            name, p.log_path.read_text(errors="replace"), d.log_path.read_text(errors="replace"), sent,
            loads_ok.get(name, 0),
        )
    if problems:
        for msg in problems:
            print(f"FAILED: {msg}", file=sys.stderr)
        print("FAILED: some requests did not move their KV; no figures", file=sys.stderr)
        return 1

    print(f"\nprompt {a.prompt_tokens} tokens, KV {kv_bytes_per_token * a.prompt_tokens / 2**20:.2f} MiB per request "
          f"({a.layers} layers x {a.kv_heads} KV heads x head_dim {a.head_dim}, bf16), max_tokens {a.max_tokens}, "
          f"{a.runs} runs x {a.requests} requests, sequential")  # fmt: skip
    print("| connector | TTFT p50, median of runs (ms) | runs' p50 min-max (ms) | KV GiB/s (decoder's stats) |")
    print("|---|---|---|---|")
    for name in names:
        runs = results[name]
        log = pairs[name][1].log_path.read_text(errors="replace")
        print(f"| {name} | {statistics.median(runs) * 1e3:.1f} | {min(runs) * 1e3:.1f}-{max(runs) * 1e3:.1f} | {gib_per_s(name, log)} |")
    return 0


def kv_not_moved(name: str, prefill_log: str, decode_log: str, sent: int, loads: float) -> list[str]:
    """What the servers say about requests that answered 200 without moving their KV (the
    kvbridge decoder: its ``vllm:kvbridge_loads_ok_total``, ``loads``)."""
    out = []
    if name == "kvbridge":
        if loads < sent:
            out.append(f"kvbridge: the decoder loaded KV for {int(loads)} of {sent} requests")
        expired = len(re.findall(r"no decoder read request .* within kvbridge_lease_s", prefill_log))
        if expired:
            out.append(f"kvbridge: {expired} prefills' blocks were freed at their lease, unread")
    else:
        expired = len(re.findall(r"Releasing expired KV blocks", prefill_log))
        invalid = len(re.findall(r"Potentially invalid KV blocks", prefill_log))
        if expired or invalid:
            out.append(f"nixl: {expired} prefills' blocks freed at their lease, {invalid} reads of freed blocks")
    return out


def gib_per_s(name: str, log: str) -> str:
    vals = []
    if name == "kvbridge":
        vals = [float(x) for x in re.findall(r"KV Transfer metrics: .*load_GiB_per_s=([0-9.]+)", log)]
    else:
        # NixlConnector's "MB" are MiB; its throughput is total MiB over summed transfer time
        vals = [float(x) / 1024 for x in re.findall(r"Throughput \(MB/s\)=([0-9.]+)", log) if float(x) > 0]
    if not vals:
        return "n/a"
    return f"{statistics.median(vals):.3f} (median of {len(vals)} intervals, {min(vals):.3f}-{max(vals):.3f})"


if __name__ == "__main__":
    raise SystemExit(main())
