"""kvbridge as SGLang's PD transfer backend (``--disaggregation-transfer-backend kvbridge``).

``install()`` adds the backend to an unmodified SGLang; SGLang runs it itself in every
process through its plugin entry point (``sglang.srt.plugins``) once kvbridge is installed,
and ``python -m kvbridge.sglang.launch_server ARGS...`` runs SGLang's own server with it
applied. The classes (``KvbridgeKVManager``, ``KvbridgeKVSender``, ``KvbridgeKVReceiver``,
``KvbridgeKVBootstrapServer``) import SGLang; ``import kvbridge.sglang`` does not.
See docs/sglang.md.
"""

from kvbridge.sglang.install import BACKEND_NAME, TESTED_SGLANG_VERSIONS, install, installed

__all__ = ["BACKEND_NAME", "TESTED_SGLANG_VERSIONS", "install", "installed"]
