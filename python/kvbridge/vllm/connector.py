"""``KvbridgeConnector``: vLLM's KV connector interface, one instance per role and process."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from .config import settings_from
from .load_requests import InboxAddress
from .logs import route_to_vllm
from .metadata import KvbridgeConnectorMetadata
from .prom import KvbridgePromMetrics
from .scheduler import KvbridgeScheduler
from .stats import KvbridgeConnectorStats
from .worker import KvbridgeWorker


class KvbridgeConnector(KVConnectorBase_V1):
    """Prefill/decode KV transfer over kvbridge, speaking NixlConnector's ``kv_transfer_params``.

    Load it with ``--kv-transfer-config '{"kv_connector": "KvbridgeConnector",
    "kv_connector_module_path": "kvbridge.vllm", "kv_role": "kv_producer"|"kv_consumer"}'``.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        route_to_vllm()
        self.settings = settings_from(vllm_config)
        self.connector_scheduler: KvbridgeScheduler | None = None
        self.connector_worker: KvbridgeWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvbridgeScheduler(vllm_config, self.settings)
        else:
            num_blocks = getattr(kv_cache_config, "num_blocks", None)
            self.connector_worker = KvbridgeWorker(vllm_config, self.settings, num_blocks=num_blocks)

    # ---- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    # ---- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        """vLLM's block copy op, for a KV cache staged in host memory (``kv_buffer_device: "cpu"``)."""
        assert self.connector_worker is not None
        self.connector_worker.set_host_xfer_buffer_ops(copy_operation)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvbridgeConnectorMetadata)
        self.connector_worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # loads complete between steps (the request waits in WAITING_FOR_REMOTE_KVS)
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # pull: the decoder reads the prefiller's blocks in place (or their host copies)
        pass

    def wait_for_save(self) -> None:
        # the prompts this step completed: staged to host memory and marked held now,
        # before the step's output lets the scheduler return their kv_transfer_params
        assert self.connector_worker is not None
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvbridgeConnectorMetadata)
        if meta.reqs_to_save or meta.reqs_to_hold:
            self.connector_worker.wait_for_save(meta)

    def get_handshake_metadata(self) -> InboxAddress | None:
        """A decoder rank's load inbox, which vLLM hands the scheduler at startup."""
        return None if self.connector_worker is None else self.connector_worker.handshake_metadata()

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.set_inbox_addresses(metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None and isinstance(connector_metadata, KvbridgeConnectorMetadata):
            self.connector_worker.before_forward(connector_metadata)

    def _wait_if_idle(self) -> None:
        assert self.connector_worker is not None
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, KvbridgeConnectorMetadata) and meta.idle:
                self.connector_worker.wait_idle()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._wait_if_idle()
        assert self.connector_worker is not None
        return self.connector_worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._wait_if_idle()
        assert self.connector_worker is not None
        sending, recving = self.connector_worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=self.connector_worker.take_failed_recving(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.connector_worker is None:
            return set()
        return self.connector_worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KvbridgeConnectorStats | None:
        if self.connector_worker is None:
            return None
        delta = self.connector_worker.stats_since_last_report()
        return None if delta is None else KvbridgeConnectorStats(data=delta)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvbridgeConnectorStats:
        return KvbridgeConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvbridgePromMetrics:
        """The counters as ``vllm:kvbridge_*_total`` series on vLLM's ``/metrics``."""
        return KvbridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def kvbridge_stats(self) -> dict[str, int | float]:
        """Cumulative counters of loads (failures by cause), bytes read and how prefilled
        blocks were freed."""
        return dict(self.connector_worker.stats) if self.connector_worker is not None else {}

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
