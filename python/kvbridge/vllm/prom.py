"""The connector's counters as Prometheus series on vLLM's ``/metrics``.

vLLM builds this once per API server (``KvbridgeConnector.build_prom_metrics``) and hands it,
every step that reported any, the counts since the previous report, summed over workers (the
``KvbridgeConnectorStats`` data). Each counter becomes a Prometheus counter with vLLM's
engine labels; load failures are one series with a ``cause`` label.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

from .stats import FAILURE_CAUSES

#: stats counter -> (series name without the ``_total`` Prometheus adds, help text)
SERIES = {
    "loads_ok": ("vllm:kvbridge_loads_ok", "Decoder loads of a prompt's KV from a prefiller that completed."),
    "loads_recomputed": (
        "vllm:kvbridge_loads_recomputed",
        "Decoder requests with KV on a prefiller whose prompt vLLM computed itself instead of loading it "
        "(prompt logprobs, or a local prefix-cache hit).",
    ),
    "slow_loads": (
        "vllm:kvbridge_slow_loads",
        "Decoder loads that completed more than one second after their blocks were allocated (each logged "
        "with where its time went).",
    ),
    "loads_checked": (
        "vllm:kvbridge_loads_checked",
        "Completed loads whose every chunk was checked against the prefiller's digests (kvbridge_integrity).",
    ),
    "bytes_read": ("vllm:kvbridge_bytes_read", "KV bytes a decoder read from prefillers."),
    "read_ops": (
        "vllm:kvbridge_read_ops",
        "Ranged reads completed loads issued (one per block, or run of adjacent blocks, per prefiller rank and "
        "layer).",
    ),
    "load_seconds": ("vllm:kvbridge_load_seconds", "Seconds decoder loads took, summed over completed loads."),
    "read_seconds": (
        "vllm:kvbridge_read_seconds",
        "Seconds from posting a completed load's reads to its end (reads and lease check), summed.",
    ),
    "blocks_freed_on_notify": (
        "vllm:kvbridge_freed_on_notify",
        "Prefiller requests whose blocks were freed on the decoder's read-done notice.",
    ),
    "leases_expired": (
        "vllm:kvbridge_leases_expired",
        "Prefiller requests whose blocks were freed at kvbridge_lease_s without a read-done notice.",
    ),
    "leases_unmarked": (
        "vllm:kvbridge_leases_unmarked",
        "Prefiller requests left out of the lease table (every slot of their group held): their "
        "decoders' loads fail at their deadline.",
    ),
    "lease_reads_stalled": (
        "vllm:kvbridge_lease_reads_stalled",
        "Lease table reads a decoder gave up after kvbridge's stall limit (2 s) and issued again.",
    ),
    "notices_failed": ("vllm:kvbridge_notices_failed", "Read-done notices a decoder could not deliver."),
    "notices_refused": (
        "vllm:kvbridge_notices_refused",
        "Read-done notices a prefiller refused: they named a request under another grant than its own.",
    ),
    "saves_failed": (
        "vllm:kvbridge_saves_failed",
        "Prefiller requests (kv_buffer_device: cpu) whose blocks were not copied to host memory: freed, "
        "never offered to a decoder.",
    ),
    "shm_batches": ("vllm:kvbridge_shm_batches", "kvbridge batches a worker copied through mapped shared memory."),
    "cma_batches": ("vllm:kvbridge_cma_batches", "kvbridge batches a worker copied with cross-memory attach."),
    "ucx_batches": ("vllm:kvbridge_ucx_batches", "kvbridge batches UCX carried for a worker (transport ucx)."),
    "access_denied": (
        "vllm:kvbridge_access_denied",
        "Peers' kvbridge batches a worker refused for an access mode or windows (kvbridge_read_grants: "
        "reads outside the blocks of a request whose grant they named).",
    ),
}
FAILURES = ("vllm:kvbridge_load_failures", "Decoder loads that failed, by cause.")


class KvbridgePromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in SERIES.items():
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._counters[key] = create_metric_per_engine(metric, per_engine_labelvalues)
        failures = self._counter_cls(name=FAILURES[0], documentation=FAILURES[1], labelnames=[*labelnames, "cause"])
        self._failures: dict[str, dict[int, Any]] = {
            cause: {idx: failures.labels(*values, cause) for idx, values in per_engine_labelvalues.items()}
            for cause in FAILURE_CAUSES
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            value = transfer_stats_data.get(key) or 0
            if value > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
        for cause, per_engine in self._failures.items():
            value = transfer_stats_data.get(f"loads_failed_{cause}") or 0
            if value > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
