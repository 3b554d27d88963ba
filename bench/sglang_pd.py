"""TTFT and transfer time of 1P1D SGLang CPU over each transfer backend: kvbridge against
SGLang's own NIXL and Mooncake backends, on the same locally made random-weight Llama, the
same prompts and the same server flags, each pair behind SGLang's router (sglang-router, PD
mode) and the kvbridge pair also behind ``kvbridge proxy --flow sglang``. One pair of servers
is up at a time: each run starts a backend's pair, measures it and stops it, then the next;
runs alternate the order, so drift on the shared host hits every backend and no pair's
threads compete with another's. Driven by bench/sglang-pd.sh.

Transfer time: per timed request, from the decode's receiver handing its page indices to the
backend (``send_metadata``) to its first ``poll()`` that says Success, timed by
bench/sglang_transfer_timer.py around each backend's receiver class (and sender class, on
the prefill: its tail, from the prefill's last chunk handed to the backend to that Success).
The same span for every backend, measured by the same code outside them.

TTFT: from sending a streamed completion to the front (router or proxy) to its first content
chunk.

Any failed request (non-200, an error event, no token), any answer that differs from a single
SGLang server's for the same prompt (greedy), any timed request whose transfer the timer did
not see succeed, and for kvbridge any request not counted by both servers' "KV sent/received
over kvbridge" lines fails the benchmark: FAILED, no figure.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python/tests/vllm_e2e"))
sys.path.insert(0, str(ROOT / "python/tests/sglang_e2e"))

import standins  # noqa: E402
from servers import Proc, free_ports, http_status, kvbridge_binary  # noqa: E402
from sglang_servers import KV_RECEIVED, KV_SENT, SECRET, SglangProxy, count_lines, kv_lines_reach  # noqa: E402
from tiny_model import WORDS, build  # noqa: E402

import sglang_transfer_timer as timer  # noqa: E402

BENCH = Path(__file__).resolve().parent
START_DEADLINE_S = 600.0
ROUTER_DEADLINE_S = 120.0
REQUEST_TIMEOUT_S = 180.0
#: how long the timer's events of a finished request may take to reach their files
EVENTS_WITHIN_S = 15.0
#: requests sent to each pair and front before the timed ones (connections, first compile)
WARM_UP = 2
#: each backend's environment on both servers, what a user of it sets on a CPU host
BACKEND_ENV = {
    "kvbridge": {"KVBRIDGE_SECRET": SECRET},
    "nixl": {"KVBRIDGE_BENCH_NIXL_DRAM": "1"},
    # SGLang's Mooncake engine over TCP (no RDMA device here)
    "mooncake": {"MC_FORCE_TCP": "1", "MOONCAKE_PROTOCOL": "tcp", "KVBRIDGE_BENCH_MOONCAKE_CPU": "1"},
}


class Failed(RuntimeError):
    pass


class Server(Proc):
    """One SGLang server through bench/sglang_launch.py, with the e2e tests' CPU flags."""

    def __init__(self, name: str, a, port: int, logdir: Path, extra: list[str], env: dict[str, str], core: str | None):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        argv = [
            sys.executable, "-m", "sglang_launch", "--model-path", str(a.model), "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--max-total-tokens", str(a.max_total_tokens),
            "--dtype", "bfloat16", "--random-seed", "0", "--disable-cuda-graph", "--log-level", "info",
            "--chunked-prefill-size", str(a.chunk_tokens), "--disable-radix-cache", *extra,
        ]  # fmt: skip
        if core is not None:  # each server on a core of its own, as on two hosts
            argv = ["taskset", "-c", core, *argv]
        path = os.pathsep.join(filter(None, [str(a.standins), str(BENCH), os.environ.get("PYTHONPATH")]))
        full = {
            **os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "SGLANG_DISABLE_REQUEST_LOGGING": "1", **standins.PREFILL_ENV, **env,
        }  # fmt: skip
        super().__init__(name, argv, logdir / f"{name}.log", full)


def wait_ready(procs: list, path: str, deadline_s: float) -> float:
    """Until every one of ``procs`` answers 200 at ``path``; the seconds it took."""
    t0 = time.monotonic()
    pending = list(procs)
    while pending:
        for p in list(pending):
            if not p.alive():
                raise Failed(f"{p.name} exited ({p.p.returncode}):\n{p.tail()}")
            if http_status(p.url + path) == 200:
                pending.remove(p)
        if pending and time.monotonic() - t0 > deadline_s:
            tails = "\n".join(p.tail(3000) for p in pending)
            raise Failed(f"{[p.name for p in pending]} not ready in {deadline_s} s:\n{tails}")
        if pending:
            time.sleep(0.5)
    return time.monotonic() - t0


def router(a, prefill: Server, bport: int, decode: Server, logdir: Path) -> Proc:
    port = free_ports(1)[0]
    argv = [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", prefill.url, str(bport), "--decode", decode.url, "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    r = Proc("sglang-router", argv, logdir / "sglang-router.log")
    r.url = f"http://127.0.0.1:{port}"
    return r


def completion(url: str, model: Path, text: str, max_tokens: int) -> tuple[float, str]:
    """Seconds to the first content chunk of a streamed greedy completion, and its text."""
    doc = {
        "model": str(model), "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True,
    }  # fmt: skip
    headers = {"content-type": "application/json"}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(doc).encode(), headers)
    t0 = time.perf_counter()
    first, answer = None, []
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
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
    except (OSError, ValueError) as e:  # HTTP errors, refused, timeouts, a bad event
        raise Failed(f"{type(e).__name__}: {e}") from e
    if first is None:
        raise Failed("no token")
    return first, "".join(answer)


def reference_answers(a, prompts: list[str], logs: Path) -> dict[str, str]:
    """A single SGLang server's answer (no PD, no timer) to every prompt."""
    s = Server("single", a, free_ports(1)[0], logs, [], {}, None)
    try:
        print(f"# single server healthy in {wait_ready([s], '/health', START_DEADLINE_S):.0f} s", flush=True)
        return {p: completion(s.url, a.model, p, a.max_tokens)[1] for p in prompts}
    finally:
        s.kill()


def start_pair(name: str, a, logs: Path, timer_dirs: dict[str, Path]) -> tuple[Server, Server, int]:
    pport, dport, bport = free_ports(3)
    env = BACKEND_ENV[name]
    pin = (os.cpu_count() or 1) >= 2 and a.pin
    # the same policy on both servers: SGLang's decode refuses a prefill whose policy differs
    common = ["--disaggregation-transfer-backend", name, "--disaggregation-decode-allocation-policy", a.policy]
    penv, denv = dict(env), dict(env)
    if timer_dirs:
        penv[timer.ENV], denv[timer.ENV] = str(timer_dirs["prefill"]), str(timer_dirs["decode"])
    prefill = Server(
        f"{name}-prefill", a, pport, logs,
        [*common, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bport)],
        penv, "0" if pin else None,
    )  # fmt: skip
    decode = Server(
        f"{name}-decode", a, dport, logs,
        [*common, "--disaggregation-mode", "decode", "--disaggregation-decode-retraction-backup", "cpu_tensor"],
        denv, "1" if pin else None,
    )  # fmt: skip
    return prefill, decode, bport


def measure(front: str, url: str, a, prompts: list[str], refs: dict[str, str], timer_dirs: dict[str, Path]) -> dict:
    """The warm-up and timed requests through one front; their TTFTs, answers checked against
    the single server's, and the timer's spans of the timed ones."""
    for text in prompts[:WARM_UP]:
        check(front, text, completion(url, a.model, text, a.max_tokens)[1], refs)
    since = time.monotonic()
    samples, answers = [], []
    for text in prompts[WARM_UP:]:
        first, answer = completion(url, a.model, text, a.max_tokens)
        check(front, text, answer, refs)
        samples.append(first)
        answers.append(answer)
    spans: list[dict] = []
    if timer_dirs:
        spans = wait_spans([str(timer_dirs["decode"]), str(timer_dirs["prefill"])], since, len(samples), front)
    return {
        "samples": samples, "spans": spans,
        "answers": hashlib.sha256("\x00".join(answers).encode()).hexdigest()[:16],
    }  # fmt: skip


def check(front: str, prompt: str, answer: str, refs: dict[str, str]) -> None:
    if answer != refs[prompt]:
        raise Failed(f"{front}: answer {answer!r} differs from the single server's {refs[prompt]!r}")


def wait_spans(folders: list[str], since: float, n: int, front: str) -> list[dict]:
    """The timer's spans of the ``n`` requests timed since ``since``, once all are there."""
    deadline = time.monotonic() + EVENTS_WITHIN_S
    while True:
        spans, problems = timer.transfer_spans(folders, since)
        if len(spans) == n and not problems:
            return spans
        if time.monotonic() > deadline:
            raise Failed(f"{front}: transfer timer: {len(spans)} of {n} transfers seen; {'; '.join(problems)}")
        time.sleep(0.2)


def run_backend(name: str, run: int, a, prompts: list[str], refs: dict[str, str], binary: Path | None) -> dict:
    """Starts one backend's pair, its router (and for kvbridge the proxy), measures each
    front, stops them all. Raises Failed on any failed or wrong request."""
    logs = a.work / "logs" / f"run{run}-{name}"
    logs.mkdir(parents=True, exist_ok=True)
    timer_dirs = {}
    if a.timer == "on":
        timer_dirs = {role: logs / f"timer-{role}" for role in ("prefill", "decode")}
        for d in timer_dirs.values():
            d.mkdir()
    load_at_start = load_average()
    procs: list = []
    out: dict = {"fronts": {}, "load": load_at_start}
    try:
        prefill, decode, bport = start_pair(name, a, logs, timer_dirs)
        procs += [prefill, decode]
        out["healthy_s"] = wait_ready([prefill, decode], "/health", START_DEADLINE_S)
        r = router(a, prefill, bport, decode, logs)
        procs.append(r)
        wait_ready([r], "/readiness", ROUTER_DEADLINE_S)  # /health answers before it has workers
        out["fronts"]["router"] = measure(f"run {run} {name} router", r.url, a, prompts, refs, timer_dirs)
        if name == "kvbridge" and a.proxy and binary is not None:
            # a server on one loaded core can take over a second to answer /health while it
            # computes: the benchmark measures the backends, not the health check's ejections
            px = SglangProxy(
                binary, prefill, bport, decode, logs, "--prefill-timeout", "180", "--decode-timeout", "180",
                "--health-timeout", "10",
            )  # fmt: skip
            procs.append(px)
            px.wait_healthy()
            out["fronts"]["proxy"] = measure(f"run {run} {name} proxy", px.url, a, prompts, refs, timer_dirs)
        out["kv_lines"] = kv_over_kvbridge(name, prefill, decode, len(prompts) * len(out["fronts"]))
    finally:
        for p in reversed(procs):
            p.kill()
    return out


def kv_over_kvbridge(name: str, prefill: Server, decode: Server, sent: int) -> str:
    """kvbridge: every request's KV counted by the prefill (sent) and the decode (received)."""
    if name != "kvbridge":
        return "n/a"
    received = kv_lines_reach(decode, KV_RECEIVED, sent)
    pushed = kv_lines_reach(prefill, KV_SENT, sent)
    if received != sent or pushed != sent:
        raise Failed(
            f"kvbridge: {sent} requests, {pushed} 'KV sent' lines (prefill), {received} 'KV received' (decode)"
        )
    return f"{pushed} KV sent, {received} KV received over kvbridge for {sent} requests"


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=900)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--max-total-tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    # default: kvbridge,nixl,mooncake; under prefill_complete kvbridge,mooncake (see below)
    ap.add_argument("--backends", default=None)
    # the kvbridge pair also behind `kvbridge proxy --flow sglang` ("off": the router only)
    ap.add_argument("--proxy", default="on", choices=("on", "off"))
    # "off": the backends' classes as they are, to check the timer changes no answer
    ap.add_argument("--timer", default="on", choices=("on", "off"))
    ap.add_argument("--pin", default="on", choices=("on", "off"))
    # SGLang's --disaggregation-decode-allocation-policy: "early", the decode sends its page
    # indices before the prefill computed; "prefill_complete", after
    ap.add_argument(
        "--decode-allocation-policy", dest="policy", default="early", choices=("early", "prefill_complete")
    )
    a = ap.parse_args()
    if a.backends is None:
        a.backends = "kvbridge,mooncake" if a.policy == "prefill_complete" else "kvbridge,nixl,mooncake"
    if a.policy == "prefill_complete" and "nixl" in a.backends.split(","):
        # its _validate_prefill_complete: Mooncake only (kvbridge.sglang.install() adds kvbridge)
        ap.error("SGLang refuses --disaggregation-decode-allocation-policy prefill_complete with its NIXL backend")
    a.proxy, a.pin = a.proxy == "on", a.pin == "on"
    return a


def main() -> int:
    a = parse()
    (a.work / "logs").mkdir(parents=True, exist_ok=True)
    print(f"# --disaggregation-decode-allocation-policy {a.policy} on both servers of every pair", flush=True)
    a.model = build(a.work / "model", layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim)
    a.standins = standins.write(a.work / "standins")
    binary = kvbridge_binary()
    if a.proxy and binary is None:
        print("FAILED: no kvbridge binary (cargo build --release -p kvbridge-cli, or KVBRIDGE_BIN)", file=sys.stderr)
        return 1
    names = a.backends.split(",")
    per_run = []
    for run in range(1, a.runs + 1):
        rng = random.Random(run)
        n = WARM_UP + a.requests
        per_run.append([" ".join(rng.choice(WORDS) for _ in range(a.prompt_tokens)) for _ in range(n)])
    results: dict[str, list[dict]] = {n: [] for n in names}
    try:
        refs = reference_answers(a, [p for ps in per_run for p in ps], a.work / "logs")
        for run, prompts in enumerate(per_run, 1):
            for name in names if run % 2 == 1 else list(reversed(names)):
                r = run_backend(name, run, a, prompts, refs, binary)
                results[name].append(r)
                print_run(name, run, r)
    except Failed as e:
        print(f"FAILED: {e}; no figures", file=sys.stderr)
        return 1
    kib = a.layers * a.kv_heads * a.head_dim * 2 * 2 * a.prompt_tokens / 1024
    print(f"\nprompt {a.prompt_tokens} tokens, KV {kib:.0f} KiB per request ({a.layers} layers x {a.kv_heads} KV heads "
          f"x head_dim {a.head_dim}, bf16), chunked prefill {a.chunk_tokens} tokens, max_tokens {a.max_tokens}; "
          f"{a.runs} runs, one pair up at a time, order alternating; {WARM_UP} warm-up + {a.requests} timed "
          f"requests per front and run, sequential, answers equal to a single server's; timer {a.timer}; "
          f"servers pinned to a core each: {a.pin}; decode allocation policy {a.policy}")  # fmt: skip
    if a.timer == "on":
        import sglang_pd_report

        sglang_pd_report.print_tables(names, results)
    return 0


def print_run(name: str, run: int, r: dict) -> None:
    """One backend's run as it ends, so that a later failed run leaves these figures."""
    for front, m in r["fronts"].items():
        s = [v * 1e3 for v in m["samples"]]
        line = (
            f"run {run} {name} via {front}: TTFT p50 {statistics.median(s):.1f} ms "
            f"(min {min(s):.1f}, max {max(s):.1f})"
        )
        for key, what in (("transfer_s", "transfer"), ("tail_s", "tail")):
            vals = [sp[key] * 1e3 for sp in m["spans"] if key in sp]
            if vals:
                line += f"; {what} p50 {statistics.median(vals):.1f} ms ({min(vals):.1f}-{max(vals):.1f})"
        print(line + f"; answers sha256 {m['answers']}", flush=True)
        for sp in m["spans"]:
            print(f"#   {name} {front} room {sp['room']}: " + ", ".join(
                f"{k} {v * 1e3:.1f} ms" if k.endswith("_s") else f"{k} {v}" for k, v in sp.items() if k != "room"
            ), flush=True)  # fmt: skip
    print(f"#   {name}: servers healthy in {r['healthy_s']:.0f} s; load average at start {r['load']}, at end "
          f"{load_average()}; {r['kv_lines']}", flush=True)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
