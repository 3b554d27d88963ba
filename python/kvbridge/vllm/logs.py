"""kvbridge's log lines in a vLLM process go where vLLM's go, in vLLM's format.

vLLM configures its own logger ("vllm") and leaves the root logger bare: without this, our
INFO lines were dropped and our warnings printed by Python's last-resort handler, with no
time, so a load's log could not be put beside vLLM's.
"""

from __future__ import annotations

import logging


def route_to_vllm() -> None:
    """Gives the ``kvbridge`` logger vLLM's handlers and level, unless it or the root logger
    has handlers already (configured by the user, or routed before): a line is never
    printed twice."""
    ours = logging.getLogger("kvbridge")
    theirs = logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
