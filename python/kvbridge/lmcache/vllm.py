"""vLLM connector module: LMCache's connector with kvbridge's hooks installed.

Point vLLM at it instead of LMCache's own connector; nothing else changes::

    --kv-transfer-config '{"kv_connector": "KvbridgeLMCacheConnectorV1",
                           "kv_connector_module_path": "kvbridge.lmcache.vllm",
                           "kv_role": "kv_producer"}'

with ``transfer_channel: "kvbridge"`` and ``pd_buffer_device: "cpu"`` in LMCache's YAML.
Importing this module installs the hooks (vLLM imports it in every process that builds a
connector, scheduler and workers alike).
"""

from __future__ import annotations

from kvbridge.lmcache.install import install

try:
    from lmcache.integration.vllm.lmcache_connector_v1 import LMCacheConnectorV1Dynamic
except ImportError as e:  # pragma: no cover - message only
    raise ImportError(
        "kvbridge.lmcache.vllm needs vLLM and LMCache's vLLM integration "
        f"(lmcache.integration.vllm.lmcache_connector_v1): {e}"
    ) from e

install()


class KvbridgeLMCacheConnectorV1(LMCacheConnectorV1Dynamic):
    """``LMCacheConnectorV1Dynamic`` in a process where LMCache knows the kvbridge channel."""


__all__ = ["KvbridgeLMCacheConnectorV1"]
