"""What the scheduler tells the workers each step (vLLM pickles it across processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class RecvJob:
    """One decoder request whose prompt KV lives on a prefiller."""

    local_block_ids: list[int]  # empty: nothing to read, only tell the prefiller to free
    remote_block_ids: list[int]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    # vLLM waits for this load (the request sits in WAITING_FOR_REMOTE_KVS) and must hear
    # when it ends; False: only the prefiller is told (a finished request, or a full prefix
    # hit), and vLLM, which asserts it knows every request reported, is told nothing
    awaited: bool = True
    # vLLM computes the prompt itself instead of loading it (counted as loads_recomputed)
    recomputed: bool = False
    # the parameters were unusable: the worker fails the load with this (loads_failed_bad_params)
    error: str = ""
    # the prefiller's address and request id are usable for its "read done" notice
    notify: bool = True
    # when the scheduler allocated the blocks (``time.monotonic()``, one clock for every
    # process of the host): the load's deadline and its slow-load timings count from here
    allocated: float = 0.0
    # the prefiller engine's TP size (kv_transfer_params' tp_size): rank r listens on
    # remote_port + r
    remote_tp_size: int = 1
    # the decoder's blocks its own prefix cache holds, before local_block_ids: never written
    hit_block_ids: list[int] = field(default_factory=list)
    # the prompt's tokens, whose KV the load brings (0: as many as local_block_ids hold)
    prompt_tokens: int = 0
    # the request's grant (kv_transfer_params' kvbridge_grant), which the "done" notices
    # carry: only a holder of the request's parameters frees its blocks early
    grant: str = ""


@dataclass
class KvbridgeConnectorMetadata(KVConnectorMetadata):
    reqs_to_recv: dict[str, RecvJob] = field(default_factory=dict)
    # prefiller: request id -> lease in seconds (the worker starts the clock on receipt)
    reqs_to_send: dict[str, float] = field(default_factory=dict)
    # prefiller: the grant of each request held or sent in this step (done_notices.py)
    grants: dict[str, str] = field(default_factory=dict)
    # prefiller with host staging: request id -> its blocks, to copy to host memory after
    # this step's forward pass (the step that completes its prompt)
    reqs_to_save: dict[str, list[int]] = field(default_factory=dict)
    # prefiller: requests whose prompt this step completes and which finish with it
    # (max_tokens 1, as proxies send): marked held in the lease table after the forward
    # pass, before the step's output can reach a decoder, so that no decoder waits for a
    # later step of the prefiller to find its request held
    reqs_to_hold: set[str] = field(default_factory=set)
    # prefiller: the blocks of each request of reqs_to_hold and reqs_to_send, whose digests
    # its workers write before marking it held (digests.py)
    hold_blocks: dict[str, list[int]] = field(default_factory=dict)
    # prefiller: requests marked held that then finished without a delayed free (aborted):
    # marked ended before this step's forward pass can write into their blocks
    reqs_not_sent: set[str] = field(default_factory=set)
    # no request computes in this step (vLLM steps only for the connector's transfers):
    # the worker waits briefly for one to end instead of returning at once (worker.wait_idle)
    idle: bool = False


def first_group(block_ids) -> list[int]:
    """The block ids of the one KV-cache group this connector moves.

    vLLM passes per-group tuples; NixlConnector's ``remote_block_ids`` is a list of groups.
    A flat list of ints is accepted as one group.
    """
    if block_ids is None:
        return []
    seq = list(block_ids)
    if not seq:
        return []
    if all(isinstance(b, int) and not isinstance(b, bool) for b in seq):
        return [int(b) for b in seq]
    if len(seq) != 1:
        raise ValueError(
            f"kvbridge connector moves one KV-cache group, got {len(seq)} (hybrid models are not supported yet)"
        )
    inner = list(seq[0])
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in inner):
        raise ValueError("block ids must be integers")
    return [int(b) for b in inner]
