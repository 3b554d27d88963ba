"""Scheduler side: NixlConnector's pull protocol over ``kv_transfer_params``.

The prefiller finishes a ``do_remote_decode`` request, keeps its blocks and returns the
parameters a decoder needs to read them; the decoder, given those parameters with
``do_remote_prefill``, loads the prompt's KV asynchronously and then tells the prefiller.

With ``kv_buffer_device: "cpu"`` the prefiller's workers also learn, in the step that
completes a ``do_remote_decode`` prompt, every block of it, to copy to host memory after
that step's forward pass (staging.py).
"""

from __future__ import annotations

import logging
from typing import Any

from .config import ConnectorSettings
from .metadata import KvbridgeConnectorMetadata, RecvJob, first_group
from .staging import HOST

log = logging.getLogger(__name__)

#: What a decoder needs besides ``remote_block_ids`` to read a prefiller's blocks.
REQUIRED_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")

TRANSFER_MODE = "pull"


def remote_blocks(params: dict[str, Any]) -> list[int]:
    return first_group(params.get("remote_block_ids"))


def params_problem(params: dict[str, Any]) -> str | None:
    """Why a decoder cannot load with these ``kv_transfer_params`` (they come from a client
    through the proxy), or None."""
    missing = [k for k in REQUIRED_REMOTE_KEYS if params.get(k) is None]
    if missing:
        return f"{', '.join(missing)} missing"
    try:
        blocks = remote_blocks(params)
    except (TypeError, ValueError) as e:
        return f"remote_block_ids: {e}"
    if not blocks:
        return "remote_block_ids empty"
    if any(b < 0 for b in blocks):
        return "remote_block_ids has a negative id"
    port = params.get("remote_port")
    usable = isinstance(port, (int, str)) and not isinstance(port, bool) and str(port).isdigit()
    if not usable or not 0 < int(port) < 65536:
        return f"remote_port {port!r} is not a port"
    return None


class KvbridgeScheduler:
    def __init__(self, vllm_config: Any, settings: ConnectorSettings):
        self.vllm_config = vllm_config
        self.settings = settings
        self.tp_size = max(1, vllm_config.parallel_config.tensor_parallel_size)
        self._reqs_need_recv: dict[str, RecvJob] = {}
        self._reqs_need_send: dict[str, float] = {}
        # requests whose prefiller already gets a notification from a load job
        self._recv_issued: set[str] = set()
        # prefiller with host staging: do_remote_decode requests whose prompt is not fully
        # scheduled yet -> (the request, its blocks so far)
        self._stages = settings.is_producer and settings.kv_buffer_device == HOST
        self._to_save: dict[str, tuple[Any, list[int]]] = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params is not None and params.get("do_remote_prefill"):
            # Unusable parameters still take this path: the load is then failed by the
            # worker with a typed, counted error (update_state_after_alloc), instead of the
            # request being computed here unnoticed or waiting for a load nobody starts.
            count = len(request.prompt_token_ids or []) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if self._stages and params and params.get("do_remote_decode"):
            self._to_save[request.request_id] = (request, [])
        if not params or not params.get("do_remote_prefill"):
            return
        # one transfer per request
        params["do_remote_prefill"] = False
        problem = params_problem(params)
        if num_external_tokens == 0:
            # vLLM computes this prompt here (prompt logprobs skip every cache, or a local
            # hit covers it): counted as recomputed, and the prefiller told to free
            reason = "vLLM computes the prompt locally (prompt logprobs, or a local prefix-cache hit)"
            log.info("kvbridge: request %s: %s instead of loading it", request.request_id, reason)
            self._reqs_need_recv[request.request_id] = self._job(params, [], awaited=False, recomputed=True)
            self._recv_issued.add(request.request_id)
            return
        group = first_group(blocks.get_block_ids())
        local = first_group(blocks.get_unhashed_block_ids_all_groups())
        hit = len(group) - len(local)  # blocks the decoder's own prefix cache holds
        if problem is None:
            remote = remote_blocks(params)
            prompt = len(request.prompt_token_ids or [])
            sent = params.get("remote_num_tokens")
            if isinstance(sent, int) and not isinstance(sent, bool) and sent < prompt:
                # (more is fine: NixlConnector's prefillers count more than the prompt too)
                problem = (
                    f"the prefiller computed {sent} tokens, fewer than the {prompt} of the decoder's prompt "
                    "(the proxy sent the decoder another prompt than the prefiller's)"
                )
            elif len(remote) < len(group):
                problem = (
                    f"the prefiller offers {len(remote)} blocks, the prompt's {prompt} tokens take "
                    f"{len(group)} blocks of {self.vllm_config.cache_config.block_size} here"
                )
        if problem is not None:
            # a usable address still gets the prefiller's "read done" notice
            job = self._job(params, local, awaited=True)
            job.local_block_ids, job.awaited = local, True
            job.error = f"request {request.request_id}: kv_transfer_params unusable: {problem}"
            self._reqs_need_recv[request.request_id] = job
        else:
            # remote block i holds the prompt's block i; a longer list (the prefiller's
            # lookahead slots) is cut to the prompt, and the worker reads its tail past the hit
            job = self._job(params, local, awaited=True)
            job.remote_block_ids = job.remote_block_ids[: hit + len(local)]
            self._reqs_need_recv[request.request_id] = job
        self._recv_issued.add(request.request_id)

    @staticmethod
    def _job(params: dict[str, Any], local: list[int], *, awaited: bool, recomputed: bool = False) -> RecvJob:
        if params_problem(params) is not None:
            # nothing usable to tell the prefiller: its lease frees its blocks
            return RecvJob([], [], "", "", "", 0, awaited=False, recomputed=recomputed, notify=False)
        return RecvJob(
            local_block_ids=local,
            remote_block_ids=remote_blocks(params),
            remote_engine_id=str(params["remote_engine_id"]),
            remote_request_id=str(params["remote_request_id"]),
            remote_host=str(params["remote_host"]),
            remote_port=int(params["remote_port"]),
            awaited=awaited,
            recomputed=recomputed,
        )

    def build_connector_meta(self, scheduler_output: Any) -> KvbridgeConnectorMetadata:
        meta = KvbridgeConnectorMetadata(reqs_to_recv=self._reqs_need_recv, reqs_to_send=self._reqs_need_send)
        self._reqs_need_recv = {}
        self._reqs_need_send = {}
        if self._to_save:
            meta.reqs_to_save = self._blocks_to_save(scheduler_output)
        return meta

    def _blocks_to_save(self, scheduler_output: Any) -> dict[str, list[int]]:
        """The staged requests whose prompt this step completes, with all their blocks (a
        block a chunk left partial is copied whole once the prompt is done)."""
        from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

        out: dict[str, list[int]] = {}
        for req_id, new_blocks, resumed in yield_req_data(scheduler_output):
            entry = self._to_save.get(req_id)
            if entry is None:
                continue
            request, blocks = entry
            added = first_group(new_blocks) if new_blocks is not None else []
            # a request resumed after preemption gets all its blocks anew
            blocks = added if resumed else blocks + added
            self._to_save[req_id] = (request, blocks)
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if request.num_computed_tokens + scheduled >= request.num_prompt_tokens:
                out[req_id] = blocks
                del self._to_save[req_id]
        return out

    def update_connector_output(self, connector_output: Any) -> None:
        pass

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        issued = request.request_id in self._recv_issued
        self._recv_issued.discard(request.request_id)
        self._to_save.pop(request.request_id, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill") and not issued:
            # Finished before it was ever scheduled (aborted): the prefiller still holds
            # the blocks, so the worker only sends it the "read done" notification.
            if params_problem(params) is None:
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
