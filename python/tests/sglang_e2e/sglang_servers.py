"""SGLang servers on CPU for the kvbridge backend's end-to-end tests: a single server, and a
prefill + decode pair over ``--disaggregation-transfer-backend kvbridge`` started with
``python -m kvbridge.sglang.launch_server``. Every server runs in its own process group,
killed whole; readiness is polled on /health with a deadline."""

from __future__ import annotations

import json
import os
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
Proc, free_ports = _v.Proc, _v.free_ports

START_DEADLINE_S = 420.0  # SGLang on the loaded 2-core host: about 65 s alone, more in pairs
SECRET = "sglang-e2e-secret-0123456789abcdef"


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
            "--random-seed", "0", "--disable-cuda-graph", "--log-level", "info", *extra,
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
