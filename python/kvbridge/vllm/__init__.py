"""vLLM KV connector over kvbridge (``kv_connector_module_path="kvbridge.vllm"``).

Importing this package imports vLLM; the rest of ``kvbridge`` does not need it.
"""

from .config import DEFAULT_LEASE_S, DEFAULT_READ_TIMEOUT_S, ConfigError
from .connector import KvbridgeConnector
from .metadata import KvbridgeConnectorMetadata, RecvJob
from .staging import DeviceMemoryError, StagingError
from .worker import LayoutError, LoadError

__all__ = [
    "DEFAULT_LEASE_S",
    "DEFAULT_READ_TIMEOUT_S",
    "ConfigError",
    "DeviceMemoryError",
    "KvbridgeConnector",
    "KvbridgeConnectorMetadata",
    "LayoutError",
    "LoadError",
    "RecvJob",
    "StagingError",
]
