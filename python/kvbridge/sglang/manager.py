"""``KvbridgeKVManager``: one per SGLang scheduler rank (prefill or decode), owning its
kvbridge channel.

Who moves the bytes: the prefill rank writes (push), as SGLang's Mooncake and NIXL backends
do. SGLang's decode allocates a request's pages before the prefill runs and sends their
indices (``send_metadata``); the prefill hands its KV to the backend chunk by chunk as
chunked prefill computes it (``send``) and frees it when ``poll`` says Success or Failed.
Pushing lets each chunk leave as soon as it exists and lets the prefill free its KV the
moment its own writes complete, with nothing held for a remote reader.

What a peer can reach: a decode rank registers its KV and metadata buffers with writes
confined to windows; for each request it opens windows on exactly that request's pages
(and metadata slot) to a fresh grant token, which travels with the indices. The prefill's
writes name the token; any other byte is refused (``AccessDenied``) by the decode's
process. A decode that requires bound prefills (``KVBRIDGE_SGLANG_REQUIRE_BOUND_PREFILL``)
opens them to the prefill ids it expects instead, each checked first (trust.py). The windows close (and drain) when the request ends on the decode, whatever the
reason, before SGLang reuses its pages. Channels authenticate with ``KVBRIDGE_SECRET``; a
rank's kvbridge peer id is random per start unless ``KVBRIDGE_PEER_ID`` names a template
(``{role}``, ``{rank}``: ``kvbridge.identity``), which a decode's keyring
(``KVBRIDGE_PEER_KEYS``) binds to the prefill's own key (``KVBRIDGE_PEER_KEY``): the prefill
proves that key when it dials such a decode and signs its bootstrap registration with it,
while its listener still takes the decode's probe under the shared secret (docs/sglang.md,
*Identities*).

How a request ends: the prefill's writes for the last chunk are followed by a kvbridge
notification (delivered after them) carrying Success, or a failure with its reason; a
failed write fails the request on the prefill (typed error naming the decode and the
step) and frees its KV. The decode fails a request when the prefill says so, when a probe
of the prefill rank's kvbridge listener fails (a dead prefill is known within
``KVBRIDGE_SGLANG_PROBE_S`` plus the connect deadline, not 300 s), or at
``KVBRIDGE_SGLANG_TRANSFER_TIMEOUT_S``. A prefill fails a request whose decode never sent
its pages at ``KVBRIDGE_SGLANG_LEASE_S``.

Supported: MHA and MLA KV pools with the same attention TP on both sides (each decode rank
pairs with the prefill rank of its index, as SGLang's rank mapping does), MHA with different
TP on the two sides (SGLang's rank mapping picks the prefill ranks; each writes the heads
the decode rank holds, planned once per decode rank at its registration: head_slices.py),
MLA with any TP (MLA KV is the same on every rank: one prefill rank sends it, the others
are dummies, as in SGLang), attention DP. Refused at startup with a clear error: state pools
(Mamba, SWA, DSA...), PP > 1, CP/DCP > 1, KV sharding; at a decode rank's registration
(``kvbridge.Incompatible``, every request of that pair failing at once with it): MHA pools
of different TP that cannot be translated; per request: decode radix-cache prefix hits.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np
import zmq

import kvbridge
from kvbridge import identity
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.common.utils import TransferKVChunk
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.utils.network import get_local_ip_auto

from . import messages, metrics, trust
from .config import ConfigError, settings
from .head_slices import HeadSlices, RankPool, prefill_ranks_of
from .ops import page_runs, write_ops

logger = logging.getLogger(__name__)

#: Seconds a closing grant waits for writes already admitted through its windows.
CLOSE_WAIT_S = 5.0
#: Threads that dial registered decode ranks, off the control thread: a registration naming
#: an address that accepts and never answers holds its dialer for the handshake's deadline.
DIALERS = 4
#: Registrations waiting for a dialer; past it a registration is refused at once.
MAX_DIALS_WAITING = 64


class DecodePeer:
    """A decode rank as a prefill rank knows it (after its registration)."""

    def __init__(self, reg: messages.Registration, error: Optional[str], slices: Optional[HeadSlices] = None):
        self.reg = reg
        self.error = error  # why its requests fail at once (layout mismatch, connect)
        self.slices = slices  # MHA KV of another attention TP: the heads it holds (head_slices.py)


class KvbridgeKVManager(CommonKVManager):
    # status travels over kvbridge, not ZMQ (send_kv_status_message below)
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: Optional[bool] = False,
    ):
        self.settings = settings()
        self._refuse_unsupported(args)
        self.role = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        # the decode's keyring when it takes KV only from bound prefill ids (trust.py)
        self.prefill_keys: Optional[Dict[str, bytes]] = None
        if self.role == "decode" and self.settings.require_bound_prefill:
            self.prefill_keys = trust.load_keyring(os.environ.get(identity.PEER_KEYS_ENV))
        host = get_local_ip_auto()
        self.kvbridge_peer_id = identity.peer_id(
            f"sglang-{self.role}-r{args.engine_rank}-{uuid.uuid4().hex[:12]}", role=self.role, rank=args.engine_rank
        )
        self.channel = kvbridge.Channel(
            self.kvbridge_peer_id, f"{host}:0", secret=self.settings.secret, peer_key=self.settings.peer_key
        )
        self.kvbridge_addr = self.channel.local_addr
        self.stats = metrics.stats(self.role)  # on SGLang's /metrics with --enable-metrics
        self._stopped = threading.Event()
        writable = disaggregation_mode == DisaggregationMode.DECODE
        self.kv_regions = self._register(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens, writable, "KV")
        self.aux_regions = self._register(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens, writable, "metadata")
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if self.role == "prefill":
            self.bootstrap_timeout = min(self.bootstrap_timeout, self.settings.lease_s)
            self.decode_peers: Dict[Tuple[str, int], DecodePeer] = {}
            self._queue: "queue.Queue[Optional[TransferKVChunk]]" = queue.Queue()
            self._dialers = ThreadPoolExecutor(DIALERS, thread_name_prefix="kvbridge-sglang-dial")
            self._dials = threading.BoundedSemaphore(MAX_DIALS_WAITING)
            self._threads = [
                threading.Thread(target=self._control_loop, name="kvbridge-sglang-control", daemon=True),
                threading.Thread(target=self._transfer_loop, name="kvbridge-sglang-transfer", daemon=True),
            ]
        else:
            # SGLang's own wait (SGLANG_DISAGGREGATION_WAITING_TIMEOUT) stays as the backstop;
            # the probe loop's deadline, when shorter, ends the request first with the peer named
            self._grants: Dict[int, bytes] = {}
            self._grant_windows: Dict[int, List[int]] = {}  # room -> windows open to bound ids
            self._grant_lock = threading.RLock()
            self.room_peers: Dict[int, Dict[str, str]] = {}  # room -> prefill peer id -> its addr
            self._room_deadline: Dict[int, float] = {}
            self._room_bootstrap: Dict[int, str] = {}
            self._tp_refusals: Dict[Tuple[str, int], Optional[str]] = {}
            probe_id = identity.check_peer_id(f"{self.kvbridge_peer_id}/probe", f"{identity.PEER_ID_ENV} (the probe's id)")
            self._probe = kvbridge.Channel(probe_id, secret=self.settings.secret)
            self._threads = [
                threading.Thread(target=self._notice_loop, name="kvbridge-sglang-notices", daemon=True),
                threading.Thread(target=self._probe_loop, name="kvbridge-sglang-probe", daemon=True),
            ]
            self._start_heartbeat_checker_thread()
        for t in self._threads:
            t.start()

    # ---- setup ----------------------------------------------------------------------------

    def _refuse_unsupported(self, args: KVArgs) -> None:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        why = []
        if getattr(args, "state_types", None):
            why.append(f"state pools {[str(s) for s in args.state_types]} (Mamba/SWA/DSA models)")
        if p.pp_size > 1:
            why.append(f"pipeline parallelism (pp_size {p.pp_size})")
        if p.attn_cp_size > 1 or getattr(p, "attn_dcp_size", 1) > 1:
            why.append("context parallelism")
        if getattr(p, "enable_kv_cache_sharding", False):
            why.append("KV cache sharding")
        if why:
            raise ConfigError(
                "the kvbridge transfer backend does not support " + ", ".join(why) + " yet; "
                "use --disaggregation-transfer-backend mooncake or nixl for this model"
            )

    def _register(self, ptrs: List[int], lens: List[int], items: List[int], writable: bool, what: str) -> List[int]:
        regions = []
        for i, (ptr, length, item) in enumerate(zip(ptrs, lens, items)):
            if item <= 0 or length % item:
                raise ConfigError(f"kvbridge: {what} buffer {i} of {length} bytes is not a whole number of {item}-byte items")
            if writable:
                regions.append(self.channel.register(ptr, length, item, windows="write"))
            else:
                regions.append(self.channel.register(ptr, length, item, peers=[]))
        return regions

    def _register_topology_row(self, url: str, payload: Dict) -> None:
        # the bootstrap server hands the decode ranks our channel and, signed, this registration
        payload = dict(payload, kvbridge_addr=self.kvbridge_addr, kvbridge_peer=self.kvbridge_peer_id)
        payload["kvbridge_sig"] = trust.sign(self.settings.registration_key[1], payload)
        super()._register_topology_row(url, payload)

    def deregister_buffer_to_engine(self) -> None:
        """SGLang calls this before it releases the KV pool's memory
        (``release_memory_occupation``). The pool stays registered with kvbridge, where a
        peer's write may land at any time: refuse, rather than let the memory go under it."""
        raise NotImplementedError(
            "the kvbridge transfer backend does not support release_memory_occupation yet: the KV "
            "pool stays registered with peers, so its memory must not be released"
        )

    def register_buffer_to_engine(self) -> None:
        """Nothing to do: the pool was registered at startup and never released."""

    def teardown(self) -> None:
        raise NotImplementedError("the kvbridge transfer backend does not support PD role switch yet")

    def close(self) -> None:
        """Stops the rank's threads (bounded), closes its channels and ZMQ sockets."""
        self._stopped.set()
        if self.role == "prefill":
            self._queue.put(None)
            self._dialers.shutdown(wait=False, cancel_futures=True)
        else:
            self._heartbeat_shutdown.set()
            self._probe.close()
        self.channel.close()
        for t in self._threads:
            t.join(timeout=2.0)
        with self._socket_lock:
            for sock in list(self._socket_cache.values()) + list(self._monitor_cache.values()):
                sock.close(linger=0)
            self._socket_cache.clear()
            self._monitor_cache.clear()
        self.server_socket.close(linger=0)
        self._zmq_ctx.term()

    # ---- decode: registration and per-request grants --------------------------------------

    def build_receiver_registration_message(self) -> List[bytes]:
        args = self.kv_args
        return messages.Registration(
            endpoint=self.local_ip,
            port=self.rank_port,
            addr=self.kvbridge_addr,
            peer_id=self.kvbridge_peer_id,
            tp_rank=self.attn_tp_rank,
            tp_size=self.attn_tp_size,
            page_size=args.page_size,
            kv_cache_dtype=str(self.kv_cache_dtype_str),
            kv_item_lens=list(args.kv_item_lens),
            kv_regions=self.kv_regions,
            aux_item_lens=list(args.aux_item_lens),
            aux_regions=self.aux_regions,
        ).to_zmq()

    def build_receiver_metadata_message(
        self,
        *,
        bootstrap_room: int,
        required_dst_info_num: int,
        kv_indices: Any,
        aux_index: Optional[int],
        state_indices: Optional[List],
        decode_prefix_len: Optional[int],
        is_dummy: bool,
        device_kv_indices: Any = None,
    ) -> List[bytes]:
        return messages.TransferInfo(
            room=bootstrap_room,
            endpoint=self.local_ip,
            dst_port=self.rank_port,
            peer_id=self.kvbridge_peer_id,
            dst_kv_indices=np.asarray(kv_indices if not is_dummy else [], dtype=np.int64),
            dst_aux_index=None if is_dummy else aux_index,
            required_dst_info_num=required_dst_info_num,
            decode_prefix_len=int(decode_prefix_len or 0),
            is_dummy=is_dummy,
            token=self._grants.get(bootstrap_room, b"\0" * 16),
        ).to_zmq()

    def open_grant(self, room: int, kv_indices: Any, aux_index: Optional[int], writers: Optional[List[str]] = None) -> None:
        """Opens the room's pages and metadata slot (before its indices leave): to a fresh
        token, which travels with the indices; with bound prefills required, to the bound ids
        ``writers`` instead, so that no other peer's write lands even with the token.
        Raises ``kvbridge.KvbridgeError`` or ``ValueError``; nothing stays open then."""
        token = kvbridge.new_grant_token()
        holders = [{"token": token}] if self.prefill_keys is None else [{"peer": w} for w in writers or []]
        with self._grant_lock:
            self.close_grant(room)
            self._grants[room] = token
            windows = self._grant_windows.setdefault(room, [])
        try:
            spans = page_runs(np.asarray(kv_indices, dtype=np.int64))
            for holder in holders:
                for region, item in zip(self.kv_regions, self.kv_args.kv_item_lens):
                    # one call per buffer: all of the room's runs in it, under one engine lock
                    offsets, lengths = [first * item for first, _ in spans], [count * item for _, count in spans]
                    windows += self.channel.open_windows(region, offsets, lengths, access="write", **holder)
                if aux_index is not None:
                    for region, item in zip(self.aux_regions, self.kv_args.aux_item_lens):
                        windows.append(self.channel.open_window(region, aux_index * item, item, access="write", **holder))
        except BaseException:
            self.close_grant(room)
            raise
        self.stats["grants_opened"] += 1

    def close_grant(self, room: int) -> bool:
        """Closes the room's windows and waits for writes admitted through them; True once
        no write can land in its pages any more."""
        with self._grant_lock:
            token = self._grants.get(room)
            if token is None:
                return True
            try:
                users = self.channel.close_token(token, timeout=CLOSE_WAIT_S)
                left = self.channel.close_windows(self._grant_windows.get(room, []), timeout=CLOSE_WAIT_S)
                if left:
                    self._grant_windows[room] = left
                    raise kvbridge.Timeout(f"{len(left)} windows of room {room} still in use", step="close-window")
            except kvbridge.Timeout:
                logger.warning("kvbridge: writes into room %s still in flight %.0f s after its grant closed", room, CLOSE_WAIT_S)
                return False
            except kvbridge.Closed:
                pass
            else:
                logger.debug("kvbridge: room %s grant closed (writers %s)", room, users)
            del self._grants[room]
            self._grant_windows.pop(room, None)
            self.stats["grants_closed"] += 1
            return True

    def vouch(self, bootstrap_addr: str, info: Dict[str, Any], rank: trust.Rank) -> None:
        """With bound prefills required, checks what the bootstrap server said about a prefill
        rank (trust.py); raises ``kvbridge.Unauthenticated`` naming the step, counted."""
        if self.prefill_keys is None:
            return
        try:
            trust.check_lookup(info, self.prefill_keys, rank, bootstrap_addr, self.prefill_info_table.get(bootstrap_addr))
        except kvbridge.Unauthenticated as e:
            self.stats["unbound_prefills" if e.step == "keyring" else "unvouched_lookups"] += 1
            logger.error("kvbridge: %s", e)
            raise

    def tp_refusal(self, bootstrap_addr: str, prefill_tp: int) -> Optional[str]:
        """Why this decode rank cannot take MHA KV from the prefill server at
        ``bootstrap_addr`` of attention TP ``prefill_tp`` (SGLang's rank mapping needs one TP
        size to divide the other), or None; decided, and logged, once per server and TP.
        The rest of the check is the prefill rank's, at this rank's registration."""
        if self.is_mla_backend or prefill_tp == self.attn_tp_size:
            return None
        key = (bootstrap_addr, prefill_tp)
        if key not in self._tp_refusals:
            try:
                prefill_ranks_of(self.attn_tp_rank, self.attn_tp_size, prefill_tp)
                why = None
            except ValueError as e:
                why = f"kvbridge: Incompatible (step layout): the prefill at {bootstrap_addr}: {e}"
                self.stats["layouts_refused"] += 1
                logger.error("%s", why)
            self._tp_refusals[key] = why
        return self._tp_refusals[key]

    def expect(self, room: int, peers: Dict[str, str], bootstrap_addr: str, deadline: bool = True) -> None:
        """From now on the room takes statuses from ``peers`` and the probe loop watches
        them; with ``deadline``, its KV must come within the transfer timeout. Without it
        (the prefill still computing, under ``prefill_complete``) only the probe ends it."""
        self.room_peers[room] = dict(peers)
        self._room_bootstrap[room] = bootstrap_addr
        if deadline:
            self._room_deadline[room] = time.monotonic() + self.settings.transfer_timeout_s

    def forget(self, room: int) -> None:
        self.room_peers.pop(room, None)
        self._room_deadline.pop(room, None)
        self._room_bootstrap.pop(room, None)

    def _forget_prefill(self, bootstrap_addr: str) -> None:
        """Drops what this rank cached about a prefill server whose rank died (its ranks,
        their ports and peers), so the next request asks its bootstrap server again and a
        restarted prefill is served at once, not after SGLang's heartbeats notice."""
        with self.connection_lock:
            for key in [k for k in self.connection_pool if k.startswith(f"{bootstrap_addr}_")]:
                del self.connection_pool[key]
            self.prefill_info_table.pop(bootstrap_addr, None)

    def _fail_room(self, room: int, reason: str) -> None:
        if room in self.request_status and self.request_status.get(room) not in (KVPoll.Success, KVPoll.Failed):
            self.record_failure(room, reason)
            self.update_status(room, KVPoll.Failed)
            self.stats["decode_failed"] += 1
            logger.warning("kvbridge: room %s failed: %s", room, reason)

    def _notice_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                got = self.channel.recv_notification(timeout=0.5)
            except kvbridge.Closed:
                return
            except Exception:  # noqa: BLE001 - keep serving the other peers
                logger.exception("kvbridge: receiving a notification")
                continue
            if got is None:
                continue
            peer, data = got
            try:
                note = messages.parse_note(data)
            except messages.BadMessage as e:
                self.stats["bad_notices"] += 1
                logger.warning("kvbridge: notification from %s refused: %s", peer, e)
                continue
            if note["t"] != "status":
                continue
            room = note["room"]
            if peer not in self.room_peers.get(room, {}):
                self.stats["bad_notices"] += 1
                logger.warning("kvbridge: %s sent a status for room %s, which it does not serve", peer, room)
                continue
            status = note["status"]
            reason = note["reason"] or None
            if status == KVPoll.Failed:
                reason = f"kvbridge: prefill {peer} failed room {room}: {reason or 'no reason given'}"
            self.stats["statuses_received"] += 1
            last = status == KVPoll.Success and self._completes(room, note["rank"])
            self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=note["rank"], failure_reason=reason)
            if last:
                self.stats["kv_received"] += 1
                logger.info(
                    "kvbridge: room %s: KV received over kvbridge from %s (kv_received=%d)",
                    room, sorted(self.room_peers.get(room, {})), self.stats["kv_received"],
                )  # fmt: skip

    def _completes(self, room: int, rank: int) -> bool:
        """Whether a Success from prefill rank ``rank`` is the last the room waits for
        (SGLang's count of the prefill ranks a decode rank hears from). Only the notice
        thread adds to that count."""
        done = self.prefill_response_tracker.get(room)
        need = self.required_prefill_response_num_table.get(room)
        return done is not None and need is not None and rank not in done and len(done) + 1 == need

    def _probe_loop(self) -> None:
        while not self._stopped.wait(self.settings.probe_s):
            now = time.monotonic()
            waiting: Dict[Tuple[str, str], List[int]] = defaultdict(list)
            for room, peers in list(self.room_peers.items()):
                status = self.request_status.get(room)
                if status is None or status in (KVPoll.Success, KVPoll.Failed):
                    continue
                deadline = self._room_deadline.get(room)
                if deadline is not None and now > deadline:
                    self._fail_room(
                        room,
                        f"kvbridge: no KV from prefill {sorted(peers)} within "
                        f"{self.settings.transfer_timeout_s:g} s (KVBRIDGE_SGLANG_TRANSFER_TIMEOUT_S)",
                    )
                    continue
                for peer, addr in peers.items():
                    waiting[(peer, addr)].append(room)
            for (peer, addr), rooms in waiting.items():
                try:
                    got = self._probe.connect(addr)
                    if got != peer:
                        raise kvbridge.PeerMisbehaved(f"{addr} is {got}, not {peer}", peer=got, step="probe")
                    self._probe.notify(got, b'{"t": "ping"}')
                    self.stats["probes"] += 1
                except kvbridge.Closed:
                    return
                except kvbridge.KvbridgeError as e:
                    self.stats["probe_failures"] += 1
                    for bootstrap in {self._room_bootstrap.get(r) for r in rooms} - {None}:
                        self._forget_prefill(bootstrap)
                    for room in rooms:
                        self._fail_room(
                            room,
                            f"kvbridge: prefill {peer} at {addr} unreachable (step {e.step}): "
                            f"{type(e).__name__}: {e}",
                        )

    # ---- prefill: control messages and transfers ------------------------------------------

    def _control_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stopped.is_set():
            try:
                if not poller.poll(200):
                    continue
                msg = self.server_socket.recv_multipart()
            except zmq.ZMQError:
                if self._stopped.is_set():
                    return
                logger.exception("kvbridge: control socket")
                self._stopped.wait(0.1)
                continue
            if self.deferred_bootstrap is not None and self._handle_bootstrap_message(msg):
                continue
            try:
                self._handle_control(msg)
            except messages.BadMessage as e:
                self.stats["bad_messages"] += 1
                logger.warning("kvbridge: control message refused: %s", e)
            except Exception:  # noqa: BLE001 - one bad message must not stop the rank
                self.stats["bad_messages"] += 1
                logger.exception("kvbridge: control message failed")

    def _handle_control(self, msg: List[bytes]) -> None:
        if not msg:
            raise messages.BadMessage("an empty message")
        if self._handle_abort_notification(msg):
            return
        if msg[0] == messages.REG_TAG:
            self._register_decode(messages.Registration.from_zmq(msg))
        elif msg[0] == messages.XFER_TAG:
            self._add_transfer_info(messages.TransferInfo.from_zmq(msg))
        else:
            raise messages.BadMessage(f"unknown message type {msg[0][:32]!r}")

    def _handle_abort_notification(self, msg: List[bytes]) -> bool:
        from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification

        if msg[0] != ABORT_TAG:
            return False
        note = AbortNotification.from_zmq(msg)
        if note is None:
            raise messages.BadMessage("a malformed ABORT")
        room = note.room
        if room in self.request_status and self.check_status(room) != KVPoll.Success:
            self.record_failure(room, "Aborted by decode-side abort notification.")
            self.update_status(room, KVPoll.Failed)
            self.stats["aborted_by_decode"] += 1
        return True

    def _register_decode(self, reg: messages.Registration) -> None:
        """Takes a decode rank's registration: its layout decided here, its session dialed by
        a dialer thread (the control thread serves the other ranks meanwhile); a request of
        it that comes first waits for its KV as any other, and fails if the dial does."""
        error, slices = self._layout(reg)
        peer = DecodePeer(reg, error, slices)
        self.decode_peers[reg.key] = peer
        if error is None:
            if self._dials.acquire(blocking=False):
                self._dialers.submit(self._dial_decode, peer)
            else:
                peer.error = f"decode {reg.peer_id} at {reg.addr}: {MAX_DIALS_WAITING} registrations already wait to be dialed"
                self.stats["dials_shed"] += 1
        if peer.error:
            logger.error("kvbridge: decode rank at %s:%s refused: %s", reg.endpoint, reg.port, peer.error)

    def _dial_decode(self, peer: DecodePeer) -> None:
        reg = peer.reg
        try:
            got = self.channel.connect(reg.addr)
            if got != reg.peer_id:
                peer.error = f"{reg.addr} authenticated as {got}, not {reg.peer_id} as registered"
                self.channel.disconnect(got, "not the registered peer")
        except kvbridge.Closed:
            return
        except kvbridge.KvbridgeError as e:
            peer.error = f"connecting to decode {reg.peer_id} at {reg.addr} failed (step {e.step}): {type(e).__name__}: {e}"
        finally:
            self._dials.release()
        if peer.error:
            logger.error("kvbridge: decode rank at %s:%s refused: %s", reg.endpoint, reg.port, peer.error)
            for room, infos in list(self.transfer_infos.items()):
                if reg.peer_id in infos and self.decode_peers.get(reg.key) is peer:
                    self.conclude_failure(bootstrap_room=room, failure_reason=peer.error, targets=[reg.key])

    def _layout(self, reg: messages.Registration) -> Tuple[Optional[str], Optional[HeadSlices]]:
        """Whether this rank's KV can go to the decode rank: ``(why not, None)``, or
        ``(None, the head slices)`` for MHA KV of another attention TP, ``(None, None)``
        for whole pages. Decided once per decode rank, here."""
        own = self.kv_args
        if reg.page_size != own.page_size or reg.kv_cache_dtype != str(self.kv_cache_dtype_str):
            self.stats["layouts_refused"] += 1
            return (
                f"KV pages differ: decode {reg.peer_id} has pages of {reg.page_size} tokens of {reg.kv_cache_dtype!r}, "
                f"this prefill {own.page_size} of {str(self.kv_cache_dtype_str)!r}"
            )[:1000], None
        if not self.is_mla_backend and reg.tp_size != self.attn_tp_size:
            try:
                slices = self._head_slices(reg)
            except kvbridge.Incompatible as e:
                self.stats["layouts_refused"] += 1
                return f"kvbridge: {type(e).__name__} (step {e.step}): {e}", None
        elif list(reg.kv_item_lens) != list(own.kv_item_lens):
            return (
                f"KV layout differs: decode {reg.peer_id} (TP {reg.tp_size}) has {len(reg.kv_item_lens)} KV "
                f"buffers of {sorted(set(reg.kv_item_lens))} bytes a page, this prefill (TP {self.attn_tp_size}) "
                f"{len(own.kv_item_lens)} of {sorted(set(own.kv_item_lens))}"
            ), None
        else:
            slices = None
        if list(reg.aux_item_lens)[: len(own.aux_item_lens)] != list(own.aux_item_lens)[: len(reg.aux_item_lens)]:
            return f"metadata buffers differ: decode {reg.aux_item_lens}, prefill {list(own.aux_item_lens)}", None
        return None, slices

    def _head_slices(self, reg: messages.Registration) -> HeadSlices:
        """The translation of this rank's MHA KV into a decode rank's of another attention
        TP, decided once, at its registration; ``kvbridge.Incompatible`` when there is none."""
        own = self.kv_args
        # SGLang's prefill sets both for MHA; a per-rank count alone loses heads when ranks
        # outnumber them (as SGLang's resolve_total_kv_heads reads it)
        total_heads = int(getattr(own, "total_kv_head_num", 0) or 0)
        total_heads = total_heads or int(getattr(own, "kv_head_num", 0) or 0) * self.attn_tp_size
        return HeadSlices(
            RankPool(
                self.attn_tp_rank, self.attn_tp_size, tuple(own.kv_item_lens), own.page_size, str(self.kv_cache_dtype_str)
            ),
            RankPool(reg.tp_rank, reg.tp_size, tuple(reg.kv_item_lens), reg.page_size, reg.kv_cache_dtype),
            total_heads,
            reg.peer_id,
        )

    def _add_transfer_info(self, info: messages.TransferInfo) -> None:
        room = info.room
        peer = self.decode_peers.get((info.endpoint, info.dst_port))
        if peer is None or peer.reg.peer_id != info.peer_id:
            raise messages.BadMessage(f"transfer for room {room} from an unregistered decode {info.endpoint}:{info.dst_port}")
        infos = self.transfer_infos.setdefault(room, {})
        infos[info.peer_id] = info
        if room not in self.request_status:
            # the decode's indices came before the request reached this rank: kept for it
            pass
        if peer.error is not None:
            self.conclude_failure(bootstrap_room=room, failure_reason=peer.error, targets=[(info.endpoint, info.dst_port)])
            return
        if info.decode_prefix_len:
            self.conclude_failure(
                bootstrap_room=room,
                failure_reason="the kvbridge backend does not support decode radix-cache prefix hits yet "
                "(--disaggregation-decode-enable-radix-cache)",
                targets=[(info.endpoint, info.dst_port)],
            )
            return
        if len(infos) == info.required_dst_info_num:
            self.resolve_kv_replica_factor(infos)
            self.req_to_decode_prefix_len[room] = 0
            self.update_status(room, KVPoll.WaitingForInput)

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: Any,
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: Optional[int] = None,
        state_indices: Optional[List] = None,
        num_kv_tokens: Optional[int] = None,
        *,
        wait_event: Optional[object] = None,
        indices_event: Optional[object] = None,
        trace_ctx: Any = None,
    ) -> None:
        if bootstrap_room not in self.request_status or self.check_status(bootstrap_room) == KVPoll.Failed:
            return
        if bootstrap_room not in self.transfer_infos:
            return
        self._queue.put(
            TransferKVChunk(
                room=bootstrap_room,
                prefill_kv_indices=np.asarray(kv_indices),
                index_slice=index_slice,
                is_last_chunk=is_last_chunk,
                prefill_aux_index=aux_index,
                state_indices=state_indices,
                num_kv_tokens=num_kv_tokens,
                wait_event=wait_event,
                indices_event=indices_event,
            )
        )

    def _transfer_loop(self) -> None:
        while True:
            chunk = self._queue.get()
            if chunk is None or self._stopped.is_set():
                return
            try:
                self._transfer(chunk)
            except Exception as e:  # noqa: BLE001 - the request fails, the rank goes on
                logger.exception("kvbridge: transfer of room %s", chunk.room)
                self.conclude_failure(bootstrap_room=chunk.room, failure_reason=f"kvbridge: {type(e).__name__}: {e}")

    def _transfer(self, chunk: TransferKVChunk) -> None:
        room = chunk.room
        if room not in self.request_status or self.check_status(room) == KVPoll.Failed:
            return
        for ev in (chunk.indices_event, chunk.wait_event):
            if ev is not None and hasattr(ev, "synchronize"):
                ev.synchronize()
        infos = list(self.transfer_infos.get(room, {}).values())
        src = np.asarray(chunk.prefill_kv_indices, dtype=np.int64)
        for info in infos:
            if info.is_dummy:
                continue
            peer = self.decode_peers[(info.endpoint, info.dst_port)]
            dst = info.dst_kv_indices[chunk.index_slice]
            if len(dst) != len(src):
                raise messages.BadMessage(
                    f"room {room}: decode {info.peer_id} gave {len(dst)} pages for slice "
                    f"{chunk.index_slice.start}:{chunk.index_slice.stop}, the prefill sends {len(src)}"
                )
            if peer.slices is not None:
                ops = peer.slices.ops(src, dst, self.kv_regions, peer.reg.kv_regions)
            else:
                ops = write_ops(src, dst, self.kv_regions, peer.reg.kv_regions, self.kv_args.kv_item_lens)
            if chunk.is_last_chunk and chunk.prefill_aux_index is not None and info.dst_aux_index is not None:
                for s_reg, d_reg, item in zip(self.aux_regions, peer.reg.aux_regions, self.kv_args.aux_item_lens):
                    ops.append((s_reg, chunk.prefill_aux_index * item, d_reg, info.dst_aux_index * item, item))
            try:
                self._write(peer, ops, info.token)
            except kvbridge.KvbridgeError as e:
                self.stats["transfers_failed"] += 1
                self.conclude_failure(
                    bootstrap_room=room,
                    failure_reason=f"kvbridge: writing room {room} to decode {info.peer_id} failed "
                    f"(step {e.step}): {type(e).__name__}: {e}",
                )
                return
            self.stats["bytes_sent"] += sum(op[4] for op in ops)
            self.stats["write_ops"] += len(ops)
            if chunk.is_last_chunk:
                self.stats["decode_ranks_sent"] += 1
        if chunk.is_last_chunk:
            self.stats["transfers_done"] += 1
            logger.info(
                "kvbridge: room %s: KV sent over kvbridge to %s (bytes_sent=%d)",
                room, [i.peer_id for i in infos if not i.is_dummy], self.stats["bytes_sent"],
            )  # fmt: skip
            self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)

    def _write(self, peer: DecodePeer, ops: list, token: bytes) -> None:
        """One batch to the decode rank. A session that ended since its last use (a refused
        write ends it; the end reaches this side a moment later) is replaced once: the same
        bytes go to the same granted pages again."""
        if not ops:
            return
        self._session(peer)
        try:
            self.channel.write(peer.reg.peer_id, ops, token=token)
        except (kvbridge.ConnectionLost, kvbridge.UnknownPeer, kvbridge.Disconnected, kvbridge.PeerClosed):
            self.stats["reconnects"] += 1
            self._session(peer)
            self.channel.write(peer.reg.peer_id, ops, token=token)

    def _session(self, peer: DecodePeer) -> None:
        """(Re)connects to the decode rank: a refused write ends the session, and the next
        request must not fail for it. Idempotent while the session stands."""
        got = self.channel.connect(peer.reg.addr)
        if got != peer.reg.peer_id:
            self.channel.disconnect(got, "not the registered peer")
            raise kvbridge.PeerMisbehaved(
                f"{peer.reg.addr} authenticated as {got}, not {peer.reg.peer_id} as registered",
                peer=got,
                step="connect",
            )

    def send_kv_status_message(
        self,
        *,
        targets: List[Tuple[str, int]],
        bootstrap_room: int,
        status: Any,
        failure_reason: Optional[str] = None,
    ) -> None:
        """Status goes to the decode over kvbridge, after the writes (not over ZMQ)."""
        note = messages.status_note(bootstrap_room, int(status), self._prefill_unique_rank(), failure_reason)
        for target in targets:
            peer = self.decode_peers.get(tuple(target))
            if peer is None:
                logger.warning("kvbridge: no decode registered at %s for room %s's status", target, bootstrap_room)
                continue
            try:
                self._session(peer)
                self.channel.notify(peer.reg.peer_id, note)
            except kvbridge.KvbridgeError as e:
                logger.warning(
                    "kvbridge: status %s of room %s to decode %s not sent (step %s): %s",
                    status, bootstrap_room, peer.reg.peer_id, e.step, e,
                )  # fmt: skip
