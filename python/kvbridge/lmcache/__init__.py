"""kvbridge for LMCache: a transfer channel for LMCache's PD and P2P backends.

``install()`` makes ``transfer_channel: "kvbridge"`` work in an unmodified LMCache (and registers
kvbridge in LMCache's distributed channel registry when that layer is present). Ways in:

* vLLM: ``--kv-transfer-config '{"kv_connector": "KvbridgeLMCacheConnectorV1",
  "kv_connector_module_path": "kvbridge.lmcache.vllm", ...}'`` (see ``kvbridge.lmcache.vllm``);
* any LMCache entry point: ``python -m kvbridge.lmcache.run MODULE ARGS...``;
* your own code: ``import kvbridge.lmcache; kvbridge.lmcache.install()``.

LMCache is imported only when one of these is used, so ``import kvbridge.lmcache`` works
without it.
"""

from kvbridge.lmcache.install import CHANNEL_NAME, TESTED_LMCACHE_VERSIONS, install, installed

__all__ = ["CHANNEL_NAME", "TESTED_LMCACHE_VERSIONS", "KvbridgeChannel", "install", "installed"]


def __getattr__(name: str):
    if name == "KvbridgeChannel":
        from kvbridge.lmcache.channel import KvbridgeChannel

        return KvbridgeChannel
    raise AttributeError(f"module 'kvbridge.lmcache' has no attribute {name!r}")
