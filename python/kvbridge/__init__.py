"""kvbridge: moves KV cache between the prefill and decode workers of a disaggregated LLM
deployment.

A ``Channel`` registers caller memory (raw pointers, numpy arrays, bytearrays, CPU tensors
over memory torch cannot reallocate), connects to peers, and moves pages with one-sided
batched writes and reads (blocking, asyncio and submit-then-poll forms, all releasing the
GIL), plus ordered notifications.
Every failure raises a ``KvbridgeError`` subclass naming the peer and the step.

    import numpy as np, kvbridge

    decoder = kvbridge.Channel("decode-0", "127.0.0.1:0")
    kv = np.zeros(64 << 20, dtype=np.uint8)
    kv_region = decoder.register_buffer(kv, page_size=256 << 10)

    prefiller = kvbridge.Channel("prefill-0")
    staging = np.full(256 << 10, 7, dtype=np.uint8)
    src = prefiller.register_buffer(staging, page_size=256 << 10)
    peer = prefiller.connect(decoder.local_addr)
    prefiller.write_pages(peer, src, [0], kv_region, [3])
    prefiller.notify(peer, b"request 42 ready")
    print(decoder.recv_notification(timeout=5))   # ('prefill-0', b'request 42 ready')
"""

from . import _errors
from ._errors import (
    Closed,
    ConnectionLost,
    Disconnected,
    Incompatible,
    IntegrityError,
    InvalidOp,
    KvbridgeError,
    LimitExceeded,
    LocalError,
    NetworkError,
    PeerClosed,
    PeerError,
    PeerMisbehaved,
    PeerRestarted,
    Rejected,
    SessionReplaced,
    Timeout,
    UnknownPeer,
    UnmapTimeout,
    Unauthenticated,
    UsageError,
)
import atexit as _atexit

from ._call import Call

from ._native import (
    DIGEST_ALGORITHM,
    TRANSPORTS,
    Channel,
    ReadPlanner,
    RegionInfo,
    Transfer,
    __version__,
    _at_exit,
    digest,
    digest_ranges,
    new_grant_token,
)

# Blocking calls still waiting in daemon threads end with Closed before the interpreter
# finalizes (one ended by finalization itself aborts the process).
_atexit.register(_at_exit)

__all__ = [
    "Call",
    "Channel",
    "ReadPlanner",
    "RegionInfo",
    "Transfer",
    "DIGEST_ALGORITHM",
    "TRANSPORTS",
    "__version__",
    "digest",
    "digest_ranges",
    "new_grant_token",
    *_errors.__all__,
]
