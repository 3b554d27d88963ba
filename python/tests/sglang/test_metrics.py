"""The backend's counters on SGLang's /metrics: a request in a child process (SGLang's
scheduler, with --enable-metrics and PROMETHEUS_MULTIPROC_DIR), then SGLang's own /metrics
route (add_prometheus_middleware, multiprocess mode) served here, as SGLang's HTTP server
process serves it, must show each counter the managers counted, as ``kvbridge_NAME_total``."""

import json
import os
import subprocess
import sys

from metrics_process import MODEL

HERE = os.path.dirname(os.path.abspath(__file__))


def metrics_page(monkeypatch, directory) -> str:
    from fastapi import FastAPI
    from sglang.srt.utils.common import add_prometheus_middleware
    from starlette.testclient import TestClient

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    app = FastAPI()
    add_prometheus_middleware(app)
    got = TestClient(app).get("/metrics")
    assert got.status_code == 200, got.text[:500]
    return got.text


def test_the_counters_are_on_sglangs_metrics_with_enable_metrics(tmp_path, monkeypatch):
    from prometheus_client.parser import text_string_to_metric_families

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + sys.path), PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "metrics_process.py")], capture_output=True, text=True, timeout=400, env=env
    )
    assert out.returncode == 0, out.stderr[-4000:]
    stats = json.loads([x for x in out.stdout.splitlines() if x.startswith("OK ")][-1][3:])
    shown = {}
    for family in text_string_to_metric_families(metrics_page(monkeypatch, tmp_path)):
        for s in family.samples:
            if s.name.startswith("kvbridge_"):
                assert s.labels["model_name"] == MODEL and s.labels["tp_rank"] == "0", s
                shown[(s.name, s.labels["engine_type"])] = s.value
    want = {(f"kvbridge_{k}_total", role): v for role, counts in stats.items() for k, v in counts.items() if v}
    assert want, stats
    assert {k: v for k, v in shown.items() if k[0].endswith("_total")} == want
    assert shown[("kvbridge_kv_received_total", "decode")] == 1
    assert shown[("kvbridge_bytes_sent_total", "prefill")] > 0


def test_without_enable_metrics_the_counters_stay_in_the_manager(pd):
    assert pd.prefill.stats._labels is None and pd.decode.stats._labels is None
