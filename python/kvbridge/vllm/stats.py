"""The connector's counters in vLLM's ``KVConnectorStats`` form.

The worker hands vLLM the counts since its previous report each step; vLLM sums them across
workers and steps and logs them with its other stats (``KV Transfer metrics: ...``) every
logging interval. Load failures are counted by cause.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

#: Why a decoder's load failed (``loads_failed_<cause>``).
FAILURE_CAUSES = (
    "timeout",
    "unreachable",
    "refused",
    "peer_lost",
    "bad_params",
    "lease_ended",
    "integrity",
    "copy",
    "other",
)

#: The worker's kvbridge channel's own counts: batches it copied through mapped shared memory,
#: through cross-memory attach, and batches UCX carried (the rest went over TCP).
TRANSPORT_COUNTERS = ("shm_batches", "cma_batches", "ucx_batches")
#: The worker's channel's refusals of peers' batches for an access mode or windows: on a
#: prefiller with kvbridge_read_grants, reads outside the request a grant opens (read_grants.py).
REFUSAL_COUNTERS = ("access_denied",)

#: Every counter, in the order they are logged.
COUNTERS = (
    "loads_ok",
    "loads_checked",
    "loads_failed",
    *(f"loads_failed_{c}" for c in FAILURE_CAUSES),
    "loads_recomputed",
    "slow_loads",
    "bytes_read",
    "read_ops",
    "blocks_freed_on_notify",
    "leases_expired",
    "leases_unmarked",
    "lease_reads_stalled",
    "notices_failed",
    "notices_refused",
    "saves_failed",
    *TRANSPORT_COUNTERS,
    *REFUSAL_COUNTERS,
)


def zero() -> dict[str, Any]:
    return {**{k: 0 for k in COUNTERS}, "load_seconds": 0.0, "read_seconds": 0.0}


@dataclass
class KvbridgeConnectorStats(KVConnectorStats):
    """Counts since the last report (``data``: counter name -> int; ``load_seconds``, from a
    load's start to its end, and ``read_seconds``, from posting its reads to the end, float)."""

    def __post_init__(self) -> None:
        self.data = {**zero(), **(self.data or {})}

    def reset(self) -> None:
        self.data = zero()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: int(self.data.get(k, 0)) for k in COUNTERS if self.data.get(k)}
        secs = float(self.data.get("load_seconds", 0.0))
        if self.data.get("loads_ok"):
            out["avg_load_ms"] = round(secs * 1e3 / self.data["loads_ok"], 3)
            if secs > 0:
                out["load_GiB_per_s"] = round(self.data.get("bytes_read", 0) / secs / 2**30, 4)
            # what NixlConnector reports as its throughput: bytes over the transfer time only
            # (here the reads and the lease check after them)
            out["read_ops_per_load"] = round(self.data.get("read_ops", 0) / self.data["loads_ok"], 1)
            reading = float(self.data.get("read_seconds", 0.0))
            if reading > 0:
                out["read_GiB_per_s"] = round(self.data.get("bytes_read", 0) / reading / 2**30, 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTERS)
