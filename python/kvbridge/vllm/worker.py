"""Worker side: each layer's KV tensor is a kvbridge region whose page is one block.

Prefiller: listens, publishes a directory (layer name -> region id) in a small region of
its own, keeps finished requests' blocks until the decoder's "read done" notification or
the lease's end. Decoder: connects (the handshake refuses a peer whose block layout
differs), reads the directory once per peer, reads every layer's blocks with a deadline,
then notifies the prefiller, on failure as on success.

A KV cache in device memory is staged in host buffers (staging.py): the regions are the
host buffers, the prefiller copies a request's blocks to them before it holds the request,
the decoder copies the blocks it read to the device before it reports the load.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import kvbridge

from . import done_notices, rank_reads
from .config import ConfigError, ConnectorSettings, numeric_host
from .cores import run_on, transfer_core_set, transfer_cores
from .directory import DIRECTORY_LEN, DIRECTORY_MAGIC, Peer, parse_directory, same_engine_layout
from .layout import ModelFacts, RankLayout, describe, pages_description
from . import digests
from .lease_table import PAGE_BYTES as LEASE_PAGE_BYTES
from .lease_table import LeaseState, LeaseTable, where
from .lease_table import state as lease_state
from .load_requests import STALE_S, InboxAddress, LoadRequestInbox
from .metadata import KvbridgeConnectorMetadata, RecvJob
from .notice_loop import NoticeLoop
from .read_grants import ReadGrants
from .scratch_slots import ScratchSlots, SlotsTaken
from .staging import CopyBlocksOp, HostStaging, StagingError, needs_staging
from .stats import REFUSAL_COUNTERS, TRANSPORT_COUNTERS
from .stats import zero as zero_stats

log = logging.getLogger(__name__)

#: The connector's protocol: the channel's compatibility string, so that a peer of another
#: version is refused at the handshake, by name.
PROTOCOL = "kvbridge-vllm/3"
#: Prefiller layouts a decoder rank keeps a read planner (or a refusal) for.
MAX_PLANNERS = 64
#: Decoder loads run here, off vLLM's step, so a slow peer never stalls a forward pass.
LOAD_THREADS = 4
#: A lease table read (128 bytes) that has not answered within this is given up and issued
#: again into another slot, until the load's deadline; each is counted and logged with the
#: channel's counters. Such a read answers in well under a millisecond; one that did not
#: answer in 20 s failed a CI run, cause not found.
LEASE_READ_STALL_S = 2.0
#: Seconds between asking the channel's counts when no other counter changed.
CHANNEL_COUNTS_EVERY_S = 1.0
#: Lease slots: one per load thread, and spares for the slots of reads given up (each back
#: once its read completed: scratch_slots.py).
LEASE_SLOTS = 4 * LOAD_THREADS
#: Digest scratch slots (digests.py), as the lease slots: one per load thread and spares,
#: a slot whose reads were given up never used again.
DIGEST_SLOTS = 4 * LOAD_THREADS
#: Digests one scratch slot holds (a load of more chunks is not checked): 1 MiB a slot.
DIGEST_SLOT_ROWS = 1 << 17
#: A load that took longer is slow: counted (``slow_loads``) and logged as a warning with
#: the time of each of its steps.
SLOW_LOAD_S = 1.0
#: A load over this budget (a base plus so much per MiB: reading memory of the same host
#: takes well under a millisecond per MiB) is logged at INFO with the time of each step.
BUDGET_BASE_S = 0.02
BUDGET_S_PER_MIB = 0.005
#: How long an idle step waits for a transfer's end (``wait_idle``) at first: a request
#: that comes to an engine idle but for transfers waits up to this much longer to be
#: scheduled; the worker's spin between steps takes about a millisecond on an idle host,
#: so the core is free about 90% of an idle engine's time.
IDLE_WAIT_S = 0.01
#: On vLLM CPU, where every server's worker computes on the same cores by default, the wait
#: grows to a quarter of the time the engine has been idle, up to this: on a loaded host
#: the spin between steps lasts as long as the engine core waits for a CPU (tens of ms),
#: and an engine that stepped idle every 10 ms still kept a decoder's worker off the core
#: for a whole lease. A request that comes after a long idle stretch waits up to this.
IDLE_WAIT_MAX_S = 0.2
#: A prefiller that is also a decoder (kv_both) looks for the end of its loads this often
#: while it waits for a notification.
IDLE_SLICE_S = 0.001


class LayoutError(ValueError):
    """The KV cache's memory layout cannot be moved page-per-block (names the layer)."""


class _LeaseReadStalled(Exception):
    """A lease table read had no answer in time and was given up (``reads``: reads issued;
    ``transfer``: the given-up read, left to complete, never cancelled)."""

    def __init__(self, reads: int, transfer: Any):
        super().__init__(reads)
        self.reads = reads
        self.transfer = transfer


def _lease_read_ended(transfer: Any) -> bool:
    """Whether no byte of a given-up lease table read can land in its slot any more: once
    the engine completed it (answered, refused, or failed at the op deadline with its
    session drained). A read of the lease table goes over TCP, where a read's completion
    comes only once nothing of it can land later (crates/kvbridge/src/datapath/mod.rs,
    module doc; scratch_slots.py), or by cross-memory attach, a copy the decoder's own
    thread makes and completes in place; never over UCX (the prefiller does not offer the
    table there)."""
    return bool(transfer.done)


def _log_channel_counters(ch: kvbridge.Channel, when: str) -> None:
    """Logs the channel's counters from a thread of its own: a channel whose runtime is stuck
    would hold the caller."""

    def run() -> None:
        try:
            log.warning("kvbridge: channel counters %s: %s", when, ch.stats())
        except Exception as e:
            log.warning("kvbridge: channel counters %s: unavailable (%s)", when, e)

    threading.Thread(target=run, name="kvbridge-counters", daemon=True).start()


class LoadError(RuntimeError):
    """A request's blocks could not be loaded (names the peer and the step).

    ``cause`` is one of ``stats.FAILURE_CAUSES``."""

    def __init__(self, message: str, cause: str = "other"):
        super().__init__(message)
        self.cause = cause


#: kvbridge errors after which the session to a prefiller is gone: the next load reconnects.
SESSION_ENDED = (
    kvbridge.ConnectionLost,
    kvbridge.PeerClosed,
    kvbridge.PeerRestarted,
    kvbridge.SessionReplaced,
    kvbridge.UnknownPeer,
    kvbridge.Disconnected,
)


def failure_cause(err: BaseException) -> str:
    if isinstance(err, LoadError):
        return err.cause
    if isinstance(err, TimeoutError):
        return "timeout"
    if isinstance(err, SESSION_ENDED):
        return "peer_lost"
    return "other"


@dataclass
class _Layer:
    name: str
    region: int
    page_bytes: int


@dataclass
class _Prefiller:
    """What the decoder holds per prefiller address. Its lock serialises connecting to that
    address only: a prefiller that is slow, hung or dying holds up loads from itself, never
    loads from another prefiller."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    peer: Peer | None = None
    # where its directory is read (granted to no peer; one byte longer than a directory,
    # so that peers never take it for one)
    scratch: bytearray = field(default_factory=lambda: bytearray(DIRECTORY_LEN + 1))
    scratch_region: int | None = None


@dataclass
class _Load:
    req_id: str
    job: RecvJob
    future: Future | None = None
    transfers: list = field(default_factory=list)
    started: float = 0.0
    finished: float = 0.0
    bytes: int = 0
    # vLLM's step delivered the job (a load the inbox started is reported only then)
    announced: bool = False
    # how it started: "inbox" (at allocation) or "step"
    via: str = "step"
    # monotonic times of its steps, for the slow-load warning (``started`` is when the
    # scheduler allocated its blocks): a load thread took it, the prefiller's session was
    # ready, every read was submitted, every read completed; lease table reads it took
    took_up: float = 0.0
    connected: float = 0.0
    posting: float = 0.0
    submitted: float = 0.0
    read: float = 0.0
    lease_checks: int = 0
    # ranged reads it issued, over every prefiller rank and layer
    ops: int = 0
    # its digest scratch slot while it holds one; the checks of each prefiller rank's reads
    digest_slot: int | None = None
    checks: dict = field(default_factory=dict)
    # its reads were given up (their bytes may still land)
    cancelled: bool = False
    #: After a cancel: whether no byte of the load's reads can land any more (_give_up_reads).
    reads_ended: bool = False


class KvbridgeWorker:
    def __init__(self, vllm_config: Any, settings: ConnectorSettings, num_blocks: int | None = None):
        self.vllm_config = vllm_config
        self.settings = settings
        self.block_size = vllm_config.cache_config.block_size
        if num_blocks is None:
            num_blocks = getattr(vllm_config.cache_config, "num_gpu_blocks", None)
        self._num_blocks = num_blocks if isinstance(num_blocks, int) else None
        # host buffers of a device KV cache (kv_buffer_device: "cpu"), and vLLM's copy op
        self.staging: HostStaging | None = None
        self._copy_op: CopyBlocksOp | None = None
        # prefiller with staging: requests whose blocks were copied to host and not held yet
        self._saved: set[str] = set()
        # prefiller: requests finished without being offered (never copied to host): freed
        # at the next get_finished
        self._free_now: set[str] = set()
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        try:
            self.tp_rank = get_tensor_model_parallel_rank()
        except Exception:  # not initialised (unit tests)
            self.tp_rank = 0
        self.tp_size = max(1, vllm_config.parallel_config.tensor_parallel_size)
        self.channel: kvbridge.Channel | None = None
        self.listen_addr: str | None = None
        self._tensors: list = []
        self.layers: list[_Layer] = []
        self._directory = bytearray(DIRECTORY_LEN)
        self._directory_region: int | None = None
        # prefiller: which finished requests it holds, for decoders to check after a read
        self._lease_table = LeaseTable()
        # decoder: where a load reads a lease table page: slots of one region registered
        # with the KV cache (a load never registers memory); a slot whose read was given up
        # comes back only once that read completed (its answer may land until then)
        self._lease_pages = bytearray(LEASE_SLOTS * LEASE_PAGE_BYTES)
        self._lease_pages_region: int | None = None
        self._lease_slots = ScratchSlots(LEASE_SLOTS)
        # integrity (digests.py): each layer's first byte by name, when the cache is host
        # memory; the prefiller's rows; the decoder's scratch for the rows it reads
        self._bases: dict[str, int] = {}
        self._digests: digests.DigestTable | None = None
        self._digests_region: int | None = None
        self._digest_scratch = bytearray()
        self._digest_scratch_region: int | None = None
        self._digest_slots = ScratchSlots(DIGEST_SLOTS)
        self._digest_slot_rows = 0
        self._unchecked_said: set[str] = set()
        # prefiller address -> its session and directory; the lock guards the dict only
        self._prefillers: dict[str, _Prefiller] = {}
        self._prefillers_lock = threading.Lock()
        # Loads and notices run on the transfer cores too: they are created by the worker's
        # main thread, on the compute cores, where that thread spins between steps.
        self._cores = transfer_core_set()
        self._pool = ThreadPoolExecutor(
            LOAD_THREADS, thread_name_prefix="kvbridge-load", initializer=run_on, initargs=(self._cores,)
        )
        # "read done" notices: each its own task on this loop, bounded by the channel's op
        # deadline, so a notice to a prefiller that is gone (or not answering) never waits
        # in a queue ahead of notices to other prefillers
        self._notices = NoticeLoop(self._cores)
        # decoder: request id -> its load; the step's thread and the inbox's both start
        # loads, under this lock, and each request's load starts once
        self._loads: dict[str, _Load] = {}
        self._loads_lock = threading.Lock()
        # set when a load ends, for an idle step's wait
        self._load_ended = threading.Event()
        # prefiller: a notification an idle step's wait took, for the next _finished_sending
        self._taken: list[tuple[str, bytes]] = []
        # loads the step started, kept until a late inbox datagram for them is stale
        self._started_by_step: dict[str, float] = {}
        self._inbox: LoadRequestInbox | None = None
        self._load_errors: set[int] = set()
        self._failed_recving: set[str] = set()
        # prefiller: request id -> monotonic deadline of its lease
        self._leases: dict[str, float] = {}
        # prefiller: which decoder ranks said done, per request (also before its hold)
        self._dones = done_notices.DoneCounts(settings.lease_s)
        # prefiller: the grant of each request held here (done_notices.py), until it is freed
        self._grants: dict[str, str] = {}
        # prefiller with kvbridge_read_grants: the read windows of held requests
        self._read_grants: ReadGrants | None = None
        self._forged_from: set[str] = set()
        # this rank's KV cache description (layout.py), set at registration
        self.layout: RankLayout | None = None
        # decoder: prefiller layout (its TpLayout, less its rank; or a synthetic one that
        # answers which ranks to read from and tell: rank_reads.synthetic_prefiller) -> the
        # planner of this rank's reads from it, or why the two cannot be translated
        self._planners: dict[str, kvbridge.ReadPlanner | LoadError] = {}
        # prefiller: requests marked held when their prompt was computed, not finished yet
        # -> when they were marked
        self._held_early: dict[str, float] = {}
        # when the engine's current run of idle steps began (None: the last step computed)
        self._idle_since: float | None = None
        # cumulative counters (stats.COUNTERS); vLLM gets the change since its last report
        self.stats: dict[str, int | float] = zero_stats()
        self._reported: dict[str, int | float] = zero_stats()
        self._channel_counted = 0.0  # when the channel's counts were last asked (monotonic)

    # ---- registration -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        import torch

        by_ptr: dict[int, _Layer] = {}
        described = []
        pending = []
        for name, t in kv_caches.items():
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"layer {name}: KV cache is a {type(t).__name__}, not one tensor")
        if needs_staging(kv_caches, self.settings.kv_buffer_device):
            self.staging = HostStaging(kv_caches, self._num_blocks)
            if self._copy_op is not None:
                self.staging.set_copy_op(self._copy_op)
            kv_caches = self.staging.pages
        for name, t in kv_caches.items():
            if t.dim() < 2 or not t[0].is_contiguous():
                raise LayoutError(
                    f"layer {name}: shape {tuple(t.shape)} strides {t.stride()}: one block is not one contiguous page"
                )
            page = t.stride(0) * t.element_size()
            if page < t[0].numel() * t.element_size():
                raise LayoutError(f"layer {name}: blocks overlap (stride {t.stride(0)})")
            described.append((name, tuple(t.shape[1:]), str(t.dtype), page))
            pending.append((name, t, page))
        try:
            facts = ModelFacts.of(self.vllm_config)
        except (AttributeError, TypeError, ValueError) as e:
            model = str(getattr(self.vllm_config.model_config, "model", "?"))
            pages = pages_description(described, self.block_size, model, self.tp_size)
            self.layout = RankLayout(pages, None, f"the model's KV heads are unknown ({type(e).__name__})")
        else:
            self.layout = describe(described, facts, self.tp_rank, self.tp_size)
        if self.layout.tp is None:
            log.info(
                "kvbridge: this rank's KV cache reads as whole pages only, from a prefiller of the same TP "
                "size and layout: %s", self.layout.why_not,
            )  # fmt: skip
        listen = None
        if self.settings.is_producer:
            listen = f"{numeric_host(self.settings.host)}:{self.settings.base_port + self.tp_rank}"
        with transfer_cores(self._cores):
            self.channel = kvbridge.Channel(
                f"vllm-{self.settings.engine_id}-tp{self.tp_rank}",
                listen,
                secret=self.settings.secret,
                transport=self.settings.transport,
                compat=PROTOCOL,
            )
        # registered memory must outlive the registration: vLLM keeps its KV cache for the
        # process's life, but a reference here makes that a property of this class
        self._tensors = [t for _, t, _ in pending]
        try:
            for name, t, page in pending:
                ptr = t.data_ptr()
                if ptr in by_ptr:  # layers sharing one cache
                    self.layers.append(_Layer(name, by_ptr[ptr].region, page))
                    continue
                # decoders read a prefiller's blocks and never write them: over TCP the
                # prefiller refuses a write; a same-host decoder that copies by itself
                # (cross-memory attach) is trusted as a process of the same user is. With
                # read grants, reads only inside a held request's windows, all over TCP
                # (read_grants.py)
                confined = self.settings.read_grants
                rid = self.channel.register(
                    ptr,
                    t.shape[0] * page,
                    page,
                    access="read",
                    direct_copies=not confined,
                    windows="read" if confined else None,
                )
                by_ptr[ptr] = _Layer(name, rid, page)
                self.layers.append(by_ptr[ptr])
            entries = {layer.name: str(layer.region) for layer in self.layers}
            # Read by a same-host decoder's own thread (cross-memory attach), as the blocks
            # are, where the blocks are: over TCP the prefiller's transfer thread serves it,
            # and a vLLM worker spinning on that thread's core kept it off for seconds (a
            # decoder at TP 2 on 2 cores: every lease read stalled while the blocks' reads
            # took 3 ms). Read-only holds only over TCP; a same-host peer that may copy the
            # blocks can reach all of this process's memory anyway (docs/threat-model.md).
            # Not over UCX: a UCX get that failed may still land (scratch_slots.py).
            lease_direct = not self.settings.read_grants and self.channel.transport != "ucx"
            leases = self.channel.register_buffer(
                self._lease_table.memory, LEASE_PAGE_BYTES, access="read", direct_copies=lease_direct
            )
            integrity = self._register_digests(pending)
            if self.settings.read_grants:
                confined = {layer.region: layer.page_bytes for layer in self.layers}
                if self._digests is not None and self._digests_region is not None:
                    confined[self._digests_region] = self._digests.chunks * digests.ROW_BYTES
                blocks = int(pending[0][1].shape[0]) if pending else 0
                self._read_grants = ReadGrants(self.channel, list(confined.items()), blocks)
            doc = {
                "layers": entries,
                "leases": str(leases),
                "engine_id": self.settings.engine_id,
                "tp_rank": self.tp_rank,
                "tp_size": self.tp_size,
                "pages": self.layout.pages,
                "layout": self.layout.tp,
                "dtype": self.layout.dtype,
                "why_not": self.layout.why_not,
                "token_rows": self.layout.token_rows,
                "read_grants": self.settings.read_grants,
                **integrity,
            }
            body = DIRECTORY_MAGIC + json.dumps(doc).encode()
            if len(body) > DIRECTORY_LEN:
                raise LayoutError(f"{len(self.layers)} layers do not fit the {DIRECTORY_LEN}-byte directory")
            self._directory[: len(body)] = body
            self._directory_region = self.channel.register_buffer(self._directory, DIRECTORY_LEN, access="read")
            self._lease_pages_region = self.channel.register_buffer(self._lease_pages, LEASE_PAGE_BYTES, peers=[])
        except BaseException:
            self.channel.close()
            self.channel = None
            self.layers = []
            self._tensors = []
            self.staging = None
            self._digests = None
            self._digest_scratch_region = None
            self._read_grants = None
            raise
        self.listen_addr = self.channel.local_addr
        log.info(
            "kvbridge: %d KV layers registered, listening on %s (%s)",
            len(self.layers), listen, self.layout.tp_json() or self.layout.pages,
        )  # fmt: skip
        if self.settings.is_consumer and getattr(self.vllm_config, "max_concurrent_batches", 1) == 1:
            self._inbox = LoadRequestInbox(self.tp_rank, self._start_from_inbox, self._cores)

    def _register_digests(self, pending: list) -> dict:
        """Integrity (digests.py), where the KV cache is host memory: a prefiller's digest
        rows, a decoder's scratch for the rows it reads. Returns the directory's entries."""
        if not self.settings.integrity or not pending:
            return {}
        assert self.channel is not None
        why_not = ""
        if any(t.device.type != "cpu" for _, t, _ in pending):
            why_not = "the KV cache is not in host memory"
        elif len({page for _, _, page in pending}) != 1:
            why_not = "the layers' pages differ in size"
        if why_not:
            log.warning("kvbridge: kvbridge_integrity is on, but %s: loads of this rank are not checked", why_not)
            return {}
        self._bases = {name: t.data_ptr() for name, t, _ in pending}
        _, first, page = pending[0]
        chunks = digests.chunks_per_block(self.layout.tp, tuple(first.shape[1:]))
        out: dict = {}
        if self.settings.is_producer:
            self._digests = digests.DigestTable(int(first.shape[0]), chunks, page)
            # reached as the KV is (direct copies, UCX; with read grants only inside the
            # windows of a held request, read_grants.py): its rows come in the KV's batches
            confined = self.settings.read_grants
            rows = self.channel.register_buffer(
                self._digests.memory,
                digests.ROW_BYTES,
                access="read",
                direct_copies=not confined,
                windows="read" if confined else None,
            )
            self._digests_region = rows
            out = {
                "digests": str(rows),
                "digest_chunk_bytes": self._digests.chunk_bytes,
                "digest_algorithm": kvbridge.DIGEST_ALGORITHM,
            }
        if self.settings.is_consumer:
            self._digest_slot_rows = min(DIGEST_SLOT_ROWS, int(first.shape[0]) * chunks)
            self._digest_scratch = bytearray(DIGEST_SLOTS * self._digest_slot_rows * digests.ROW_BYTES)
            self._digest_scratch_region = self.channel.register_buffer(
                self._digest_scratch, digests.ROW_BYTES, peers=[]
            )
        return out

    def _layer_bases(self) -> list[int]:
        """Each layer's first byte, in the order of the layers' names (digests.py)."""
        return [self._bases[name] for name in sorted(self._bases)]

    def handshake_metadata(self) -> InboxAddress | None:
        """For the scheduler: where this rank takes loads at allocation (a consumer only)."""
        if not self.settings.is_consumer:
            return None
        return InboxAddress(self._inbox.path if self._inbox is not None else "")

    def set_host_xfer_buffer_ops(self, copy_op: CopyBlocksOp) -> None:
        """vLLM's block copy op between the KV cache and host buffers (used when staging)."""
        self._copy_op = copy_op
        if self.staging is not None:
            self.staging.set_copy_op(copy_op)

    # ---- prefiller with staging: saves ---------------------------------------------------

    def save_to_host(self, reqs_to_save: dict[str, list[int]]) -> None:
        """Copies the blocks of requests whose prompt this step computed to the host buffers,
        from vLLM's ``wait_for_save``: after the forward pass, before the step's output
        reaches the scheduler (which then returns the requests' ``kv_transfer_params``). A
        request whose copy failed is never held: its blocks are freed when it finishes and a
        decoder's load of it fails as ``lease_ended``."""
        if self.staging is None:
            return
        for req_id, blocks in reqs_to_save.items():
            try:
                self.staging.to_host(blocks)
            except StagingError as e:
                self._saved.discard(req_id)
                log.error("kvbridge: request %s: %s; its blocks are not offered to decoders", req_id, e)
            else:
                self._saved.add(req_id)

    # ---- prefiller: holds ---------------------------------------------------------------------

    def wait_for_save(self, meta: KvbridgeConnectorMetadata) -> None:
        """After the forward pass, before the step's output reaches the scheduler: the
        staged prompts this step completed go to host memory, and the requests that finish
        with this step are marked held, so that the decoder that gets their
        ``kv_transfer_params`` finds them held at its first look."""
        if meta.reqs_to_save:
            self.save_to_host(meta.reqs_to_save)
        self._grants.update(meta.grants)
        now = time.monotonic()
        for req_id in meta.reqs_to_hold:
            if self.staging is not None and req_id not in self._saved:
                continue  # not on the host: start_load_kv frees it when it finishes
            if not self._ready_to_hold(req_id, meta.hold_blocks.get(req_id)):
                continue  # never held: its decoder's load fails, the blocks are freed
            if self._lease_table.hold(req_id):
                self._held_early[req_id] = now
                log.info("kvbridge: request %s held for its decoder (prompt computed)", req_id)
            else:
                self._unmarked(req_id)

    def _ready_to_hold(self, req_id: str, blocks: list[int] | None) -> bool:
        """What must be in place before a request is marked held: its digests written, its
        blocks opened to its grant. False when either failed (logged; not held)."""
        return self._record_digests(req_id, blocks) and self._open_reads(req_id, blocks)

    def _record_digests(self, req_id: str, blocks: list[int] | None) -> bool:
        """Writes the digests of a request's blocks, before it is marked held; False (and
        logged) when they cannot be written, so that no decoder takes its blocks unchecked."""
        if self._digests is None:
            return True
        try:
            if blocks is None:
                raise ValueError("the scheduler named no blocks for it")
            self._digests.record(self._layer_bases(), blocks)
        except ValueError as e:
            self._lease_table.end(req_id)  # its decoder's load fails at its first look
            log.error("kvbridge: request %s: its digests were not written (%s); not offered to decoders", req_id, e)
            return False
        return True

    def _open_reads(self, req_id: str, blocks: list[int] | None) -> bool:
        """With read grants, opens the request's blocks to its grant, before it is marked
        held (a decoder that finds it held can read them); False (and logged) when they
        cannot be opened: it is not held, and its decoder's load fails."""
        if self._read_grants is None:
            return True
        try:
            grant = self._grants.get(req_id)
            if grant is None or blocks is None:
                raise ValueError("the scheduler named no grant or no blocks for it")
            self._read_grants.open(req_id, grant, blocks)
        except (kvbridge.KvbridgeError, ValueError) as e:
            self._lease_table.end(req_id)
            log.error("kvbridge: request %s: its blocks were not opened to its grant (%s); not offered", req_id, e)
            return False
        return True

    def _close_reads(self, req_id: str) -> None:
        """Closes the request's windows (read_grants.py): before its blocks go back to vLLM."""
        if self._read_grants is not None:
            self._read_grants.close(req_id)

    def _unmarked(self, req_id: str) -> None:
        self.stats["leases_unmarked"] += 1
        log.warning(
            "kvbridge: lease table group of %s is full (%d requests held): its decoder's load "
            "will fail at its deadline", req_id, self._lease_table.held(),
        )  # fmt: skip

    def before_forward(self, meta: KvbridgeConnectorMetadata) -> None:
        """When vLLM binds the step's metadata, before its forward pass can write into any
        block freed since the last step: ends the marks of requests that finished without
        a delayed free, and of any still unfinished a lease after their mark (ending a mark
        is always safe: a decoder's load fails)."""
        now = time.monotonic()
        if not meta.idle:
            self._idle_since = None
        for req_id in meta.reqs_not_sent:
            self._held_early.pop(req_id, None)
            self._grants.pop(req_id, None)
            self._saved.discard(req_id)
            self._close_reads(req_id)
            self._lease_table.end(req_id)
            log.info("kvbridge: request %s ended without a delayed free: unmarked", req_id)
        for req_id, since in list(self._held_early.items()):
            if req_id not in meta.reqs_to_send and now - since > self.settings.lease_s:
                del self._held_early[req_id]
                self._close_reads(req_id)
                self._lease_table.end(req_id)
                log.warning(
                    "kvbridge: request %s marked held %.0f s ago and not finished: unmarked", req_id, now - since
                )

    # ---- decoder: loads ---------------------------------------------------------------------

    def start_load_kv(self, meta: KvbridgeConnectorMetadata) -> None:
        now = time.monotonic()
        self._grants.update(meta.grants)
        for req_id, lease_s in meta.reqs_to_send.items():
            if self.staging is not None and req_id not in self._saved:
                # its blocks never reached the host buffers: no decoder may take them
                self.stats["saves_failed"] += 1
                self._lease_table.end(req_id)
                self._free_now.add(req_id)
                log.warning("kvbridge: request %s finished without its blocks copied to host: freed", req_id)
                continue
            self._saved.discard(req_id)
            self._leases[req_id] = now + lease_s
            if self._held_early.pop(req_id, None) is not None:
                continue
            if not self._ready_to_hold(req_id, meta.hold_blocks.get(req_id)):
                continue
            if self._lease_table.hold(req_id):
                log.info("kvbridge: request %s held for its decoder (finished)", req_id)
            else:
                self._unmarked(req_id)
        for req_id, job in meta.reqs_to_recv.items():
            with self._loads_lock:
                load = self._loads.get(req_id)
                if load is not None:
                    load.announced = True  # the inbox started it
                    continue
                load = _Load(req_id, job, started=job.allocated or now, announced=True)
                self._loads[req_id] = load
                if self._inbox is not None and job.local_block_ids and not job.error:
                    self._forget_stale_starts(now)
                    self._started_by_step[req_id] = now
            if job.error:
                # the scheduler found the request's kv_transfer_params unusable: the load
                # fails here, typed and counted, and vLLM's kv_load_failure_policy applies
                load.future = Future()
                load.future.set_exception(LoadError(job.error, "bad_params"))
                if job.notify:
                    self._notify_job(job)
            elif job.local_block_ids:
                self._submit(load)
            else:
                # nothing to read (a request that ended before it was scheduled): only the
                # prefiller's notice, which takes neither a load thread nor a connect slot
                load.future = Future()
                load.future.set_result(None)
                if job.notify:
                    self._notify_job(job)

    def _start_from_inbox(self, req_id: str, job: RecvJob) -> None:
        """A load the scheduler sent at allocation (load_requests.py); on the inbox's thread."""
        now = time.monotonic()
        with self._loads_lock:
            self._forget_stale_starts(now)
            if req_id in self._loads or req_id in self._started_by_step:
                return
            load = _Load(req_id, job, started=job.allocated, via="inbox")
            self._loads[req_id] = load
            self._submit(load)

    def _forget_stale_starts(self, now: float) -> None:
        """Drops the loads the step started long enough ago that no datagram for them can
        still be taken (the inbox drops those older than ``STALE_S``); oldest first, under
        ``_loads_lock``."""
        while self._started_by_step:
            r, t = next(iter(self._started_by_step.items()))
            if now - t <= 2 * STALE_S:
                break
            del self._started_by_step[r]

    def _submit(self, load: _Load) -> None:
        load.future = self._pool.submit(self._load, load)
        load.future.add_done_callback(lambda _: self._load_ended.set())

    def _notify_job(self, job: RecvJob) -> None:
        """The "read done" notices for a job that reads nothing, from vLLM's step: an address
        that does not resolve (it came from the client) is a failed notice, not an exception
        in the step."""
        try:
            notices = self._notice_ranks(job.remote_tp_size)
            addrs = {rank: self._addr(job, rank) for rank in notices}
        except (ConfigError, LoadError) as e:
            self.stats["notices_failed"] += 1
            log.warning(
                "kvbridge: cannot tell prefiller %s that %s is read: %s", job.remote_host, job.remote_request_id, e
            )
            return
        for rank, expected in notices.items():
            self._notify_done(addrs[rank], None, job.remote_request_id, job.grant, expected)

    def _addr(self, job: RecvJob, rank: int) -> str:
        """Where prefiller rank ``rank`` of the job's engine listens (its port plus the rank)."""
        return f"{numeric_host(job.remote_host)}:{job.remote_port + rank}"

    # ---- decoder: which prefiller ranks, and how --------------------------------------------

    def _rank_planner(self, prefiller_tp: int) -> kvbridge.ReadPlanner | None:
        """The planner of which prefiller ranks this rank reads from and tells, before any
        prefiller directory is read (rank_reads.synthetic_prefiller); None reading pages."""
        if self.layout is None or self.layout.tp is None:
            if prefiller_tp != self.tp_size:
                raise LoadError(
                    f"a prefiller of TP size {prefiller_tp} and this decoder of TP size {self.tp_size}: this "
                    f"rank's KV cache reads as whole pages only ({self.layout.why_not if self.layout else '?'})",
                    "refused",
                )
            return None
        synthetic = rank_reads.synthetic_prefiller(self.layout.tp, prefiller_tp)
        return self._decided(synthetic, lambda: self._translation(
            synthetic, f"a prefiller of TP size {prefiller_tp} for this decoder rank's layout"))  # fmt: skip

    def _notice_ranks(self, prefiller_tp: int) -> dict[int, int]:
        """Prefiller rank -> how many decoder ranks it waits for, for the ranks this rank
        tells it is done with a request (rank_reads.notice_ranks)."""
        planner = self._rank_planner(prefiller_tp)
        if planner is None:
            return {self.tp_rank: 1}
        return rank_reads.notice_ranks(planner, self.tp_rank, self.tp_size, prefiller_tp)

    def _source_ranks(self, prefiller_tp: int) -> list[int]:
        planner = self._rank_planner(prefiller_tp)
        return [self.tp_rank] if planner is None else list(planner.source_ranks())

    def _planner(self, peer: Peer, addr: str) -> kvbridge.ReadPlanner | None:
        """How this rank reads from ``peer``: a planner of translated reads, None for whole
        pages; a :class:`LoadError` (``refused``) naming both layouts when neither works.
        Decided once per prefiller layout."""
        mine, theirs = self.layout, peer.layout
        assert mine is not None and theirs is not None
        if mine.tp is None or theirs.tp is None:
            if theirs.pages == mine.pages and peer.tp_size == self.tp_size:
                return None
            raise LoadError(
                f"prefiller {peer.peer_id} ({addr}): incompatible layouts: its KV cache {theirs.pages} at TP size "
                f"{peer.tp_size}, this rank's {mine.pages} at TP size {self.tp_size}; whole pages need equal ones, "
                f"and translation needs both described ({theirs.why_not or mine.why_not})",
                "refused",
            )
        key = json.dumps({**theirs.tp, "tp_rank": 0}, sort_keys=True) + theirs.dtype + str(theirs.token_rows)
        return self._decided(key, lambda: self._checked_translation(peer, addr))

    def _checked_translation(self, peer: Peer, addr: str) -> kvbridge.ReadPlanner | LoadError:
        mine, theirs = self.layout, peer.layout
        assert mine is not None and mine.tp is not None and theirs is not None and theirs.tp is not None
        blocks = (theirs.tp["block_tokens"], mine.tp["block_tokens"])
        if blocks[0] != blocks[1] and not (theirs.token_rows and mine.token_rows):
            return LoadError(
                f"prefiller {peer.peer_id} ({addr}): incompatible layouts: its blocks hold {blocks[0]} tokens, this "
                f"rank's {blocks[1]}, and a block's tokens are not rows ranged reads can cut (vLLM CPU's attention "
                "keeps K transposed inside a block): start both with the same --block-size",
                "refused",
            )
        if theirs.dtype != mine.dtype:
            return LoadError(
                f"prefiller {peer.peer_id} ({addr}): incompatible layouts: its KV cache holds {theirs.dtype}, "
                f"this rank's {mine.dtype}",
                "refused",
            )
        return self._translation(theirs.tp_json() or "", f"prefiller {peer.peer_id} ({addr})")

    def _translation(self, prefiller_json: str, what: str) -> kvbridge.ReadPlanner | LoadError:
        """kvbridge-pd's planner of this rank's reads from a prefiller laid out as
        ``prefiller_json``, or the refusal naming both layouts."""
        assert self.layout is not None
        try:
            return kvbridge.ReadPlanner(prefiller_json, self.layout.tp_json())
        except (kvbridge.Incompatible, ValueError) as e:
            return LoadError(f"{what}: incompatible layouts: {e}", "refused")

    def _decided(self, key: str, decide) -> kvbridge.ReadPlanner:
        """The planner for the prefiller layout ``key``, decided once (a refusal logged once):
        the table keeps up to ``MAX_PLANNERS`` layouts, a peer's layouts being untrusted."""
        got = self._planners.get(key)
        if got is None:
            got = decide()
            if isinstance(got, LoadError):
                log.error("kvbridge: %s", got)
            if len(self._planners) < MAX_PLANNERS:
                self._planners[key] = got
        if isinstance(got, LoadError):
            raise got
        return got

    # ---- decoder: sessions ------------------------------------------------------------------

    def _prefiller(self, addr: str) -> _Prefiller:
        with self._prefillers_lock:
            return self._prefillers.setdefault(addr, _Prefiller())

    def _peer(self, job: RecvJob, rank: int, deadline: float) -> Peer:
        """The session to prefiller rank ``rank`` of the job's engine, its directory read and
        checked against the job (engine, rank, TP size)."""
        addr = self._addr(job, rank)
        pf = self._prefiller(addr)
        if not pf.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise LoadError(
                f"connect to prefiller {addr}: an earlier connection attempt to it was still under way "
                f"at the deadline kvbridge_read_timeout_s={self.settings.read_timeout_s}",
                "timeout",
            )
        try:
            peer = self._peer_locked(addr, pf, deadline)
        finally:
            pf.lock.release()
        if job.remote_engine_id != peer.engine_id:
            raise LoadError(
                f"prefiller {peer.peer_id} ({addr}) serves engine {peer.engine_id}, not {job.remote_engine_id} "
                f"that computed request {job.remote_request_id} (restarted, or another engine on its address)",
                "peer_lost",
            )
        if (peer.tp_rank, peer.tp_size) != (rank, job.remote_tp_size):
            raise LoadError(
                f"prefiller {peer.peer_id} ({addr}) is TP rank {peer.tp_rank} of {peer.tp_size}, and request "
                f"{job.remote_request_id}'s kv_transfer_params put rank {rank} of {job.remote_tp_size} there",
                "bad_params",
            )
        return peer

    def _peer_locked(self, addr: str, pf: _Prefiller, deadline: float) -> Peer:
        ch = self.channel
        assert ch is not None
        if pf.peer is not None:
            try:
                ch.peer_regions(pf.peer.peer_id)  # raises once its session ended
                return pf.peer
            except SESSION_ENDED:
                pf.peer = None  # the prefiller restarted: connect to the new one
        try:
            peer_id = ch.connect(addr)
        except kvbridge.KvbridgeError as e:
            cause = "refused" if isinstance(e, (kvbridge.PeerError, kvbridge.Rejected)) else "unreachable"
            raise LoadError(f"connect to prefiller {addr}: {type(e).__name__}: {e}", cause) from e
        regions = ch.peer_regions(peer_id)
        directory = [r for r in regions if r.length == DIRECTORY_LEN and r.page_size == DIRECTORY_LEN]
        if len(directory) != 1:
            raise LoadError(f"prefiller {peer_id} ({addr}) publishes no layer directory")
        if pf.scratch_region is None:
            pf.scratch_region = ch.register_buffer(pf.scratch, DIRECTORY_LEN + 1, peers=[])
        pf.scratch[:] = bytes(len(pf.scratch))
        t = ch.submit_read_pages(peer_id, pf.scratch_region, [0], directory[0].id, [0], DIRECTORY_LEN)
        try:
            t.wait(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            # the scratch page is read again by the next load: nothing of this read may land
            self._give_up_reads([t], [peer_id], "layer directory read deadline passed")
            raise LoadError(
                f"reading the layer directory of prefiller {peer_id} ({addr}): "
                f"deadline kvbridge_read_timeout_s={self.settings.read_timeout_s} passed",
                "timeout",
            ) from None
        except SESSION_ENDED as e:
            raise LoadError(
                f"reading the layer directory of prefiller {peer_id} ({addr}): session ended: {type(e).__name__}: {e}",
                "peer_lost",
            ) from e
        theirs = bytes(pf.scratch[:DIRECTORY_LEN])
        if not theirs.startswith(DIRECTORY_MAGIC):
            raise LoadError(f"prefiller {peer_id} ({addr}): bad layer directory")
        try:
            peer = parse_directory(peer_id, json.loads(theirs[len(DIRECTORY_MAGIC) :].rstrip(b"\0")))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise LoadError(f"prefiller {peer_id} ({addr}): bad layer directory ({type(e).__name__}: {e})") from None
        missing = [l.name for l in self.layers if l.name not in peer.regions]
        if missing:
            raise LoadError(f"prefiller {peer_id} ({addr}) lacks layers {missing[:4]}")
        pf.peer = peer
        return pf.peer

    def _check_lease(self, peer: Peer, job: RecvJob, addr: str, deadline: float) -> int:
        """After the request's blocks are read: fails the load unless the prefiller still
        held them (lease_table.py says why this order makes the read safe). Returns how many
        reads of the table it took."""
        ch = self.channel
        assert ch is not None and self._lease_pages_region is not None
        reads = 0
        while True:
            try:
                slot = self._lease_slots.take(deadline)
            except SlotsTaken:
                raise LoadError(f"no lease page free by the deadline for {job.remote_request_id}", "timeout") from None
            try:
                done = self._read_lease(ch, slot, peer, job, addr, deadline)
            except _LeaseReadStalled as stalled:
                # the slot comes back only once the given-up read completed: until then its
                # answer may still land there
                self._lease_slots.park(slot, stalled.transfer, _lease_read_ended)
                reads += stalled.reads
            except BaseException:
                self._lease_slots.give_back(slot)
                raise
            else:
                self._lease_slots.give_back(slot)
                return reads + done
            self.stats["lease_reads_stalled"] += 1
            req = job.remote_request_id
            if time.monotonic() >= deadline:
                raise LoadError(
                    f"reading the lease of request {req} from prefiller {peer.peer_id} ({addr}): "
                    f"deadline kvbridge_read_timeout_s={self.settings.read_timeout_s} passed",
                    "timeout",
                )
            log.warning(
                "kvbridge: lease read of request %s from prefiller %s (%s) had no answer in %.1f s; issued "
                "again (%d lease slots free, %d waiting for a given-up read to end)",
                req, peer.peer_id, addr, LEASE_READ_STALL_S, self._lease_slots.free(), self._lease_slots.parked(),
            )  # fmt: skip
            _log_channel_counters(ch, f"after a stalled lease read from {peer.peer_id}")

    def _read_lease(self, ch: kvbridge.Channel, slot: int, peer: Peer, job: RecvJob, addr: str, deadline: float) -> int:
        """Reads the request's lease into ``slot`` until it is marked; raises
        ``_LeaseReadStalled`` when a read has no answer within ``LEASE_READ_STALL_S`` or by the
        deadline."""
        page = memoryview(self._lease_pages)[slot * LEASE_PAGE_BYTES : (slot + 1) * LEASE_PAGE_BYTES]
        req = job.remote_request_id
        pause = 0.002
        reads = 0
        while True:
            reads += 1
            t = ch.submit_read_pages(peer.peer_id, self._lease_pages_region, [slot], peer.leases, [where(req)])
            try:
                t.wait(min(LEASE_READ_STALL_S, max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                # Left running rather than cancelled: it ends at the latest at the engine's
                # op deadline (which ends the session it stalls on), its slot comes back
                # then (scratch_slots.py), and its answer, should it come, is not mistaken
                # for the next read's.
                raise _LeaseReadStalled(reads, t) from None
            found = lease_state(req, bytes(page))
            if found is LeaseState.HELD:
                return reads
            if found is LeaseState.ENDED:
                raise LoadError(
                    f"request {req} on prefiller {peer.peer_id} ({addr}): its lease ended (or its blocks were "
                    "freed) before the read was checked; the blocks read may belong to another request",
                    "lease_ended",
                )
            # not marked yet: a prefiller marks a request that went on past its prompt
            # (max_tokens above 1) in its step after the request finished
            if time.monotonic() + pause > deadline:
                raise LoadError(
                    f"request {req} on prefiller {peer.peer_id} ({addr}): not in its lease table by the deadline "
                    f"kvbridge_read_timeout_s={self.settings.read_timeout_s} (restarted prefiller, or its table "
                    "group full)",
                    "timeout",
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _load(self, load: _Load) -> None:
        """One request's load on this rank: the sessions to the prefiller ranks it reads
        from, one batch of reads to each, then each one's lease check; and, whatever
        happened, the "done" notices to every prefiller rank that waits for this rank."""
        job = load.job
        load.took_up = time.monotonic()
        deadline = load.started + self.settings.read_timeout_s
        peers: dict[int, Peer] = {}
        unreachable: set[int] = set()
        try:
            self._read_ranks(load, deadline, peers, unreachable)
            load.finished = time.monotonic()
            self._log_if_over_budget(load, self._addr(job, min(peers)) if peers else job.remote_host)
        except TimeoutError:
            load.cancelled = True
            why = f"reads of request {job.remote_request_id} passed kvbridge_read_timeout_s"
            load.reads_ended = self._give_up_reads(load.transfers, [p.peer_id for p in peers.values()], why)
            raise LoadError(
                f"reading request {job.remote_request_id} from prefiller ranks {sorted(peers)} at "
                f"{job.remote_host}: deadline kvbridge_read_timeout_s={self.settings.read_timeout_s} passed",
                "timeout",
            ) from None
        except SESSION_ENDED as e:
            # a prefiller rank is gone (killed, restarted): the next request for its address
            # connects to whatever listens there now (_peer_locked checks the session)
            raise LoadError(
                f"reading request {job.remote_request_id} from prefiller ranks {sorted(peers)} at "
                f"{job.remote_host}: session ended: {type(e).__name__}: {e}",
                "peer_lost",
            ) from e
        finally:
            # a slot whose reads did not all end may still be written: never used again
            ended = load.reads_ended if load.cancelled else all(t.done for t in load.transfers)
            if load.digest_slot is not None and ended:
                self._digest_slots.give_back(load.digest_slot)
            load.digest_slot = None
            # off the load's path: the blocks are usable now, whether or not (or however
            # slowly) the prefiller takes the notification
            self._notify_ranks(job, peers, unreachable)

    def _give_up_reads(self, transfers: list, peer_ids: list[str], why: str) -> bool:
        """Reads given up at their deadline, ended so that none of their bytes lands in
        memory vLLM may hand out again: each is cancelled (``True`` once nothing of it can
        land any more: a copy under way has ended, a late answer over TCP is dropped), then
        every session they went over is ended (``disconnect`` returns once its readers
        stopped). The disconnect stays although the cancel alone keeps the blocks safe over
        TCP, shared memory and cross-memory attach: a prefiller rank that let a read pass
        its deadline is dead or stalled, and the next load had better dial it afresh than
        queue behind it; and over UCX a cancel ends the session without waiting for its
        teardown, which the disconnect does wait for. Other loads on those sessions fail
        as ``peer_lost``; the next load dials again. Returns whether all of that was
        confirmed; when not, says so loudly (the blocks are still reported, or the request
        would never end)."""
        ch = self.channel
        assert ch is not None
        confirmed = all([t.cancel() for t in transfers])
        for pid in dict.fromkeys(peer_ids):
            try:
                ch.disconnect(pid, why)
            except kvbridge.UnknownPeer:
                pass  # that session already ended, its readers with it
            except kvbridge.KvbridgeError as e:
                confirmed = False
                log.error("kvbridge: ending the session with prefiller %s after %s failed: %s: %s", pid, why,
                          type(e).__name__, e)  # fmt: skip
        if not confirmed:
            log.error("kvbridge: %s; reads given up may still land in their blocks", why)
        return confirmed

    def _read_ranks(self, load: _Load, deadline: float, peers: dict[int, Peer], unreachable: set[int]) -> None:
        job = load.job
        ch = self.channel
        assert ch is not None
        sources = self._source_ranks(job.remote_tp_size)
        for rank in sources:
            try:
                peers[rank] = self._peer(job, rank, deadline)
            except LoadError as e:
                if e.cause in ("unreachable", "timeout"):
                    unreachable.add(rank)
                raise
        load.connected = time.monotonic()
        if not job.local_block_ids:
            return
        first = peers[sources[0]]
        for rank in sources[1:]:
            if not same_engine_layout(first, peers[rank]):
                raise LoadError(
                    f"prefiller ranks {sources[0]} and {rank} at {job.remote_host} describe different KV caches",
                    "refused",
                )
        planner = self._planner(first, self._addr(job, sources[0]))
        try:
            reads = self._reads(planner, peers[sources[0]], job)
        except ValueError as e:
            raise LoadError(f"request {job.remote_request_id}: {e}", "bad_params") from None
        load.posting = time.monotonic()
        self._plan_checks(load, reads, peers, deadline)
        try:
            self._read_all(load, reads, peers, deadline)
        except kvbridge.Rejected as e:
            if e.code != "AccessDenied":
                raise
            # With read grants, a request that finished after its prompt (not held in the
            # step that computed it) has its blocks opened to its grant in the prefiller's
            # next step, which may come after this decoder got its parameters: once the
            # lease table shows it held, its windows are open; read once more.
            for rank in reads.by_rank:
                load.lease_checks += self._check_lease(peers[rank], job, self._addr(job, rank), deadline)
            try:
                self._read_all(load, reads, peers, deadline)
            except kvbridge.Rejected as again:
                if again.code != "AccessDenied":
                    raise
                raise LoadError(
                    f"request {job.remote_request_id}: the prefiller refused reads under its grant though it "
                    f"holds the request: {again}",
                    "refused",
                ) from None
        load.read = time.monotonic()
        for rank in reads.by_rank:
            load.lease_checks += self._check_lease(peers[rank], job, self._addr(job, rank), deadline)
        if load.checks:
            self._check_digests(load, peers, deadline)

    @staticmethod
    def _token(peer: Peer, job: RecvJob) -> bytes | None:
        """The grant a load names to ``peer``: only to a prefiller that confines its reads
        to grants (read_grants.py), since a batch under a token goes over TCP, where the
        prefiller checks it, never by cross-memory attach."""
        if not peer.read_grants or not job.grant:
            return None
        try:
            return bytes.fromhex(job.grant)
        except ValueError:
            raise LoadError(f"request {job.remote_request_id}: its grant is not hex", "bad_params") from None

    def _read_all(self, load: _Load, reads: rank_reads.RankReads, peers: dict[int, Peer], deadline: float) -> None:
        """One batch per prefiller rank for every layer, adjacent bytes in one range (the
        engine checks and moves each as one transfer: one completion, not one a layer), the
        digests of what it reads in the same batch; returns once all completed."""
        ch = self.channel
        assert ch is not None
        load.bytes, load.ops = 0, 0
        batches = []
        for rank, ranges in reads.by_rank.items():
            peer = peers[rank]
            ops = []
            for layer in self.layers:
                unit = layer.page_bytes if reads.pages else 1
                remote = peer.regions[layer.name]
                for src, dst, n in ranges:
                    ops.append((layer.region, dst * unit, remote, src * unit, n * unit))
                    load.bytes += n * unit
            load.ops += len(ops)
            check = load.checks.get(rank)
            if check is not None:
                assert self._digest_scratch_region is not None and peer.digests is not None
                ops += digests.row_ops(check, self._digest_scratch_region, peer.digests)
            batches.append(ch.submit_read(peer.peer_id, ops, token=self._token(peer, load.job)))
        load.transfers += batches
        load.submitted = time.monotonic()
        for t in batches:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            t.wait(left)

    def _plan_checks(self, load: _Load, reads: rank_reads.RankReads, peers: dict[int, Peer], deadline: float) -> None:
        """Which chunks of the load's reads are checked against the prefiller's digests
        (digests.py): all of them where every prefiller rank offers digests and the rows fit
        one scratch slot, else none (logged)."""
        if self._digest_scratch_region is None or not reads.by_rank:
            return
        missing = sorted(r for r in reads.by_rank if peers[r].digests is None)
        if missing:
            self._log_unchecked(f"prefiller ranks {missing} at {load.job.remote_host} offer no digests")
            return
        unit = self.layers[0].page_bytes if reads.pages else 1
        checks: dict[int, digests.RankCheck] = {}
        at = 0
        for rank, ranges in reads.by_rank.items():
            check = digests.plan(ranges, unit, peers[rank].digest_chunk_bytes, at)
            at += check.rows * digests.ROW_BYTES
            if check.partial:
                self._log_unchecked(f"{check.partial} reads of prefiller rank {rank} cut its digest chunks")
            checks[rank] = check
        if at > self._digest_slot_rows * digests.ROW_BYTES:
            self._log_unchecked(f"{at // digests.ROW_BYTES} digests are more than a scratch slot holds")
            return
        try:
            slot = self._digest_slots.take(deadline)
        except SlotsTaken:
            raise LoadError(f"no digest scratch free by the deadline for {load.job.remote_request_id}", "timeout") from None
        load.digest_slot = slot
        base = slot * self._digest_slot_rows * digests.ROW_BYTES
        for check in checks.values():
            check.rows_at += base
        load.checks = checks

    def _log_unchecked(self, why: str) -> None:
        """Said once per reason: a load whose KV is not checked against digests."""
        if why not in self._unchecked_said:
            self._unchecked_said.add(why)
            log.warning("kvbridge: kvbridge_integrity is on, but %s: such loads are not checked", why)

    def _check_digests(self, load: _Load, peers: dict[int, Peer], deadline: float) -> None:
        """After the lease checks found the request held: every chunk read must have the
        digest the prefiller wrote. Rows that differ are read again once (they may have been
        read before the prefiller wrote them); a chunk that still differs fails the load."""
        ch = self.channel
        assert ch is not None and self._digest_scratch_region is not None
        bases = self._layer_bases()
        for rank, check in load.checks.items():
            peer = peers[rank]
            bad = digests.differing(check, bases, peer.digest_chunk_bytes, self._digest_scratch)
            if not bad:
                continue
            assert peer.digests is not None
            ops = digests.row_ops(check, self._digest_scratch_region, peer.digests)
            t = ch.submit_read(peer.peer_id, ops, token=self._token(peer, load.job))
            load.transfers.append(t)  # cancelled with the others when the deadline passes
            t.wait(max(0.0, deadline - time.monotonic()))
            bad = digests.differing(check, bases, peer.digest_chunk_bytes, self._digest_scratch)
            if bad:
                chunks = peer.digest_chunk_bytes
                raise LoadError(
                    f"request {load.job.remote_request_id} from prefiller {peer.peer_id} "
                    f"({self._addr(load.job, rank)}): {len(bad)} of {check.rows} chunks read differ from the "
                    f"prefiller's digests (first: bytes {bad[0] * chunks}..{(bad[0] + 1) * chunks} of each layer)",
                    "integrity",
                )
        self.stats["loads_checked"] += 1

    def _reads(self, planner: kvbridge.ReadPlanner | None, peer: Peer, job: RecvJob) -> rank_reads.RankReads:
        hit = len(job.hit_block_ids)
        # a job without the prompt's length (tests) brings every block it names
        prompt = job.prompt_tokens or (hit + len(job.local_block_ids)) * self.block_size
        if planner is None:
            return rank_reads.whole_pages(self.tp_rank, job.remote_block_ids, hit, job.local_block_ids)
        assert peer.layout is not None and peer.layout.tp is not None and self.layers
        return rank_reads.translated(
            planner,
            self.layers[0].page_bytes,
            int(peer.layout.tp["block_tokens"]),
            self.block_size,
            job.remote_block_ids,
            job.hit_block_ids,
            job.local_block_ids,
            prompt,
        )

    @staticmethod
    def _log_if_over_budget(load: _Load, addr: str) -> None:
        """Where a load's time went, when it took more than its budget."""
        took = load.finished - load.started
        if took <= BUDGET_BASE_S + BUDGET_S_PER_MIB * load.bytes / 2**20:
            return
        read = load.read or load.finished
        log.log(
            logging.WARNING if took > SLOW_LOAD_S else logging.INFO,
            "kvbridge: %s of %s (%d bytes from %s, started by the %s) took %.3f s: %.3f s from allocation "
            "to a load thread, %.3f s for the prefiller's session, %.3f s submitting, %.3f s reading, "
            "%.3f s checking its lease (%d reads of the table)",
            "slow load" if took > SLOW_LOAD_S else "load", load.req_id, load.bytes, addr, load.via, took,
            load.took_up - load.started, load.connected - load.took_up, load.submitted - load.connected,
            read - load.submitted, load.finished - read, load.lease_checks,
        )  # fmt: skip

    def _notify_ranks(self, job: RecvJob, peers: dict[int, Peer], unreachable: set[int]) -> None:
        """The "done" notices of a load: to every prefiller rank that waits for this rank,
        on its session where the load opened one, except ranks found unreachable (their
        lease frees the blocks)."""
        try:
            notices = self._notice_ranks(job.remote_tp_size)
        except LoadError as e:
            log.warning("kvbridge: cannot tell the prefiller that %s is read: %s", job.remote_request_id, e)
            return
        for rank, expected in notices.items():
            if rank in unreachable:
                continue
            peer = peers.get(rank)
            try:
                addr = self._addr(job, rank)
            except ConfigError:
                continue
            self._notify_done(addr, peer.peer_id if peer else None, job.remote_request_id, job.grant, expected)

    def _notify_done(
        self, addr: str, peer_id: str | None, remote_request_id: str, grant: str, expected: int = 1
    ) -> None:
        """Tells a prefiller rank that this rank is done with the request's blocks, without
        waiting: on the session ``peer_id`` when given, else connecting to ``addr``. A
        failure is logged; the prefiller's lease frees the blocks anyway."""
        ch = self.channel
        if ch is None:
            return
        msg = done_notices.encode(self.tp_rank, expected, grant, remote_request_id)

        async def notice() -> None:
            to = peer_id or addr
            try:
                to = peer_id or await ch.connect_async(addr)
                await ch.notify_async(to, msg)
            except kvbridge.KvbridgeError as e:
                self.stats["notices_failed"] += 1
                log.warning("kvbridge: cannot tell prefiller %s that %s is read: %s", to, remote_request_id, e)

        self._notices.submit(notice())

    # ---- completion -------------------------------------------------------------------------

    def wait_idle(self) -> None:
        """In a step where no request computes: waits until a load ends or a notification
        comes, for at most ``IDLE_WAIT_S`` (on vLLM CPU up to ``IDLE_WAIT_MAX_S`` as the
        engine stays idle), instead of returning at once.

        vLLM keeps stepping while a prefiller holds blocks for decoders and while a decoder
        waits for loads, each empty step a round trip to the worker, whose thread polls for
        the next step with ``sched_yield``. On vLLM CPU every server's worker thread is bound
        to the same compute cores by default, and a worker that spins there has been seen
        to keep another server's worker off the core for the whole lease (30 s): the
        decoder could not take its next step, and the prefiller held its blocks until the
        lease ended. Sleeping here makes an idle engine's worker yield the core; the wait
        ends at once when the transfer it is stepping for ends.
        """
        # cleared first: a load that ends from here on ends the wait
        self._load_ended.clear()
        holding = bool(self._leases)
        with self._loads_lock:
            loading = any(load.future is not None and not load.future.done() for load in self._loads.values())
        if not (holding or loading) or self.channel is None:
            return
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        wait = IDLE_WAIT_S
        if self._cores:
            wait = min(IDLE_WAIT_MAX_S, max(IDLE_WAIT_S, (now - self._idle_since) / 4))
        deadline = now + wait
        if holding:
            deadline = min(deadline, min(self._leases.values()))
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if not holding:
                self._load_ended.wait(left)
                return
            try:
                got = self.channel.recv_notification(min(left, IDLE_SLICE_S) if loading else left)
            except kvbridge.KvbridgeError:
                return
            if got is not None:
                self._taken.append(got)
                return
            if loading and self._load_ended.is_set():
                return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving: set[str] = set()
        with self._loads_lock:
            loads = list(self._loads.items())
        now = time.monotonic()
        for req_id, load in loads:
            fut = load.future
            if fut is not None and fut.done() and not load.announced and now - load.started > 2 * STALE_S:
                # started from a datagram no step ever delivered (not one of this scheduler's
                # requests): nothing to report to vLLM
                with self._loads_lock:
                    del self._loads[req_id]
                log.warning("kvbridge: load of %s came only through the inbox; dropped", req_id)
                continue
            if fut is None or not fut.done() or not load.announced:
                continue
            # blocks are reported only once no read can still land in them
            if any(not t.done for t in load.transfers):
                continue
            with self._loads_lock:
                del self._loads[req_id]
            err = fut.exception()
            if err is None and self.staging is not None and load.job.awaited and load.job.local_block_ids:
                # read and checked: the blocks go to the device before vLLM hears of them
                try:
                    self.staging.to_device(load.job.local_block_ids)
                except StagingError as e:
                    err = LoadError(f"request {req_id} (from {load.job.remote_request_id}): {e}", "copy")
            if load.job.recomputed:
                self.stats["loads_recomputed"] += 1
            if not load.job.awaited:
                if err is not None:
                    log.warning("kvbridge: telling prefiller of finished request %s failed: %s", req_id, err)
                continue
            recving.add(req_id)
            if err is None:
                self.stats["loads_ok"] += 1
                self.stats["bytes_read"] += load.bytes
                self.stats["read_ops"] += load.ops
                self.stats["load_seconds"] += max(0.0, load.finished - load.started)
                if load.finished - load.started > SLOW_LOAD_S:
                    self.stats["slow_loads"] += 1
                if load.posting:
                    self.stats["read_seconds"] += max(0.0, load.finished - load.posting)
            else:
                self.stats["loads_failed"] += 1
                self.stats[f"loads_failed_{failure_cause(err)}"] += 1
                self._failed_recving.add(req_id)
                self._load_errors.update(load.job.local_block_ids)
                log.warning("kvbridge: load of %s failed: %s", req_id, err)
        sending = self._finished_sending()
        # finished without a delayed free (aborted, or nothing to send): no hold will come
        self._saved -= set(finished_req_ids or ())
        return (sending or None), (recving or None)

    def _forged(self, peer: str, notice: done_notices.Notice) -> None:
        """A "done" notice under another grant than the request's: its sender was not given
        the request's parameters. Counted, logged once per sender (of a bounded set)."""
        self.stats["notices_refused"] += 1
        if peer not in self._forged_from and len(self._forged_from) < 1024:
            self._forged_from.add(peer)
            log.warning(
                "kvbridge: %s sent a read-done notice for request %s under another grant: refused "
                "(further ones from it are counted in notices_refused)", peer, notice.request_id,
            )  # fmt: skip

    def _finished_sending(self) -> set[str]:
        if self.channel is None:
            return set()
        now = time.monotonic()
        done, self._free_now = self._free_now, set()
        taken, self._taken = self._taken, []
        fresh = self.channel.get_new_notifs().items()
        for peer, msgs in [(p, [m]) for p, m in taken] + list(fresh):
            for msg in msgs:
                notice = done_notices.decode(msg)
                if notice is None:
                    continue
                known = self._grants.get(notice.request_id)
                if known is not None and notice.grant != known:
                    self._forged(peer, notice)
                    continue
                self._dones.add(notice, now)
        # a request is freed once every decoder rank that reads it here said done under its
        # grant; one held only now may have had its notices before
        for req_id in [r for r in self._leases if self._dones.complete(r, self._grants.get(r))]:
            del self._leases[req_id]
            self._dones.forget(req_id)
            self._grants.pop(req_id, None)
            done.add(req_id)
            self.stats["blocks_freed_on_notify"] += 1
        for req_id, until in list(self._leases.items()):
            if until <= now:
                del self._leases[req_id]
                self._dones.forget(req_id)
                self._grants.pop(req_id, None)
                done.add(req_id)
                self.stats["leases_expired"] += 1
                log.warning(
                    "kvbridge: no decoder read request %s within kvbridge_lease_s=%s; blocks freed",
                    req_id,
                    self.settings.lease_s,
                )
        self._dones.expire(now)
        # before vLLM gets the blocks back: no read of them starts or still runs over TCP
        # under the request's grant (read_grants.py), and a decoder that checks the table
        # after reading them does not find the request held once they can be reused
        for req_id in done:
            self._close_reads(req_id)
            self._lease_table.end(req_id)
        return done

    def stats_since_last_report(self) -> dict[str, int | float] | None:
        """The counters' change since the previous call; None when nothing changed."""
        # the channel's own counts (which way it carried the batches, the batches it
        # refused), asked when something else changed, else at most once a second (vLLM
        # calls this every step; a prefiller's refusals change nothing else)
        now = time.monotonic()
        changed = self.stats != self._reported
        if changed or now - self._channel_counted >= CHANNEL_COUNTS_EVERY_S:
            self._channel_counted = now
            self._count_transports()
            changed = self.stats != self._reported
        if not changed:
            return None
        delta = {k: v - self._reported.get(k, 0) for k, v in self.stats.items()}
        self._reported = dict(self.stats)
        return delta

    def _count_transports(self) -> None:
        channel = self.channel
        if channel is None:
            return
        try:
            counts = channel.stats()
        except kvbridge.KvbridgeError:
            return
        for key in (*TRANSPORT_COUNTERS, *REFUSAL_COUNTERS):
            self.stats[key] = counts.get(key, 0)

    def take_failed_recving(self) -> set[str]:
        out, self._failed_recving = self._failed_recving, set()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        if self._inbox is not None:
            self._inbox.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._notices.stop()
        if self.channel is not None:
            self.channel.close()
            self.channel = None
