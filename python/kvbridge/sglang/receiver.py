"""``KvbridgeKVReceiver``: a decode request's side of one transfer.

SGLang's ``CommonKVReceiver`` does the bootstrap (prefill ranks from the bootstrap server,
registration once per prefill rank); this adds the check of each rank the bootstrap server
names, when the decode requires bound prefills (``KvbridgeKVManager.vouch``: before the
decode registers with the rank), the grant (the request's pages opened to the writer, closed
when the request ends) and the peers and deadline the manager watches.

Under ``--disaggregation-decode-allocation-policy prefill_complete`` the decode allocates
only once the prefill has computed: ``init`` asks the prefill rank to say when
(``BOOTSTRAP``), and its answer (``WaitingForInput``) comes over kvbridge before any
``send_metadata``. So the room takes statuses from its prefill peers, and the probe watches
them, from the bootstrap on (before that message leaves), with no transfer deadline while
the prefill computes; ``send_metadata`` starts the deadline.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import CommonKVReceiver

import kvbridge


class KvbridgeKVReceiver(CommonKVReceiver):
    _grant_closed: bool = True
    _refused: Optional[str] = None  # why a rank the bootstrap server named was not believed
    _watched: bool = False  # the manager has the room's peers (expect), to be forgotten

    def _setup_bootstrap_infos(self) -> None:
        super()._setup_bootstrap_infos()
        if self.kv_mgr.defer_decode_allocation and self.conclude_state != KVPoll.Failed and self.bootstrap_infos:
            # before init sends BOOTSTRAP: the prefill's readiness may come back at once
            peers = self._peers()
            if peers is not None:
                self.kv_mgr.expect(self.bootstrap_room, peers, self.bootstrap_addr, deadline=False)
                self._watched = True

    def _peers(self) -> Optional[Dict[str, str]]:
        """The prefill ranks' kvbridge peer ids and addresses; None (and the request
        failed) when a rank does not run this backend."""
        peers = {}
        for info in self.bootstrap_infos:
            if info.get("is_dummy"):
                continue
            peer, addr = info.get("kvbridge_peer"), info.get("kvbridge_addr")
            if not isinstance(peer, str) or not isinstance(addr, str):
                self._fail(
                    f"kvbridge: the prefill at {self.bootstrap_addr} (rank {info.get('rank_ip')}:"
                    f"{info.get('rank_port')}) does not run the kvbridge transfer backend"
                )
                return None
            peers[peer] = addr
        return peers

    def init(self, prefill_dp_rank: int) -> None:
        if self.conclude_state != KVPoll.Failed:
            info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
            why = None if info is None else self.kv_mgr.tp_refusal(self.bootstrap_addr, info.attn_tp_size)
            if why is not None:
                self._fail(why)
                return
        super().init(prefill_dp_rank)
        if self._refused is not None:
            self._fail(self._refused)  # in place of SGLang's "Could not fetch bootstrap info"

    def _get_bootstrap_info_from_server(self, prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank):
        info = super()._get_bootstrap_info_from_server(prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank)
        if info is None:
            return None
        rank = (int(prefill_dp_rank), int(prefill_cp_rank), int(target_tp_rank), int(target_pp_rank))
        try:
            self.kv_mgr.vouch(self.bootstrap_addr, info, rank)
        except kvbridge.Unauthenticated as e:
            self._refused = f"kvbridge: Unauthenticated (step {e.step}): {e}"
            return None  # SGLang then fails the request, before it registers with the rank
        return info

    def _fail(self, reason: str) -> None:
        self.kv_mgr.record_failure(self.bootstrap_room, reason)
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: Optional[int] = None,
        state_indices: Optional[List] = None,
        decode_prefix_len: Optional[int] = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
        device_kv_indices: Any = None,
    ) -> None:
        if self.conclude_state == KVPoll.Failed or getattr(self, "bootstrap_infos", None) is None:
            return super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, destination)
        peers = self._peers()
        if peers is None:
            return
        try:
            self.kv_mgr.open_grant(self.bootstrap_room, kv_indices, aux_index, list(peers))
        except (kvbridge.KvbridgeError, ValueError) as e:
            self._fail(f"kvbridge: opening room {self.bootstrap_room}'s pages failed: {type(e).__name__}: {e}")
            return
        self._grant_closed = False
        self.kv_mgr.expect(self.bootstrap_room, peers, self.bootstrap_addr)
        self._watched = True
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, destination)

    def _close_grant(self) -> bool:
        if not self._grant_closed:
            self._grant_closed = self.kv_mgr.close_grant(self.bootstrap_room)
        if self._grant_closed and self._watched:
            self._watched = False
            self.kv_mgr.forget(self.bootstrap_room)
        return self._grant_closed

    def poll(self) -> KVPoll:
        status = super().poll()
        if status in (KVPoll.Success, KVPoll.Failed):
            # no write lands in the request's pages once SGLang sees it ended
            self._close_grant()
        return status

    def clear(self) -> None:
        self._close_grant()
        super().clear()

    def abort(self) -> None:
        super().abort()
        self._close_grant()

    def is_abort_release_safe(self) -> bool:
        return self._close_grant()
