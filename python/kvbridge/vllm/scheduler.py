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
import secrets
import time
from typing import Any

from .config import ConnectorSettings
from .done_notices import is_grant
from .load_requests import LoadRequestSender
from .metadata import KvbridgeConnectorMetadata, RecvJob, first_group
from .staging import HOST

log = logging.getLogger(__name__)

#: What a decoder needs besides ``remote_block_ids`` to read a prefiller's blocks.
REQUIRED_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")

TRANSFER_MODE = "pull"

#: The largest prefiller TP size a decoder takes from ``kv_transfer_params`` (kvbridge-pd's
#: bound on ranks).
MAX_TP_SIZE = 1 << 16


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
    tp = params.get("tp_size", 1)
    if not isinstance(tp, int) or isinstance(tp, bool) or not 0 < tp <= MAX_TP_SIZE:
        return f"tp_size {tp!r} is not a TP size"
    if int(port) + tp > 65536:
        return f"remote_port {port} and tp_size {tp}: the last rank's port is past 65535"
    if not is_grant(params.get("kvbridge_grant")):
        return "kvbridge_grant missing or not 32 hex digits (a prefiller of another connector?)"
    return None


class KvbridgeScheduler:
    def __init__(self, vllm_config: Any, settings: ConnectorSettings):
        self.vllm_config = vllm_config
        self.settings = settings
        self.tp_size = max(1, vllm_config.parallel_config.tensor_parallel_size)
        self._reqs_need_recv: dict[str, RecvJob] = {}
        self._reqs_need_send: dict[str, float] = {}
        # blocks of the requests of _reqs_need_send, for their digests (digests.py)
        self._send_blocks: dict[str, list[int]] = {}
        # requests whose prefiller already gets a notification from a load job
        self._recv_issued: set[str] = set()
        # prefiller: do_remote_decode requests whose prompt is not fully scheduled yet ->
        # (the request, its blocks so far)
        self._stages = settings.is_producer and settings.kv_buffer_device == HOST
        self._prompts: dict[str, tuple[Any, list[int]]] = {}
        # prefiller: requests the workers mark held in the step that completes their prompt,
        # until they finish; those that finish without a delayed free are unmarked next step
        self._held: set[str] = set()
        self._reqs_not_sent: set[str] = set()
        # prefiller: each held request's grant (done_notices.py), drawn when the workers
        # first hold it and returned in its kv_transfer_params; until it finishes
        self._grants: dict[str, str] = {}
        self._step_grants: dict[str, str] = {}
        # decoder: each load also goes straight to the workers' load threads
        self.load_requests = LoadRequestSender()
        self._sync = getattr(vllm_config, "max_concurrent_batches", 1) == 1

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
        if self.settings.is_producer and params and params.get("do_remote_decode"):
            self._prompts[request.request_id] = (request, [])
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
        prompt = len(request.prompt_token_ids or [])
        if problem is None:
            sent = params.get("remote_num_tokens")
            # the prefiller's block size, where it says (kvbridge's prefillers do): else this one's
            block_size = params.get("remote_block_size", self.vllm_config.cache_config.block_size)
            remote = remote_blocks(params)
            if isinstance(sent, int) and not isinstance(sent, bool) and sent < prompt:
                # (more is fine: NixlConnector's prefillers count more than the prompt too)
                problem = (
                    f"the prefiller computed {sent} tokens, fewer than the {prompt} of the decoder's prompt "
                    "(the proxy sent the decoder another prompt than the prefiller's)"
                )
            elif not isinstance(block_size, int) or isinstance(block_size, bool) or not 0 < block_size < 2**31:
                problem = f"remote_block_size {block_size!r} is not a block size"
            elif len(remote) * block_size < prompt:
                problem = (
                    f"the prefiller offers {len(remote)} blocks of {block_size} tokens for the prompt's "
                    f"{prompt} tokens"
                )
        if problem is not None:
            # a usable address still gets the prefiller's "read done" notice
            job = self._job(params, local, awaited=True)
            job.local_block_ids, job.awaited = local, True
            job.error = f"request {request.request_id}: kv_transfer_params unusable: {problem}"
            self._reqs_need_recv[request.request_id] = job
        else:
            # the prefiller's blocks hold the prompt from its first token (its block size may
            # differ from this engine's): the worker checks they cover it, and reads the
            # tokens past the decoder's own prefix-cache hit
            job = self._job(params, local, awaited=True)
            job.hit_block_ids = group[:hit]
            job.prompt_tokens = prompt
            self._reqs_need_recv[request.request_id] = job
            if self._sync and local:
                self.load_requests.send(request.request_id, job)
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
            remote_tp_size=int(params.get("tp_size", 1)),
            grant=str(params["kvbridge_grant"]),
            awaited=awaited,
            recomputed=recomputed,
            allocated=time.monotonic(),
        )

    def set_inbox_addresses(self, addresses: dict[int, Any]) -> None:
        """Every TP rank's load inbox (load_requests.py), from vLLM's handshake metadata."""
        if self._sync and self.settings.is_consumer:
            self.load_requests.set_addresses(addresses, self.tp_size)

    def build_connector_meta(self, scheduler_output: Any) -> KvbridgeConnectorMetadata:
        meta = KvbridgeConnectorMetadata(
            reqs_to_recv=self._reqs_need_recv,
            reqs_to_send=self._reqs_need_send,
            reqs_not_sent=self._reqs_not_sent,
            hold_blocks=self._send_blocks,
        )
        self._reqs_need_recv = {}
        self._reqs_need_send = {}
        self._send_blocks = {}
        self._reqs_not_sent = set()
        meta.idle = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        if self._prompts:
            for req_id, (request, blocks) in self._completed_prompts(scheduler_output).items():
                if self._stages:
                    meta.reqs_to_save[req_id] = blocks
                if getattr(request, "max_tokens", None) == 1:
                    meta.reqs_to_hold.add(req_id)
                    meta.hold_blocks[req_id] = blocks
                    self._held.add(req_id)
                    self._grant(req_id)
        meta.grants, self._step_grants = self._step_grants, {}
        return meta

    def _completed_prompts(self, scheduler_output: Any) -> dict[str, tuple[Any, list[int]]]:
        """The do_remote_decode requests whose prompt this step completes, with all their
        blocks (a block a chunk left partial is copied whole once the prompt is done)."""
        from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

        out: dict[str, tuple[Any, list[int]]] = {}
        for req_id, new_blocks, resumed in yield_req_data(scheduler_output):
            entry = self._prompts.get(req_id)
            if entry is None:
                continue
            request, blocks = entry
            added = first_group(new_blocks) if new_blocks is not None else []
            # a request resumed after preemption gets all its blocks anew
            blocks = added if resumed else blocks + added
            self._prompts[req_id] = (request, blocks)
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if request.num_computed_tokens + scheduled >= request.num_prompt_tokens:
                out[req_id] = (request, blocks)
                del self._prompts[req_id]
        return out

    def update_connector_output(self, connector_output: Any) -> None:
        pass

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        delay_free, out = self._finished(request, block_ids)
        if request.request_id in self._held:
            self._held.discard(request.request_id)
            if not delay_free:
                self._reqs_not_sent.add(request.request_id)
        self._grants.pop(request.request_id, None)
        return delay_free, out

    def _grant(self, request_id: str) -> str:
        """The request's grant, drawn on first use; the workers learn it this step."""
        grant = self._grants.get(request_id)
        if grant is None:
            grant = self._grants[request_id] = secrets.token_hex(16)
        self._step_grants[request_id] = grant
        return grant

    def _finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        issued = request.request_id in self._recv_issued
        self._recv_issued.discard(request.request_id)
        self._prompts.pop(request.request_id, None)
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
            self._send_blocks[request.request_id] = blocks
        return delay_free, dict(
            kvbridge_grant=self._grant(request.request_id),
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_block_ids=[blocks],
            remote_engine_id=self.settings.engine_id,
            remote_request_id=request.request_id,
            remote_host=self.settings.host,
            remote_port=self.settings.base_port,
            tp_size=self.tp_size,
            remote_block_size=self.vllm_config.cache_config.block_size,
            remote_num_tokens=request.num_computed_tokens if delay_free else 0,
            transfer_mode=TRANSFER_MODE,
        )
