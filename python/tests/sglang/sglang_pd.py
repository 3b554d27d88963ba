"""A prefill rank and a decode rank of the kvbridge backend, on SGLang's real classes, over
real sockets on 127.0.0.1, with host KV pools made of numpy arrays (SGLang on CPU keeps its
KV in host memory the same way). Used by the tests in this directory and by
``prefill_process.py`` (a prefill rank in its own process, for the tests that kill it)."""

from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional

import numpy as np

LAYERS = 2  # K and V buffers per layer: 2 * LAYERS KV regions
PAGES = 64
PAGE_TOKENS = 4
ITEM = PAGE_TOKENS * 2 * 8 * 2  # page tokens * kv heads * head dim * bytes (fp16), one buffer
AUX_ITEMS = 16
AUX_ITEM = 64

SECRET = "sglang-test-secret-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Pool:
    """One rank's host KV pool and metadata buffers."""

    kv: List[np.ndarray]
    aux: List[np.ndarray]
    item: int = ITEM  # bytes of one page of one KV buffer

    @classmethod
    def make(cls, fill: Optional[int] = None, item: int = ITEM) -> "Pool":
        kv = [np.zeros(PAGES * item, dtype=np.uint8) for _ in range(2 * LAYERS)]
        aux = [np.zeros(AUX_ITEMS * AUX_ITEM, dtype=np.uint8) for _ in range(2)]
        if fill is not None:
            rng = np.random.default_rng(fill)
            for b in kv + aux:
                b[:] = rng.integers(0, 256, b.size, dtype=np.uint8)
        return cls(kv, aux, item)

    def page(self, buf: int, page: int) -> bytes:
        return self.kv[buf][page * self.item : (page + 1) * self.item].tobytes()

    def aux_slot(self, buf: int, slot: int) -> bytes:
        return self.aux[buf][slot * AUX_ITEM : (slot + 1) * AUX_ITEM].tobytes()


def kv_args(pool: Pool, rank: int = 0, heads: int = 2, total_heads: int = 2) -> Any:
    from sglang.srt.disaggregation.base.conn import KVArgs

    a = KVArgs()
    a.engine_rank = rank
    a.kv_data_ptrs = [b.ctypes.data for b in pool.kv]
    a.kv_data_lens = [b.nbytes for b in pool.kv]
    a.kv_item_lens = [pool.item] * len(pool.kv)
    a.kv_layer_ids = [i // 2 for i in range(len(pool.kv))]
    a.aux_data_ptrs = [b.ctypes.data for b in pool.aux]
    a.aux_data_lens = [b.nbytes for b in pool.aux]
    a.aux_item_lens = [AUX_ITEM] * len(pool.aux)
    a.state_types = []
    a.state_data_ptrs = []
    a.state_data_lens = []
    a.state_item_lens = []
    a.state_layer_ids = []
    a.state_dim_per_tensor = []
    a.state_slice_outer_counts = []
    a.state_conv_shard_groups = []
    a.kv_cache_dtype_str = "float16"
    a.page_size = PAGE_TOKENS
    a.ib_device = None
    a.gpu_id = 0
    a.kv_head_num = heads
    a.total_kv_head_num = total_heads
    a.system_dp_rank = 0
    a.rust_http_port = None
    a.pp_rank = 0
    a.prefill_start_layer = 0
    a.prefill_end_layer = LAYERS
    a.mla_compression_ratios = None
    a.is_hybrid_mla_backend = False
    a.swa_kv_cache_layout = None
    a.kv_buf_groups = 1
    a.hidden_kv_layers = LAYERS
    a.draft_kv_layers = 0
    return a


@contextlib.contextmanager
def topology(bootstrap_port: int, **fields: Any) -> Iterator[Any]:
    """SGLang's process-wide runtime context, as a scheduler of a PD server publishes it."""
    from sglang.test.test_utils import published_topology

    with published_topology(
        "scheduler",
        host="127.0.0.1",
        disaggregation_bootstrap_port=bootstrap_port,
        disaggregation_transfer_backend="kvbridge",
        page_size=PAGE_TOKENS,
        **fields,
    ) as server_args:
        from sglang.srt.runtime_context import get_parallel

        # no torch.distributed here: a prefill rank of PP 1 never uses its pipeline group
        get_parallel().override_permanently(pp_group=None)
        yield server_args


def wait_for(pred, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


class PD:
    """A kvbridge bootstrap server, a prefill rank and a decode rank (TP 1) in this
    process, made with SGLang's ``get_kv_class`` after ``install()``."""

    def __init__(self, server_args: Any, port: int):
        from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

        self.backend = TransferBackend("kvbridge")
        self.cls = {t: get_kv_class(self.backend, t) for t in KVClassType}
        self.types = KVClassType
        self.server_args = server_args
        self.bootstrap_addr = f"127.0.0.1:{port}"
        self.server = self.cls[KVClassType.BOOTSTRAP_SERVER](host="127.0.0.1", port=port)
        self.ppool, self.dpool = Pool.make(fill=1), Pool.make()
        self.prefill = self.cls[KVClassType.MANAGER](kv_args(self.ppool), DisaggregationMode.PREFILL, server_args, False)
        self.decode = self.cls[KVClassType.MANAGER](kv_args(self.dpool), DisaggregationMode.DECODE, server_args, False)
        wait_for(lambda: self.decode.try_ensure_parallel_info(self.bootstrap_addr), 20, "the prefill's registration")
        self._room = 1000

    def room(self) -> int:
        self._room += 1
        return self._room

    def sender(self, room: int, bootstrap_addr: Optional[str] = None) -> Any:
        return self.cls[self.types.SENDER](self.prefill, bootstrap_addr or self.bootstrap_addr, room)

    def receiver(self, room: int, bootstrap_addr: Optional[str] = None, mgr: Any = None) -> Any:
        addr = bootstrap_addr or self.bootstrap_addr
        mgr = mgr or self.decode
        wait_for(lambda: mgr.try_ensure_parallel_info(addr), 20, f"the prefill at {addr}")
        r = self.cls[self.types.RECEIVER](mgr, addr, room)
        r.init(0)
        return r

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        self.server.close()


def until_done(x: Any, timeout: float = 10.0) -> Any:
    """Polls a sender or receiver until Success or Failed (bounded)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    def done():
        s = x.poll()
        return (s,) if s in (KVPoll.Success, KVPoll.Failed) else None

    return wait_for(done, timeout, "a final state")[0]


def failure_text(x: Any) -> str:
    """The failure_exception's message (SGLang's contract: it raises)."""
    from sglang.srt.disaggregation.common.conn import KVTransferError

    try:
        x.failure_exception()
    except KVTransferError as e:
        return str(e)
    raise AssertionError("failure_exception() did not raise")


try:
    import pytest

    @pytest.fixture(scope="session")
    def pd():
        import kvbridge.sglang

        kvbridge.sglang.install()
        port = free_port()
        with topology(port) as server_args:
            pair = PD(server_args, port)
            try:
                yield pair
            finally:
                pair.close()
except ImportError:  # used outside pytest (prefill_process.py)
    pass
