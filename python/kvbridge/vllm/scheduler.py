"""Scheduler side: NixlConnector's pull protocol over ``kv_transfer_params``.

The prefiller finishes a ``do_remote_decode`` request, keeps its blocks and returns the
parameters a decoder needs to read them; the decoder, given those parameters with
``do_remote_prefill``, loads the prompt's KV asynchronously and then tells the prefiller.
"""

from __future__ import annotations

import logging
from typing import Any

from .config import ConnectorSettings
from .metadata import KvbridgeConnectorMetadata, RecvJob, first_group

log = logging.getLogger(__name__)

#: What a decoder needs besides ``remote_block_ids`` to read a prefiller's blocks.
REQUIRED_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")

TRANSFER_MODE = "pull"


class KvbridgeScheduler:
    def __init__(self, vllm_config: Any, settings: ConnectorSettings):
        self.vllm_config = vllm_config
        self.settings = settings
        self.tp_size = max(1, vllm_config.parallel_config.tensor_parallel_size)
        self._reqs_need_recv: dict[str, RecvJob] = {}
        self._reqs_need_send: dict[str, float] = {}
        # requests whose prefiller already gets a notification from a load job
        self._recv_issued: set[str] = set()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params is not None and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or []) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        if params.get("remote_block_ids"):
            if all(params.get(k) is not None for k in REQUIRED_REMOTE_KEYS):
                local = first_group(blocks.get_unhashed_block_ids_all_groups()) if num_external_tokens > 0 else []
                self._reqs_need_recv[request.request_id] = self._job(params, local, awaited=num_external_tokens > 0)
                self._recv_issued.add(request.request_id)
            else:
                log.warning(
                    "kvbridge: request %s has do_remote_prefill but lacks %s; it will be computed locally",
                    request.request_id,
                    [k for k in REQUIRED_REMOTE_KEYS if params.get(k) is None],
                )
        else:
            assert num_external_tokens == 0
        # one transfer per request
        params["do_remote_prefill"] = False

    @staticmethod
    def _job(params: dict[str, Any], local: list[int], *, awaited: bool) -> RecvJob:
        return RecvJob(
            local_block_ids=local,
            remote_block_ids=first_group(params.get("remote_block_ids")),
            remote_engine_id=str(params["remote_engine_id"]),
            remote_request_id=str(params["remote_request_id"]),
            remote_host=str(params["remote_host"]),
            remote_port=int(params["remote_port"]),
            awaited=awaited,
        )

    def build_connector_meta(self, scheduler_output: Any) -> KvbridgeConnectorMetadata:
        meta = KvbridgeConnectorMetadata(reqs_to_recv=self._reqs_need_recv, reqs_to_send=self._reqs_need_send)
        self._reqs_need_recv = {}
        self._reqs_need_send = {}
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        pass

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        issued = request.request_id in self._recv_issued
        self._recv_issued.discard(request.request_id)
        if not params:
            return False, None
        if params.get("do_remote_prefill") and not issued:
            # Finished before it was ever scheduled (aborted): the prefiller still holds
            # the blocks, so the worker only sends it the "read done" notification.
            if params.get("remote_block_ids") and all(params.get(k) is not None for k in REQUIRED_REMOTE_KEYS):
                self._reqs_need_recv[request.request_id] = self._job(params, [], awaited=False)
            params["do_remote_prefill"] = False
            return False, None
        if params.get("do_remote_prefill"):
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            # aborted prefill: its blocks are freed now, nobody will read them
            return False, None
        blocks = first_group(block_ids)
        delay_free = len(blocks) > 0
        if delay_free:
            self._reqs_need_send[request.request_id] = self.settings.lease_s
        return delay_free, dict(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_block_ids=[blocks],
            remote_engine_id=self.settings.engine_id,
            remote_request_id=request.request_id,
            remote_host=self.settings.host,
            remote_port=self.settings.base_port,
            tp_size=self.tp_size,
            remote_num_tokens=request.num_computed_tokens if delay_free else 0,
            transfer_mode=TRANSFER_MODE,
        )
