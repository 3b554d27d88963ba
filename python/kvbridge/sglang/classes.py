"""The backend's classes by SGLang's ``KVClassType`` (what the hooked ``get_kv_class``
returns). Imported only when SGLang asks for the kvbridge backend."""

from __future__ import annotations

from typing import Any


def kv_class(class_type: Any) -> Any:
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import KVClassType

    from .bootstrap import KvbridgeKVBootstrapServer
    from .manager import KvbridgeKVManager
    from .receiver import KvbridgeKVReceiver
    from .sender import KvbridgeKVSender

    return {
        KVClassType.KVARGS: KVArgs,
        KVClassType.MANAGER: KvbridgeKVManager,
        KVClassType.SENDER: KvbridgeKVSender,
        KVClassType.RECEIVER: KvbridgeKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: KvbridgeKVBootstrapServer,
    }.get(class_type)
