"""Which cores kvbridge's threads in a vLLM worker run on."""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger(__name__)


def transfer_core_set() -> set[int]:
    """The cores vLLM CPU keeps for KV transfer (the last core of each NUMA node); empty off
    vLLM CPU or without a topology.

    vLLM CPU binds the worker's thread (and its OpenMP threads) to the compute cores and
    leaves the last core of each NUMA node free for transfers (NixlConnector puts its
    threads there too). The worker's main thread spins there between steps (it polls for
    the next step with ``sched_yield``), and so does every other engine's worker on the
    host: a thread of ours left on the compute cores waits for them.
    """
    cores: set[int] = set()
    try:
        from vllm.platforms import current_platform

        if current_platform.device_type == "cpu":
            cores = {max(node) for node in current_platform.discover_numa_topology() if node}
    except Exception as e:  # no topology: leave the affinity as it is
        log.info("kvbridge: no NUMA topology (%s); transfer threads keep the worker's cores", e)
    if not hasattr(os, "sched_setaffinity"):
        return set()
    return cores & set(range(os.cpu_count() or 1))


def run_on(cores: set[int]) -> None:
    """Moves the calling thread to ``cores`` (no change when empty)."""
    if cores:
        os.sched_setaffinity(0, cores)


@contextlib.contextmanager
def transfer_cores(cores: set[int]):
    """Runs the block with the calling thread on ``cores`` (the transfer cores): kvbridge's
    I/O threads, started by the channel, inherit the affinity of the thread that creates it;
    on the compute cores, a prefiller whose engine loop spins (it steps while blocks await a
    decoder) would starve them, and a decoder's read over TCP would wait for it."""
    old = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if not cores or old is None:
        yield
        return
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)
    log.info("kvbridge: transfer threads on cores %s (worker thread on %s)", sorted(cores), sorted(old))
