"""TTFT and load time of 1P1D vLLM CPU through ``kvbridge proxy --flow vllm``:
KvbridgeConnector against NixlConnector (same model, prompts and proxy build), one pair of
servers up at a time: each run starts a pair, measures it and stops it, then the other pair;
the pairs alternate which goes first, so drift on a shared host hits both and neither pair's
threads compete with the other's. Driven by bench/vllm-pd.sh.

Load time: per timed request and decoder rank, from vLLM's scheduler handing the request's
allocated blocks to the connector to the rank's step that reported it finished receiving,
timed by bench/vllm_load_timer.py around the decoder's connector class, the same span for
both connectors (``--load-timer off`` runs without it: the answers' digest and the decoder's
counters printed per run must not change).

TTFT: from sending a streamed completion to the proxy to its first content chunk (the proxy
prefills on the prefiller, the decoder pulls the KV, then makes the first token). KV GiB/s:
the decoder's own transfer stats as vLLM logs them each second, median over the intervals
that moved KV, both as bytes over the time from posting the reads to their completion
(KvbridgeConnector: `read_GiB_per_s`, the reads and the lease check after them;
NixlConnector: its "Throughput (MB/s)", total bytes over summed transfer time as NIXL's
telemetry measures it). KvbridgeConnector's `load_GiB_per_s` counts from the load's start
(load thread, connect, directory) and is not the column.

Any failed request (non-200, an error event, no token) fails the run: no figures printed.
So does a request whose decoder did not read its KV: the kvbridge decoder's
`vllm:kvbridge_loads_ok_total` (its /metrics; vLLM's log drops idle intervals' counts) short
of the requests sent, a prefill's blocks freed at their lease, NixlConnector's expired or
invalid blocks (the servers' logs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
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
    free_run,
    kvbridge_binary,
    kvbridge_config,
    kvbridge_counters,
    nixl_config,
    wait_healthy,
)
from tiny_model import WORDS, build  # noqa: E402
from vllm_load_timer import ENV as TIMER_ENV  # noqa: E402
from vllm_load_timer import KEEP as KEEP_AFFINITY  # noqa: E402
from vllm_load_timer import load_spans, read_events, request_times  # noqa: E402

BENCH = Path(__file__).resolve().parent


class Failed(RuntimeError):
    pass


def ttft(url: str, text: str, max_tokens: int) -> tuple[float, str]:
    """Seconds to the first content chunk, and the whole answer's text."""
    doc = {"model": "tiny", "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(doc).encode(), {"content-type": "application/json"})
    t0 = time.perf_counter()
    try:
        first, answer = _first_token(req, t0)
    except (OSError, ValueError) as e:  # HTTP errors, refused, timeouts, a bad event
        raise Failed(f"{type(e).__name__}: {e}") from e
    if first is None:
        raise Failed("no token")
    return first, answer


def _first_token(req: urllib.request.Request, t0: float) -> tuple[float | None, str]:
    first = None
    answer = []
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
                answer.append(c.get("text") or "")
    return first, "".join(answer)


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def threads(pgid: int) -> list[tuple[str, str, float]]:
    """Every thread of the processes in group ``pgid`` (a server and its engine process) as
    (name, allowed cores, CPU seconds so far)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                base = f"/proc/{pid}/task/{tid}"
                name = Path(f"{base}/comm").read_text().strip()
                cores = next(
                    line.split()[1] for line in Path(f"{base}/status").read_text().splitlines()
                    if line.startswith("Cpus_allowed_list")
                )  # fmt: skip
                fields = Path(f"{base}/stat").read_text().rsplit(")", 1)[1].split()
                out.append((name, cores, (int(fields[11]) + int(fields[12])) / tick))
        except (OSError, ValueError, IndexError, StopIteration):
            continue  # a thread or process that ended meanwhile
    return out


def placement(server) -> str:
    """Where a server's kvbridge threads and its busiest threads run: `name@cores cpu_s`."""
    ts = threads(server.p.pid)
    kvb = sorted((t for t in ts if t[0].startswith("kvb")), key=lambda t: -t[2])
    busiest = sorted(ts, key=lambda t: -t[2])[:3]
    fmt = lambda t: f"{t[0]}@{t[1]} {t[2]:.1f}s"  # noqa: E731
    return f"busiest: {', '.join(map(fmt, busiest))}; kvbridge: {', '.join(map(fmt, kvb)) or 'none'}"


def run_pair(name: str, run: int, a, model: Path, binary: Path, prompts: list[str]) -> dict:
    """Starts one connector's pair of servers and its proxy, sends the warm-up and the timed
    requests, stops them all; what the run measured. Raises Failed on any failed request or
    any request whose KV did not move."""
    logs = a.work / "logs" / f"run{run}-{name}"
    logs.mkdir(parents=True, exist_ok=True)
    pp, dp = free_ports(2)
    # a prefiller's TP rank r listens on its port + r (NixlConnector's side channel too)
    kvp, nixl_p, nixl_d = free_run(a.prefill_tp), free_run(a.prefill_tp), free_run(a.decode_tp)
    if name == "kvbridge":
        lease = {"kvbridge_lease_s": a.lease_s} if a.lease_s else {}
        pcfg, dcfg = kvbridge_config("kv_producer", kvp, **lease), kvbridge_config("kv_consumer", 0, **lease)
        penv, denv = {}, {}
    elif name == "nixl":
        pcfg, dcfg = nixl_config("kv_producer"), nixl_config("kv_consumer")
        if a.lease_s:
            for cfg in (pcfg, dcfg):
                cfg["kv_connector_extra_config"] = {"kv_lease_duration": int(a.lease_s)}
        penv = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl_p)}
        denv = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl_d)}
    else:
        raise SystemExit(f"unknown connector {name}")
    stats = {"VLLM_LOG_STATS_INTERVAL": "1"}
    timer_dir = logs / "load-timer"
    if a.load_timer == "on":
        # the decoder's connector class through bench/vllm_load_timer.py: same name, timed
        timer_dir.mkdir()
        dcfg = {**dcfg, "kv_connector_module_path": "vllm_load_timer"}
        path = os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))
        denv = {**denv, "PYTHONPATH": path, TIMER_ENV: str(timer_dir)}
        if a.keep_affinity:
            # a diagnostic: both servers' connectors through the timer, which puts the thread
            # that built each back on its cores (NixlConnector's CPU worker moves it)
            (logs / "load-timer-prefill").mkdir()
            pcfg = {**pcfg, "kv_connector_module_path": "vllm_load_timer"}
            penv = {**penv, "PYTHONPATH": path, TIMER_ENV: str(logs / "load-timer-prefill"), KEEP_AFFINITY: "1"}
            denv = {**denv, KEEP_AFFINITY: "1"}
    # each server computes on a core of its own, as on two hosts (vLLM CPU would otherwise
    # put both servers' compute threads on the same core: on a 2-core host, core 0)
    # (a TP=2 server computes on both: ../shared/design/cpu-real-engines.md, section 8)
    if (os.cpu_count() or 1) >= 2:
        penv = {**penv, "VLLM_CPU_OMP_THREADS_BIND": "0|1" if a.prefill_tp == 2 else "0"}
        denv = {**denv, "VLLM_CPU_OMP_THREADS_BIND": "0|1" if a.decode_tp == 2 else "1"}
    mml = a.prompt_tokens + a.max_tokens + 64
    ptp, dtp = ["--tensor-parallel-size", str(a.prefill_tp)], ["--tensor-parallel-size", str(a.decode_tp)]
    load_at_start = load_average()
    procs: list = []
    try:
        p = VllmServer(f"{name}-prefill", model, pp, logs, pcfg, {**penv, **stats}, max_model_len=mml, extra_args=ptp)
        procs.append(p)
        d = VllmServer(f"{name}-decode", model, dp, logs, dcfg, {**denv, **stats}, max_model_len=mml, extra_args=dtp)
        procs.append(d)
        started = wait_healthy([p, d])
        # a TP=2 server on 2 cores can take over a second to answer /health while it works:
        # the benchmark measures the connectors, not the health check's ejections
        proxy = Proxy(binary, [p.port], [d.port], logs, "--health-timeout", "10")
        procs.append(proxy)
        proxy.wait_healthy()
        for text in prompts[:WARM_UP]:  # connect, first-request compilation
            ttft(proxy.url, text, a.max_tokens)
        timed_from = time.monotonic()  # the load timer's clock: the timed requests' loads
        sends, answers = [], []
        for text in prompts[WARM_UP:]:
            sends.append(time.monotonic())
            answers.append(ttft(proxy.url, text, a.max_tokens))
        samples = [t for t, _ in answers]
        time.sleep(2.5)  # one more stats interval, so the last transfers reach the log
        # the kvbridge decoder's own count of its loads (vLLM's log drops idle intervals)
        loads_ok = kvbridge_counters(d.url).get("vllm:kvbridge_loads_ok_total", 0) if name == "kvbridge" else 0
        counters = decoder_counters(name, d.url)
        where = {"prefill": placement(p), "decode": placement(d)}
    finally:
        for proc in reversed(procs):
            proc.kill()
    # A request whose decoder did not read its KV (recomputed it, or read blocks its
    # prefiller had already freed) is a failed request for this benchmark, though HTTP said 200.
    # every decoder rank loads its part of each request (vLLM sums its workers' counts)
    problems = kv_not_moved(
        name, p.log_path.read_text(errors="replace"), d.log_path.read_text(errors="replace"),
        len(prompts) * a.decode_tp, loads_ok,
    )  # fmt: skip
    spans: list[dict] = []
    parts: list[dict] = []
    moved: list[dict] = []
    if a.load_timer == "on":
        spans, missing = load_spans(str(timer_dir), timed_from)
        problems += missing
        if len(spans) != a.requests * a.decode_tp:
            problems.append(f"load timer: {len(spans)} loads timed, {a.requests} requests x {a.decode_tp} ranks sent")
        parts = ttft_parts(request_times(str(timer_dir), timed_from), sends, samples)
        moved = [e for e in read_events(str(timer_dir)) if e["ev"] == "affinity"]
    if problems:
        raise Failed(f"run {run} {name}: " + "; ".join(problems))
    return {
        "samples": samples,
        "spans": spans,
        "parts": parts,
        "moved": moved,
        "answers": hashlib.sha256("\x00".join(t for _, t in answers).encode()).hexdigest()[:16],
        "counters": counters,
        "gib_per_s": gib_per_s_values(name, d.log_path.read_text(errors="replace")),
        "load_ms": load_ms_values(name, d.log_path.read_text(errors="replace")),
        "healthy_s": started,
        "load": load_at_start,
        "threads": where,
    }


#: Requests sent to each pair before the timed ones: the first connect, first-request
#: compilation.
WARM_UP = 3


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
    ap.add_argument("--prefill-tp", type=int, default=1, choices=(1, 2))
    ap.add_argument("--decode-tp", type=int, default=1, choices=(1, 2))
    # Both connectors' lease (kvbridge_lease_s, NixlConnector's kv_lease_duration); 0 keeps
    # each default (30 s). NixlConnector's reads outlived its 30 s lease on this host at TP
    # 1 -> 2 and 2 -> 1 (docs/vllm.md), which fails the run: a longer lease lets it finish.
    ap.add_argument("--lease-s", type=int, default=0)
    # the decoder's connector through bench/vllm_load_timer.py (the same load-time span for
    # both connectors); "off" runs the connector class itself, to check the timer changes
    # neither answers nor counters
    ap.add_argument("--load-timer", default="on", choices=("on", "off"))
    # a diagnostic, not the connectors as shipped: the worker thread that builds each
    # connector keeps its cores (NixlConnector's CPU worker moves it to the last core)
    ap.add_argument("--keep-affinity", action="store_true")
    a = ap.parse_args()

    (a.work / "logs").mkdir(parents=True, exist_ok=True)
    model = build(a.work / "model", layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim)
    kv_bytes_per_token = a.layers * a.kv_heads * a.head_dim * 2 * 2  # K and V, bf16
    binary = kvbridge_binary()
    if binary is None:
        print("FAILED: no kvbridge binary", file=sys.stderr)
        return 1
    names = a.connectors.split(",")
    results: dict[str, list[dict]] = {n: [] for n in names}
    try:
        for run in range(1, a.runs + 1):
            # the same prompts for every pair in a run; alternate which pair goes first
            rng = random.Random(run)
            prompts = [" ".join(rng.choice(WORDS) for _ in range(a.prompt_tokens)) for _ in range(WARM_UP + a.requests)]
            for name in names if run % 2 == 1 else list(reversed(names)):
                r = run_pair(name, run, a, model, binary, prompts)
                results[name].append(r)
                print_run(name, run, r)
    except Failed as e:
        print(f"FAILED: {e}; no figures", file=sys.stderr)
        return 1

    print(f"\nprompt {a.prompt_tokens} tokens, KV {kv_bytes_per_token * a.prompt_tokens / 2**20:.2f} MiB per request "
          f"({a.layers} layers x {a.kv_heads} KV heads x head_dim {a.head_dim}, bf16), max_tokens {a.max_tokens}; "
          f"TP {a.prefill_tp} -> {a.decode_tp}; lease {a.lease_s or 'default'} s; "
          f"{a.runs} runs per connector, one pair of servers up at a time, pairs alternating; "
          f"{WARM_UP} warm-up + {a.requests} timed requests per run, sequential; load timer {a.load_timer}"
          + ("; DIAGNOSTIC: worker threads kept on their cores (--keep-affinity)" if a.keep_affinity else "")
          )  # fmt: skip
    print_tables(names, results)
    return 0


def print_run(name: str, run: int, r: dict) -> None:
    """One run of one pair as it ends, so that a later failed run leaves these figures."""
    s = r["samples"]
    print(f"run {run} {name}: TTFT p50 {statistics.median(s) * 1e3:.1f} ms over {len(s)} requests "
          f"(min {min(s) * 1e3:.1f}, max {max(s) * 1e3:.1f}); {spread(r['spans'], 'load_s', 'load')}; "
          f"servers healthy in {r['healthy_s']:.0f} s; load average at start {r['load']}, "
          f"at end {load_average()}", flush=True)  # fmt: skip
    for role, line in r["threads"].items():
        print(f"#   {name} {role} threads (name@cores CPU s): {line}", flush=True)
    print(f"#   {name} answers sha256 {r['answers']}; decoder counters {r['counters']}", flush=True)
    for e in r["moved"]:
        kept = "; the timer moved it back" if e["kept"] else ""
        print(f"#   {name} decoder: the connector moved the worker thread that built it ({e['role']}) "
              f"from cores {e['before']} to {e['after']}{kept}", flush=True)  # fmt: skip
    for pt in r["parts"]:
        print(f"#   {name} TTFT parts: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in pt.items()), flush=True)
    for sp in r["spans"]:
        fields = (f"{k} {v * 1e3:.1f} ms" if k.endswith("_s") else f"{k} {v}" for k, v in sp.items())
        print(f"#   {name} load {sp['req']} rank {sp['rank']}: " + ", ".join(list(fields)[2:]), flush=True)


def ttft_parts(times: list[dict], sends: list[float], samples: list[float]) -> list[dict]:
    """Where each timed request's TTFT went (the requests are sequential, so the decoder's
    n-th arrival is the n-th request): to the decode request's arrival in the decoder's
    scheduler (the proxy and the prefill), to its blocks' allocation, the load (to the last
    decoder rank's report), and from there to the first token reaching the client."""
    out = []
    for t, sent, first in zip(times, sends, samples):
        if "arrive" not in t or "done" not in t:
            continue
        out.append({
            "to_arrive_s": t["arrive"] - sent, "to_alloc_s": t["alloc"] - t["arrive"],
            "load_s": t["done"] - t["alloc"], "to_token_s": sent + first - t["done"],
        })  # fmt: skip
    return out


def spread(spans: list[dict], key: str, what: str) -> str:
    vals = [sp[key] * 1e3 for sp in spans]
    if not vals:
        return f"{what} n/a"
    return f"{what} p50 {statistics.median(vals):.1f} ms (min {min(vals):.1f}, max {max(vals):.1f}, {len(vals)} loads)"


def print_tables(names: list[str], results: dict[str, list[dict]]) -> None:
    """The summary: per connector the load time (the timer's span, every timed request and
    decoder rank of every run), TTFT, the connector's own transfer stats; the load's parts;
    the ratio of the load-time medians."""
    print("| connector | load ms, alloc to finished, p50 (min-max, loads) | TTFT p50, median of runs (ms) "
          "| runs' p50 min-max (ms) | TTFT min-max, all requests (ms) | KV GiB/s, own stats, median of intervals "
          "(min-max) | load ms, own log's span, median of intervals (min-max) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    medians = {}
    for name in names:
        p50s = [statistics.median(r["samples"]) for r in results[name]]
        every = [v for r in results[name] for v in r["samples"]]
        spans = [sp for r in results[name] for sp in r["spans"]]
        loads = [sp["load_s"] * 1e3 for sp in spans]
        medians[name] = statistics.median(loads) if loads else None
        load = f"{statistics.median(loads):.1f} ({min(loads):.1f}-{max(loads):.1f}, {len(loads)})" if loads else "n/a"
        vals = [v for r in results[name] for v in r["gib_per_s"]]
        gib = f"{statistics.median(vals):.3f} ({len(vals)} intervals, {min(vals):.3f}-{max(vals):.3f})" if vals else "n/a"
        ms = [v for r in results[name] for v in r["load_ms"]]
        own = f"{statistics.median(ms):.1f} ({len(ms)} intervals, {min(ms):.1f}-{max(ms):.1f})" if ms else "n/a"
        print(f"| {name} | {load} | {statistics.median(p50s) * 1e3:.1f} | {min(p50s) * 1e3:.1f}-{max(p50s) * 1e3:.1f} "
              f"| {min(every) * 1e3:.1f}-{max(every) * 1e3:.1f} | {gib} | {own} |")  # fmt: skip
    print("\nparts of the load (the timer's events), median (min-max) in ms over every timed load:")
    print("| connector | alloc to metadata on the rank | metadata to reads posted (NIXL) | posted to finished "
          "| steps from metadata to finished | longest gap between two steps |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name in names:
        spans = [sp for r in results[name] for sp in r["spans"]]
        if not spans:
            continue
        cells = [cell(spans, k, 1e3) for k in ("to_meta_s", "to_post_s", "after_post_s")]
        cells += [cell(spans, "steps", 1), cell(spans, "max_step_gap_s", 1e3)]
        print(f"| {name} | {' | '.join(cells)} |")
    print("\nwhere TTFT went, median (min-max) in ms over every timed request:")
    print("| connector | send to decode request in the decoder (proxy, prefill) | to blocks allocated "
          "| load (last rank) | load done to first token at the client |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name in names:
        parts = [pt for r in results[name] for pt in r["parts"]]
        if parts:
            keys = ("to_arrive_s", "to_alloc_s", "load_s", "to_token_s")
            print(f"| {name} | {' | '.join(cell(parts, k, 1e3) for k in keys)} |")
    if medians.get("kvbridge") and medians.get("nixl"):
        ttfts = {n: statistics.median(v for r in results[n] for v in r["samples"]) for n in ("kvbridge", "nixl")}
        print(f"\nkvbridge / NIXL, ratio of medians over every timed request: load time "
              f"{medians['kvbridge'] / medians['nixl']:.3f}, TTFT {ttfts['kvbridge'] / ttfts['nixl']:.3f}")


def cell(spans: list[dict], key: str, scale: float) -> str:
    vals = sorted(sp[key] * scale for sp in spans)
    return f"{statistics.median(vals):.1f} ({vals[0]:.1f}-{vals[-1]:.1f})"


#: counters that count time, which no two runs share
TIMED_SERIES = re.compile(r"seconds|slow_loads|_time_")


def decoder_counters(name: str, url: str) -> dict[str, float]:
    """The decoder's connector counters from its /metrics, less those that count time: the
    same with the load timer as without it (kvbridge: ``vllm:kvbridge_*_total``;
    NixlConnector: its ``vllm:nixl_*`` counters and histograms' counts and sums)."""
    if name == "kvbridge":
        found = kvbridge_counters(url)
    else:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            text = r.read().decode()
        found = {}
        for m in re.finditer(r"^(vllm:nixl_\w+?(?:_sum|_count|_total))\{[^}]*\} ([0-9.e+-]+)$", text, re.M):
            found[m.group(1)] = found.get(m.group(1), 0.0) + float(m.group(2))
    return {k: v for k, v in sorted(found.items()) if not TIMED_SERIES.search(k)}


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


def gib_per_s_values(name: str, log: str) -> list[float]:
    """The decoder's per-interval KV GiB/s as vLLM logged them: bytes over the time from
    posting the reads to their completion (kvbridge: and the lease check after them), as
    NixlConnector measures its transfers."""
    if name == "kvbridge":
        return [float(x) for x in re.findall(r"KV Transfer metrics: .*read_GiB_per_s=([0-9.]+)", log)]
    # NixlConnector's "MB" are MiB; its throughput is total MiB over summed transfer time
    return [float(x) / 1024 for x in re.findall(r"Throughput \(MB/s\)=([0-9.]+)", log) if float(x) > 0]


def load_ms_values(name: str, log: str) -> list[float]:
    """The decoder's per-interval mean load time as vLLM logged it. kvbridge: from the
    scheduler's allocation to the end of the lease check (load thread, session, reads);
    NixlConnector: its "Avg xfer time", from posting the transfer to its completion, which
    leaves out its handshake and its wait for a step: kvbridge's figure is the stricter."""
    if name == "kvbridge":
        return [float(x) for x in re.findall(r"KV Transfer metrics: .*avg_load_ms=([0-9.]+)", log)]
    return [float(x) for x in re.findall(r"Avg xfer time \(ms\)=([0-9.]+)", log) if float(x) > 0]


if __name__ == "__main__":
    raise SystemExit(main())
