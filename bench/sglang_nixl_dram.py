"""A stand-in for running SGLang's NIXL transfer backend on CPU (bench/sglang_launch.py
installs it when ``KVBRIDGE_BENCH_NIXL_DRAM=1``): SGLang 0.5.23's NIXL backend names the memory
of every KV region "VRAM" (GPU memory); on CPU the pools are host memory, and NIXL's UCX
backend must be told "DRAM" (../shared/design/cpu-real-engines.md, section 9). This maps the
memory kind of the calls of NIXL's agent that take one; nothing else of NIXL or SGLang changes.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

ENV = "KVBRIDGE_BENCH_NIXL_DRAM"
#: nixl_agent's methods that take a memory kind (nixl 1.5.1), by its position after self
MEM_TYPE_AT = {"register_memory": 1, "get_reg_descs": 1, "get_xfer_descs": 1, "prep_xfer_dlist": 2}


def dram(fn: Callable[..., Any], at: int) -> Callable[..., Any]:
    """``fn`` with a memory kind of "VRAM" (positional ``at``, after self, or ``mem_type=``)
    passed on as "DRAM"; any other argument as it was."""

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("mem_type") == "VRAM":
            kwargs["mem_type"] = "DRAM"
        if len(args) > at and args[at] == "VRAM":
            args = args[:at] + ("DRAM",) + args[at + 1 :]
        return fn(self, *args, **kwargs)

    call.vram_as_dram = True  # type: ignore[attr-defined]
    return call


def install(agent_class: Any = None) -> None:
    """Patches NIXL's ``nixl_agent`` (or ``agent_class``) once."""
    if agent_class is None:
        from nixl._api import nixl_agent as agent_class
    for name, at in MEM_TYPE_AT.items():
        fn = getattr(agent_class, name)
        if not getattr(fn, "vram_as_dram", False):
            setattr(agent_class, name, dram(fn, at))
