"""A client's request through ``kvbridge proxy`` to LMCache's PD backends over kvbridge.

The proxy (flow ``lmcache``) sends the prefill to the prefiller process, which puts the KV
with LMCache's ``PDBackendAsync`` sender; LMCache's ``ProxyNotif`` reaches the proxy's outcome
socket and releases the request to the decoder process, whose answer says whether every
chunk arrived byte for byte (``pd_role.py --http-port``).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdproc import Role, free_ports, write_config

REPO = Path(__file__).resolve().parents[4]


def _proxy_binary() -> Path:
    env = os.environ.get("KVBRIDGE_BIN")
    candidates = [Path(env)] if env else [REPO / "target/release/kvbridge", REPO / "target/debug/kvbridge"]
    for c in candidates:
        if c.is_file():
            return c
    if os.environ.get("CI"):
        pytest.fail(f"no kvbridge binary at {candidates} (cargo build -p kvbridge-cli)")
    pytest.skip(f"no kvbridge binary at {candidates} (cargo build -p kvbridge-cli)")


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except (urllib.error.URLError, OSError):
        return 0


def _post(url: str, doc: dict, timeout: float = 60.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(doc).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture
def procs():
    started: list = []
    yield started
    for p in started:
        if isinstance(p, Role):
            p.stop()
        else:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def test_proxy_request_is_released_by_lmcaches_proxy_notif_and_the_kv_verified(tmp_path, procs):
    binary = _proxy_binary()
    init, alloc, notif, http, p_http, d_http = free_ports(6)
    recv_cfg = write_config(
        tmp_path / "recv.yaml", pd_role="receiver", pd_buffer_size=64 << 20,
        pd_peer_host="127.0.0.1", pd_peer_init_port=[init], pd_peer_alloc_port=[alloc], chunk_size=16,
    )
    send_cfg = write_config(
        tmp_path / "send.yaml", pd_role="sender", pd_buffer_size=64 << 20,
        pd_proxy_host="127.0.0.1", pd_proxy_port=notif, chunk_size=16,
    )
    proxy_log = open(tmp_path / "proxy.log", "w")
    proxy = subprocess.Popen(
        [str(binary), "proxy", "--host", "127.0.0.1", "--port", str(http),
         "--prefiller-host", "127.0.0.1", "--prefiller-port", str(p_http),
         "--decoder-host", "127.0.0.1", "--decoder-port", str(d_http),
         "--decoder-init-port", str(init), "--decoder-alloc-port", str(alloc),
         "--proxy-host", "127.0.0.1", "--proxy-port", str(notif),
         "--kv-ready-timeout", "30", "--health-interval", "0.5"],
        stdout=proxy_log, stderr=subprocess.STDOUT,
    )
    procs.append(proxy)
    receiver = Role("receiver", recv_cfg, None, "--http-port", str(d_http))
    sender = Role("sender", send_cfg, None, "--http-port", str(p_http))
    procs.extend([receiver, sender])
    receiver.expect("ready", timeout=120)
    sender.expect("ready", timeout=120)
    deadline = time.monotonic() + 30
    while _get(f"http://127.0.0.1:{http}/health") != 200:
        assert time.monotonic() < deadline, "proxy never saw both workers healthy"
        assert proxy.poll() is None, (tmp_path / "proxy.log").read_text()
        time.sleep(0.2)

    def one(i: int) -> tuple[int, dict]:
        return _post(f"http://127.0.0.1:{http}/v1/completions",
                     {"model": "m", "prompt": f"hello {i}", "max_tokens": 4})

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, range(8)))
    for status, doc in answers:
        assert status == 200, (doc, (tmp_path / "proxy.log").read_text()[-3000:], sender.output()[-3000:])
        text = doc["choices"][0]["text"]
        assert text.startswith(" first") and "kv-verified kvb-" in text, text
    assert len({doc["choices"][0]["text"] for _, doc in answers}) == 8
