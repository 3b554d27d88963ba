"""A stand-in for running SGLang's Mooncake transfer backend on CPU (bench/sglang_launch.py
installs it when ``KVBRIDGE_BENCH_MOONCAKE_CPU=1``): SGLang 0.5.23's prefill hands a Mooncake
sender its page indices as a pinned host tensor behind a ``torch.cuda.Event``
(``MooncakeKVSender.supports_host_tensor_indices``), which fails on a host without a GPU
(``RuntimeError: Found no NVIDIA driver on your system`` in ``prefill.py``'s
``_send_kv_chunk``) and kills the prefill's scheduler. Off, the prefill computes the page
indices as it does for every other backend (NIXL's, kvbridge's); Mooncake's transfer itself
is unchanged.
"""

from __future__ import annotations

from typing import Any

ENV = "KVBRIDGE_BENCH_MOONCAKE_CPU"


def install(sender_class: Any = None) -> None:
    if sender_class is None:
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender as sender_class
    sender_class.supports_host_tensor_indices = False
