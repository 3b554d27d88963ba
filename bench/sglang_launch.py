"""``python -m sglang_launch ARGS...`` (bench/ on ``PYTHONPATH``): SGLang's ``launch_server``
as bench/sglang_pd.py starts every server, with what the benchmark needs in every process
of the server, set up at import: SGLang starts its scheduler and detokenizer with
``multiprocessing``'s spawn, which imports the main module again (as ``__mp_main__``) in each
child (as ``kvbridge.sglang.launch_server`` relies on).

- kvbridge's backend (``kvbridge.sglang.install()``), first: its SGLang plugin (entry point
  ``sglang.srt.plugins``) does the same in every process of every server of this environment
  anyway, whatever the backend, so the NIXL and Mooncake servers are as they would be.
- the transfer timer (bench/sglang_transfer_timer.py) when ``KVBRIDGE_TRANSFER_TIMER_DIR``
  is set, after kvbridge's hook, so that it wraps every backend's classes.
- ``KVBRIDGE_BENCH_NIXL_DRAM=1``: the stand-in SGLang's NIXL backend needs on CPU
  (bench/sglang_nixl_dram.py: its "VRAM" memory kind passed to NIXL as "DRAM").
- ``KVBRIDGE_BENCH_MOONCAKE_CPU=1``: the stand-in SGLang's Mooncake backend needs on CPU
  (bench/sglang_mooncake_cpu.py: page indices as for every other backend, not behind a CUDA
  event).
"""

from __future__ import annotations

import os
import runpy
import sys


def setup() -> None:
    from kvbridge.sglang.install import install

    install()
    if os.environ.get("KVBRIDGE_TRANSFER_TIMER_DIR"):
        import sglang_transfer_timer

        sglang_transfer_timer.install()
    import sglang_nixl_dram

    if os.environ.get(sglang_nixl_dram.ENV) == "1":
        sglang_nixl_dram.install()
    import sglang_mooncake_cpu

    if os.environ.get(sglang_mooncake_cpu.ENV) == "1":
        sglang_mooncake_cpu.install()


setup()

if __name__ == "__main__":
    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)
