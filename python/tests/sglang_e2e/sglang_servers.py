"""SGLang servers on CPU for the kvbridge backend's end-to-end tests: a single server, a
prefill + decode pair over ``--disaggregation-transfer-backend kvbridge`` started with
``python -m kvbridge.sglang.launch_server``, and ``kvbridge proxy --flow sglang`` in front of
the pair. Every process runs in its own process group, killed whole; readiness is polled
(/health, the proxy's printed address) with a deadline. The backend's counts are read from
the servers' logs: one line per request on each side."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import importlib.util

from standins import PREFILL_ENV

HERE = Path(__file__).resolve().parent


def _vllm_e2e_servers():
    # vllm_e2e/servers.py's process and port helpers (it imports nothing of vLLM)
    spec = importlib.util.spec_from_file_location("vllm_e2e_servers", HERE.parent / "vllm_e2e" / "servers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_v = _vllm_e2e_servers()
Proc, free_ports, kvbridge_binary, http_status = _v.Proc, _v.free_ports, _v.kvbridge_binary, _v.http_status
post, post_stream, choice_tokens = _v.post, _v.post_stream, _v.choice_tokens

START_DEADLINE_S = 420.0  # SGLang on the loaded 2-core host: about 65 s alone, more in pairs
SECRET = "sglang-e2e-secret-0123456789abcdef"
#: Prompt tokens per prefill step, on every server alike (the same chunks, the same numerics):
#: small, so a long prompt's KV leaves the prefill chunk by chunk over many steps, which the
#: kill test needs to land mid-transfer.
CHUNK_TOKENS = 32


def http_json(url: str, doc: dict | None = None, timeout: float = 120.0) -> tuple[int, dict | str]:
    data = None if doc is None else json.dumps(doc).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")
        status = e.code
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


class SglangServer(Proc):
    def __init__(
        self, name: str, model: Path, port: int, logdir: Path, standins: Path, *extra: str,
        kvbridge: bool = False, env: dict[str, str] | None = None,
    ):  # fmt: skip
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        module = "kvbridge.sglang.launch_server" if kvbridge else "sglang.launch_server"
        argv = [
            sys.executable, "-m", module, "--model-path", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--max-total-tokens", "8192", "--dtype", "bfloat16",
            "--random-seed", "0", "--disable-cuda-graph", "--log-level", "info",
            "--chunked-prefill-size", str(CHUNK_TOKENS), *extra,
        ]  # fmt: skip
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(standins), os.environ.get("PYTHONPATH", "")]),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "SGLANG_DISABLE_REQUEST_LOGGING": "1",
            "KVBRIDGE_SECRET": SECRET,
            **(env or {}),
        }
        super().__init__(name, argv, logdir / f"{name}.log", env)

    def health(self) -> int:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status
        except (urllib.error.URLError, OSError, ValueError):
            return 0


def wait_healthy(servers: list[SglangServer], deadline_s: float = START_DEADLINE_S) -> float:
    t0 = time.monotonic()
    pending = list(servers)
    while pending:
        for s in list(pending):
            if not s.alive():
                raise RuntimeError(f"SGLang server {s.name} exited ({s.p.returncode}):\n{s.tail()}")
            if s.health() == 200:
                pending.remove(s)
        if not pending:
            break
        if time.monotonic() - t0 > deadline_s:
            raise TimeoutError(f"SGLang servers {[s.name for s in pending]} not healthy in {deadline_s} s:\n" + "\n".join(s.tail(3000) for s in pending))
        time.sleep(0.5)
    return time.monotonic() - t0


def prefill_server(model: Path, logdir: Path, standins: Path, port: int, bport: int, name: str = "prefill") -> SglangServer:
    return SglangServer(
        name, model, port, logdir, standins, "--disaggregation-mode", "prefill",
        "--disaggregation-transfer-backend", "kvbridge", "--disaggregation-bootstrap-port", str(bport),
        kvbridge=True, env=PREFILL_ENV,
    )  # fmt: skip


def pd_pair(model: Path, logdir: Path, standins: Path) -> tuple[SglangServer, SglangServer, int]:
    pport, dport, bport = free_ports(3)
    prefill = prefill_server(model, logdir, standins, pport, bport)
    decode = SglangServer(
        "decode", model, dport, logdir, standins, "--disaggregation-mode", "decode",
        "--disaggregation-transfer-backend", "kvbridge",
        "--disaggregation-decode-retraction-backup", "cpu_tensor", kvbridge=True,
    )  # fmt: skip
    return prefill, decode, bport


def count_lines(server: Proc, pattern: str) -> int:
    """How many lines of ``server``'s log match ``pattern`` (a regular expression)."""
    return len(re.findall(pattern, server.tail(10**8), re.M))


def kv_lines_reach(server, pattern: str, want: int, within_s: float = 10.0) -> int:
    """The count of ``pattern`` lines in ``server``'s log once it reaches ``want``, or after
    ``within_s`` (a line is written as the request ends, maybe after the answer)."""
    deadline = time.monotonic() + within_s
    while True:
        n = count_lines(server, pattern)
        if n >= want or time.monotonic() > deadline:
            return n
        time.sleep(0.2)


#: The decode's line per request whose KV came over kvbridge (manager.py), the prefill's per
#: request whose KV it sent, and SGLang's own line per prefill step (chunk).
KV_RECEIVED = r"kvbridge: room \d+: KV received over kvbridge"
KV_SENT = r"kvbridge: room \d+: KV sent over kvbridge"
PREFILL_STEP = r"Prefill batch.*#new-token: [1-9]"
#: The decode's line for a request the backend failed (its prefill lost, a failure notice).
DECODE_ROOM_FAILED = r"kvbridge: room \d+ failed: "


class SglangProxy(Proc):
    """``kvbridge proxy --flow sglang`` in front of a prefill and a decode server, on a free
    port (it prints its bound address first)."""

    def __init__(self, binary: Path, prefill: SglangServer, bport: int, decode: SglangServer, logdir: Path, *extra: str):
        argv = [
            str(binary), "proxy", "--flow", "sglang", "--host", "127.0.0.1", "--port", "0",
            "--prefill", prefill.url, str(bport), "--decode", decode.url, *extra,
        ]  # fmt: skip
        self.name = "proxy"
        self.out_path = logdir / "proxy.out"
        self._out = open(self.out_path, "wb")
        self.log_path = logdir / "proxy.log"
        self._log = open(self.log_path, "wb")
        self.p = subprocess.Popen(argv, stdout=self._out, stderr=self._log, start_new_session=True)
        deadline = time.monotonic() + 60
        while not self.out_path.read_text().strip():
            if not self.alive():
                raise RuntimeError(f"kvbridge proxy exited ({self.p.returncode}):\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvbridge proxy printed no address in 60 s:\n{self.tail()}")
            time.sleep(0.05)
        self.url = "http://" + json.loads(self.out_path.read_text().splitlines()[0])["http"]

    def kill(self) -> None:
        super().kill()
        self._out.close()

    def wait_healthy(self, deadline_s: float = 60.0) -> float:
        """Until the proxy's /health is 200 (a healthy prefill and decode behind it)."""
        t0 = time.monotonic()
        while http_status(f"{self.url}/health") != 200:
            if not self.alive():
                raise RuntimeError(f"kvbridge proxy exited:\n{self.tail()}")
            if time.monotonic() - t0 > deadline_s:
                raise TimeoutError(f"the proxy not healthy in {deadline_s} s:\n{self.tail()}")
            time.sleep(0.1)
        return time.monotonic() - t0

    def counter(self, name: str) -> float:
        """One of the proxy's Prometheus counters (0 when absent)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
            text = r.read().decode()
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0
