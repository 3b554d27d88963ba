"""Helpers for the vLLM connector's own tests: two workers in one process, real kvbridge
channels over loopback, CPU tensors shaped like vLLM CPU's KV cache."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvbridge.vllm.config import settings_from  # noqa: E402
from kvbridge.vllm.worker import KvbridgeWorker  # noqa: E402

NUM_BLOCKS = 16
BLOCK_SIZE = 32
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


class ModelConfig(SimpleNamespace):
    """The part of vLLM's ModelConfig the connector reads."""

    def get_total_num_kv_heads(self) -> int:
        return self.total_kv_heads

    def get_head_size(self) -> int:
        return self.head_size


def vllm_config(
    role: str,
    *,
    extra: dict | None = None,
    engine_id: str = "e",
    block_size: int = BLOCK_SIZE,
    tp_size: int = 1,
    total_kv_heads: int = 2,
    head_size: int = 32,
    mla: bool = False,
):
    ktc = SimpleNamespace(
        engine_id=engine_id,
        is_kv_producer=role in ("kv_producer", "kv_both"),
        is_kv_consumer=role in ("kv_consumer", "kv_both"),
        # every worker test runs with the digests checked (test_integrity.py turns them off)
        kv_connector_extra_config={
            "kvbridge_host": "127.0.0.1",
            "kvbridge_port": 0,
            "kvbridge_integrity": True,
            **(extra or {}),
        },
    )
    return SimpleNamespace(
        kv_transfer_config=ktc,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size, data_parallel_index=0),
        cache_config=SimpleNamespace(block_size=block_size),
        model_config=ModelConfig(model="tiny", total_kv_heads=total_kv_heads, head_size=head_size, use_mla=mla),
    )


def kv_caches(
    seed: int | None, *, heads: int = 2, head_size: int = 32, block_size: int = BLOCK_SIZE, blocks: int = NUM_BLOCKS
):
    """vLLM CPU's per-layer layout: [num_blocks, num_kv_heads, block_size, 2 * head_size]."""
    out = {}
    for i, name in enumerate(LAYERS):
        shape = (blocks, heads, block_size, 2 * head_size)
        if seed is None:
            out[name] = torch.zeros(shape, dtype=torch.bfloat16)
        else:
            g = torch.Generator().manual_seed(seed + i)
            out[name] = torch.randn(shape, generator=g).to(torch.bfloat16)
    return out


def make_worker(role: str, caches: dict, *, tp_rank: int = 0, **kw) -> KvbridgeWorker:
    """One TP rank's worker (vLLM's TP group is not initialised here: the rank is set
    before registration, as vLLM's would be)."""
    cfg = vllm_config(role, **kw)
    w = KvbridgeWorker(cfg, settings_from(cfg))
    w.tp_rank = tp_rank
    w.register_kv_caches(caches)
    return w


def poll(worker: KvbridgeWorker, *, want_sending=(), want_recving=(), timeout: float = 10.0):
    """Calls get_finished as vLLM's steps would until the wanted ids came (bounded)."""
    sending, recving = set(), set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s, r = worker.get_finished(set())
        sending |= s or set()
        recving |= r or set()
        if set(want_sending) <= sending and set(want_recving) <= recving:
            return sending, recving
        time.sleep(0.01)
    raise AssertionError(f"not finished in {timeout}s: sending={sending} recving={recving}")


@pytest.fixture
def workers():
    made = []

    def make(role, caches, **kw):
        w = make_worker(role, caches, **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.shutdown()


#: The grant the tests' prefillers hold their requests under (done_notices.py).
GRANT = "5a" * 16


def granted_meta(*, blocks: int = NUM_BLOCKS, **kw):
    """Connector metadata whose held and sent requests carry :data:`GRANT` and name their
    blocks, as the scheduler's do (every block of the tests' caches, unless given: the tests
    name a request's blocks on the decoder's side; ``blocks``: how many the caches hold)."""
    from kvbridge.vllm.metadata import KvbridgeConnectorMetadata

    meta = KvbridgeConnectorMetadata(**kw)
    held = [*meta.reqs_to_send, *meta.reqs_to_hold]
    meta.grants = {r: GRANT for r in held}
    meta.hold_blocks = {r: list(range(blocks)) for r in held} | meta.hold_blocks
    return meta


def recv_job(*args, **kw):
    """A decoder's load job under :data:`GRANT`."""
    from kvbridge.vllm.metadata import RecvJob

    return RecvJob(*args, **{"grant": GRANT, **kw})


def prefiller_job(prefiller, local, remote, req="p-1", port=None, hit=(), **kw):
    """A decoder's load job for ``prefiller``'s held request ``req``: its ``remote`` blocks
    into the decoder's ``local`` ones (``port``: another port than the prefiller's)."""
    host, p = (prefiller.listen_addr or "127.0.0.1:1").rsplit(":", 1)
    return recv_job(
        local_block_ids=list(local),
        remote_block_ids=list(remote),
        remote_engine_id=prefiller.settings.engine_id,
        remote_request_id=req,
        remote_host=host,
        remote_port=int(p) if port is None else port,
        hit_block_ids=list(hit),
        **kw,
    )
