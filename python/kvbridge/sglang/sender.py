"""``KvbridgeKVSender``: a prefill request's side of one transfer. SGLang's
``CommonKVSender`` already does what a sender does over any backend (chunk bookkeeping,
the bootstrap timeout that is this backend's lease, failure records); the manager moves the
bytes."""

from __future__ import annotations

from sglang.srt.disaggregation.common.conn import CommonKVSender


class KvbridgeKVSender(CommonKVSender):
    pass
