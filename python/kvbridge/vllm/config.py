"""The connector's settings: read once from vLLM's ``kv_transfer_config``.

Every knob lives in ``kv_connector_extra_config`` under a ``kvbridge_`` name, so a
NixlConnector deployment changes only ``kv_connector`` and ``kv_connector_module_path``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

#: Seconds a prefiller keeps a finished request's blocks for a decoder to read. When the
#: lease ends with no "read done" notification, the prefiller frees the blocks itself
#: (counted as ``leases_expired``). NixlConnector's counterpart is ``kv_lease_duration``
#: (30 s, kept alive by heartbeats); this lease has no heartbeats, so it is one deadline.
DEFAULT_LEASE_S = 30.0

#: Seconds a decoder gives one request's load (connect, layout, every layer's read). A
#: load past it is cancelled and its blocks are reported as load errors, so vLLM's
#: ``kv_load_failure_policy`` decides (recompute or fail). Must stay below the lease.
DEFAULT_READ_TIMEOUT_S = 20.0


class ConfigError(ValueError):
    """A ``kvbridge_*`` setting that cannot be used, naming the key."""


@dataclass(frozen=True)
class ConnectorSettings:
    engine_id: str
    is_producer: bool
    is_consumer: bool
    host: str  # the address a prefiller's worker listens on and advertises
    base_port: int  # rank r of data-parallel index d listens on base_port + d * tp + r
    lease_s: float
    read_timeout_s: float
    secret: str | None
    transport: str | None
    # kv_transfer_config's kv_buffer_device: "cpu" stages a device KV cache in host memory
    kv_buffer_device: str | None = None
    # kvbridge_integrity: prefillers write digests of the blocks they hold, decoders check
    # what landed against them (digests.py). Off by default: a checked load cost 1.2-1.3x an
    # unchecked one (bench/vllm_integrity.py, docs/vllm.md), above the 3% that would make
    # it the default
    integrity: bool = False
    # kvbridge_read_grants, a prefiller's: reads of its KV cache confined to each held
    # request's blocks, for the holder of that request's grant (read_grants.py). Off by
    # default; such reads go over TCP, also between processes of one host
    read_grants: bool = False


def _number(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a number of seconds, got {value!r}") from None
    if not (value > 0) or value != value or value == float("inf"):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be positive and finite, got {value!r}")
    return value


def _flag(extra: dict[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ConfigError(f"kv_connector_extra_config[{key!r}] must be true or false, got {value!r}")


def numeric_host(host: str) -> str:
    """kvbridge takes IP addresses; vLLM's side-channel host defaults to ``localhost``."""
    try:
        socket.inet_pton(socket.AF_INET, host)
        return host
    except OSError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve host {host!r}: {e}") from None
    return infos[0][4][0]


def settings_from(vllm_config: Any) -> ConnectorSettings:
    ktc = vllm_config.kv_transfer_config
    extra = dict(ktc.kv_connector_extra_config or {})
    lease = _number(extra, "kvbridge_lease_s", DEFAULT_LEASE_S)
    read_timeout = _number(extra, "kvbridge_read_timeout_s", min(DEFAULT_READ_TIMEOUT_S, lease * 2 / 3))
    if read_timeout >= lease:
        raise ConfigError(
            f"kvbridge_read_timeout_s ({read_timeout}) must be below kvbridge_lease_s ({lease}): "
            "a decoder still reading after the prefiller's lease would read freed blocks"
        )
    host = str(extra.get("kvbridge_host") or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"))
    port_raw = extra.get("kvbridge_port", os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
    try:
        port = int(port_raw)
    except (TypeError, ValueError):
        raise ConfigError(f"kvbridge_port must be an integer, got {port_raw!r}") from None
    if not 0 <= port < 65536:
        raise ConfigError(f"kvbridge_port must be in 0..65535 (0: any free port, for tests), got {port}")
    pp = getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1
    if pp != 1:
        # each pipeline stage holds other layers: a stage's blocks are not a request's KV
        raise ConfigError(f"KvbridgeConnector does not support pipeline_parallel_size > 1 (got {pp}), as NixlConnector")
    dp_index = getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0
    tp = max(1, vllm_config.parallel_config.tensor_parallel_size)
    return ConnectorSettings(
        engine_id=str(ktc.engine_id),
        is_producer=bool(ktc.is_kv_producer),
        is_consumer=bool(ktc.is_kv_consumer),
        host=host,
        base_port=port + dp_index * tp,
        lease_s=lease,
        read_timeout_s=read_timeout,
        secret=extra.get("kvbridge_secret"),
        transport=extra.get("kvbridge_transport"),
        kv_buffer_device=getattr(ktc, "kv_buffer_device", None),
        integrity=_flag(extra, "kvbridge_integrity", False),
        read_grants=_flag(extra, "kvbridge_read_grants", False),
    )
