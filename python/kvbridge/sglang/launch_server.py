"""``python -m kvbridge.sglang.launch_server ARGS...``: SGLang's ``launch_server`` with the
kvbridge backend installed, its command line unchanged (add
``--disaggregation-transfer-backend kvbridge``).

``install()`` runs at import: SGLang starts its scheduler and detokenizer with
``multiprocessing``'s spawn, which imports the main module again (as ``__mp_main__``) in each
child. SGLang's module runs without replacing ``sys.modules["__main__"]`` (``alter_sys``
off), so this module stays the main one and the backend is in every child too, even where
SGLang's plugins are filtered out (``SGLANG_PLUGINS``).
"""

from __future__ import annotations

import runpy
import sys

from kvbridge.sglang.install import install

install()

if __name__ == "__main__":
    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)
