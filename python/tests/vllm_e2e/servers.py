"""Real vLLM CPU servers and ``kvbridge proxy --flow vllm`` as subprocesses, for the 1P1D tests
and bench/vllm_pd.py.

Every process starts in its own session, so stopping it (SIGKILL to the process group) also
ends vLLM's engine-core process, where the KV connector's worker lives. Readiness is polled
on ``/health`` with a deadline; nothing sleeps to wait.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

#: vLLM on 2 busy cores reaches /health in 40 s to several minutes.
START_DEADLINE_S = float(os.environ.get("KVBRIDGE_VLLM_START_DEADLINE_S", "900"))


def free_ports(n: int) -> list[int]:
    """``n`` ports free now, below the kernel's ephemeral range when there is room: a port
    there is taken only by an explicit bind, never by some process's outgoing connection
    in the time between this probe and the server's own bind (which failed a benchmark run:
    a NixlConnector prefiller's side channel found its port taken)."""
    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    candidates = list(range(max(1024, low // 2), low))
    random.shuffle(candidates)
    out: list[int] = []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
        if len(out) == n:
            return out
    socks = [socket.socket() for _ in range(n - len(out))]  # no room below the range
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return out + [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_run(n: int) -> int:
    """A free port with the ``n - 1`` after it free too (a TP prefiller's rank r listens on
    its port + r)."""
    for port in free_ports(64):
        if all(_bindable(p) for p in range(port + 1, port + n)):
            return port
    raise RuntimeError(f"no {n} free ports in a row")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def kvbridge_binary() -> Path | None:
    env = os.environ.get("KVBRIDGE_BIN")
    candidates = [Path(env)] if env else [REPO / "target/release/kvbridge", REPO / "target/debug/kvbridge"]
    return next((c for c in candidates if c.is_file()), None)


def http_status(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


def post(url: str, doc: dict, timeout: float = 120.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(doc).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = e.read() or b"{}"
        try:
            return e.code, json.loads(body)
        except ValueError:
            return e.code, {"raw": body.decode(errors="replace")}


def post_stream(url: str, doc: dict, timeout: float = 120.0) -> tuple[int, list[dict], str]:
    """A streamed request's status, its parsed ``data:`` events, and the raw body."""
    req = urllib.request.Request(url, json.dumps(doc).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, [], (e.read() or b"").decode(errors="replace")
    events = []
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: ") :]))
    return status, events, raw


def choice_tokens(api: str, choices: list) -> list[tuple[str, dict[str, float]]]:
    """Each generated token with its top logprobs, from an answer's choices (``api``:
    ``completions`` or chat), streamed events' choices included."""
    out: list[tuple[str, dict[str, float]]] = []
    for c in choices:
        lp = c.get("logprobs")
        if not lp:
            continue
        if api == "completions":
            out += [(t, dict(top)) for t, top in zip(lp["tokens"], lp["top_logprobs"])]
        else:
            out += [(e["token"], {x["token"]: x["logprob"] for x in e["top_logprobs"]}) for e in lp["content"]]
    return out


def prefill(url: str, path: str, doc: dict, timeout: float = 120.0) -> dict:
    """The proxy's first step by hand: the prompt on the prefiller at ``url`` alone, its
    ``kv_transfer_params`` back."""
    pdoc = dict(doc, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})  # fmt: skip
    status, pre = post(url + path, pdoc, timeout=timeout)
    assert status == 200, pre
    params = pre["kv_transfer_params"]
    assert params and params["remote_block_ids"], pre
    return params


class Proc:
    """A subprocess in its own session, its output in a log file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None):
        self.name = name
        self.log_path = log
        self._log = open(log, "wb")
        self.p = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def alive(self) -> bool:
        return self.p.poll() is None

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.p.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class VllmServer(Proc):
    def __init__(
        self,
        name: str,
        model: Path,
        port: int,
        logdir: Path,
        kv_transfer_config: dict | None = None,
        env: dict[str, str] | None = None,
        max_model_len: int = 1024,
        block_size: int = 32,
        extra_args: list[str] | None = None,
    ):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--max-num-seqs", "4",
            "--block-size", str(block_size), "--enforce-eager", "--seed", "0",
        ]  # fmt: skip
        if kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        argv += extra_args or []
        full_env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            **(env or {}),
        }
        super().__init__(name, argv, logdir / f"{name}.log", full_env)


def wait_healthy(servers: list[VllmServer], deadline_s: float = START_DEADLINE_S) -> float:
    """Polls every server's /health until all answer 200; returns the seconds it took."""
    t0 = time.monotonic()
    pending = list(servers)
    while pending:
        for s in list(pending):
            if not s.alive():
                raise RuntimeError(f"vLLM server {s.name} exited ({s.p.returncode}):\n{s.tail()}")
            if http_status(f"{s.url}/health") == 200:
                pending.remove(s)
        if not pending:
            break
        if time.monotonic() - t0 > deadline_s:
            raise TimeoutError(
                f"vLLM servers {[s.name for s in pending]} not healthy in {deadline_s} s:\n"
                + "\n".join(s.tail(2000) for s in pending)
            )
        time.sleep(0.5)
    return time.monotonic() - t0


class Proxy(Proc):
    """``kvbridge proxy --flow vllm`` on a free port (it prints its bound address)."""

    def __init__(self, binary: Path, prefill_ports: list[int], decode_ports: list[int], logdir: Path, *extra: str):
        argv = [
            str(binary), "proxy", "--flow", "vllm", "--host", "127.0.0.1", "--port", "0",
            "--prefiller-host", "127.0.0.1", "--prefiller-port", ",".join(map(str, prefill_ports)),
            "--decoder-host", "127.0.0.1", "--decoder-port", ",".join(map(str, decode_ports)),
            *extra,
        ]  # fmt: skip
        self.out_path = logdir / "proxy.out"
        self._out = open(self.out_path, "wb")
        self.name = "proxy"
        self.log_path = logdir / "proxy.log"
        self._log = open(self.log_path, "wb")
        self.p = subprocess.Popen(argv, stdout=self._out, stderr=self._log, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            text = self.out_path.read_text()
            if text.strip():
                self.url = "http://" + json.loads(text.splitlines()[0])["http"]
                break
            if not self.alive():
                raise RuntimeError(f"kvbridge proxy exited ({self.p.returncode}):\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvbridge proxy printed no address in 60 s:\n{self.tail()}")
            time.sleep(0.05)

    def kill(self) -> None:
        super().kill()
        self._out.close()

    def wait_healthy(self, deadline_s: float = 60.0) -> None:
        t0 = time.monotonic()
        while http_status(f"{self.url}/health") != 200:
            if not self.alive():
                raise RuntimeError(f"kvbridge proxy exited:\n{self.tail()}")
            if time.monotonic() - t0 > deadline_s:
                raise TimeoutError(f"proxy not healthy in {deadline_s} s:\n{self.tail()}")
            time.sleep(0.1)


def kvbridge_config(role: str, port: int, **extra) -> dict:
    return {
        "kv_connector": "KvbridgeConnector",
        "kv_connector_module_path": "kvbridge.vllm",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kvbridge_host": "127.0.0.1", "kvbridge_port": port, **extra},
    }


def nixl_config(role: str) -> dict:
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}


def kvbridge_counters(url: str) -> dict[str, float]:
    """KvbridgeConnector's Prometheus counters on the vLLM server at ``url`` (its /metrics),
    failures keyed as ``vllm:kvbridge_load_failures_total[cause]``. vLLM's log drops an idle
    interval's counts; these series do not."""
    import re

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r"^(vllm:kvbridge_\w+_total)\{([^}]*)\} ([0-9.e+-]+)$", text, re.M):
        cause = re.search(r'cause="(\w+)"', m.group(2))
        out[m.group(1) + (f"[{cause.group(1)}]" if cause else "")] = float(m.group(3))
    return out


def kv_cache_usage(url: str) -> float:
    """vLLM's ``kv_cache_usage_perc`` of the server at ``url`` (0 when it holds no blocks)."""
    import re

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        found = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)$", r.read().decode(), re.M)
    if not found:
        raise AssertionError("no vllm:kv_cache_usage_perc in /metrics")
    return float(found.group(1))


def tcp_rx_queue(port: int) -> int:
    """Bytes waiting unread in the receive queues of the TCP sockets whose local port is
    ``port`` (a stopped listener's accepted connections)."""
    total = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            local_port = int(f[1].rsplit(":", 1)[1], 16)
            if local_port == port and f[3] == "01":  # ESTABLISHED
                total += int(f[4].split(":")[1], 16)
    return total


class VllmEventsServer(VllmServer):
    """A colocated vLLM CPU server started as :class:`VllmServer` starts one (same model
    flags and environment, no KV connector), with prefix caching on and its KV cache events
    published on a ZMQ PUB socket (vLLM's ``--kv-events-config``): the stream
    ``kvbridge proxy --routing kv-events`` subscribes to, at ``events``. vLLM 0.32's
    publisher binds only a wildcard TCP endpoint (``tcp://*:PORT``, every interface) or an
    ``ipc://`` one; to ``tcp://127.0.0.1:PORT`` it connects out, and no subscriber that
    connects would hear from it. The server publishes on a Unix socket in ``logdir``, so
    nothing listens beyond this host."""

    def __init__(
        self,
        name: str,
        model: Path,
        port: int,
        logdir: Path,
        env: dict[str, str] | None = None,
        max_model_len: int = 1024,
        block_size: int = 32,
    ):
        self.events = f"ipc://{logdir.resolve() / (name + '-kv-events.sock')}"
        events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.events}
        super().__init__(
            name,
            model,
            port,
            logdir,
            env=env,
            max_model_len=max_model_len,
            block_size=block_size,
            extra_args=["--enable-prefix-caching", "--kv-events-config", json.dumps(events_config)],
        )


def prometheus_sum(url: str, name: str) -> float:
    """The sum of every series of the Prometheus metric ``name`` (any labels) in the
    ``/metrics`` text at ``url``; 0 when it has none."""
    import re

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    pat = re.compile(r"^" + re.escape(name) + r"(?:\{[^}]*\})? ([0-9.e+-]+)$", re.M)
    return sum(float(m.group(1)) for m in pat.finditer(text))
