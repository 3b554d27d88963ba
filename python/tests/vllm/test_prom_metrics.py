"""The connector's counters reach Prometheus as vLLM's stats loop hands them over: the
counts since the previous report, added to per-engine series; failures by cause."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from kvbridge.vllm import KvbridgeConnector  # noqa: E402
from kvbridge.vllm.stats import COUNTERS, KvbridgeConnectorStats  # noqa: E402


def metric_types(registry):
    def bind(cls):
        return lambda **kw: cls(registry=registry, **kw)

    return {
        prometheus_client.Gauge: bind(prometheus_client.Gauge),
        prometheus_client.Counter: bind(prometheus_client.Counter),
        prometheus_client.Histogram: bind(prometheus_client.Histogram),
    }


def sample(registry, name: str, **labels) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_counters_become_prometheus_series_by_engine_and_cause():
    registry = prometheus_client.CollectorRegistry()
    prom = KvbridgeConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), metric_types(registry),
        ["model_name", "engine"], {0: ["tiny", "0"], 1: ["tiny", "1"]},
    )  # fmt: skip
    # two reports from engine 0, one from engine 1, as KvbridgeConnectorStats hands them over
    step1 = KvbridgeConnectorStats(data={"loads_ok": 2, "bytes_read": 4096, "load_seconds": 0.5})
    step2 = KvbridgeConnectorStats(
        data={"loads_ok": 1, "loads_failed": 3, "loads_failed_timeout": 1, "loads_failed_bad_params": 2,
              "loads_recomputed": 1, "notices_failed": 1}
    )  # fmt: skip
    prom.observe(step1.data, 0)
    prom.observe(step2.data, 0)
    prom.observe(KvbridgeConnectorStats(data={"leases_expired": 4, "blocks_freed_on_notify": 5}).data, 1)

    e0, e1 = {"model_name": "tiny", "engine": "0"}, {"model_name": "tiny", "engine": "1"}
    assert sample(registry, "vllm:kvbridge_loads_ok_total", **e0) == 3
    assert sample(registry, "vllm:kvbridge_bytes_read_total", **e0) == 4096
    assert sample(registry, "vllm:kvbridge_load_seconds_total", **e0) == 0.5
    assert sample(registry, "vllm:kvbridge_loads_recomputed_total", **e0) == 1
    assert sample(registry, "vllm:kvbridge_notices_failed_total", **e0) == 1
    assert sample(registry, "vllm:kvbridge_load_failures_total", cause="timeout", **e0) == 1
    assert sample(registry, "vllm:kvbridge_load_failures_total", cause="bad_params", **e0) == 2
    assert sample(registry, "vllm:kvbridge_load_failures_total", cause="peer_lost", **e0) == 0
    assert sample(registry, "vllm:kvbridge_leases_expired_total", **e1) == 4
    assert sample(registry, "vllm:kvbridge_freed_on_notify_total", **e1) == 5
    assert sample(registry, "vllm:kvbridge_loads_ok_total", **e1) == 0
    # every counter of the connector has a series
    text = prometheus_client.generate_latest(registry).decode()
    for key in COUNTERS:
        if key == "loads_failed" or key.startswith("loads_failed_"):
            continue
        assert key.replace("blocks_freed_on_notify", "freed_on_notify") in text, key
