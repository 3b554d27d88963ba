"""Slots of a scratch region a decoder registered once (a load never registers memory):
lease table pages, digest rows. A load takes a slot and gives it back when its reads into
it ended. A slot whose read was given up is *parked* with that read's transfer and comes
back only once no byte of that read can land there any more (``ReadEnded`` says when); one
whose read may never stop landing stays parked for the worker's life. No I/O here.

When a read's bytes can no longer land, from kvbridge's engine
(``crates/kvbridge/src/datapath/mod.rs``, module doc): a batch's completion is signalled
only by the data connection's reader or writer, by the one-sided backend, or by the session
after its data tasks stopped, so "when a caller learns that its batch ended, no byte of it
can still land". A read whose answer does not come within the engine's op deadline ends the
session and completes only once the session drained (``Submitted::outcome`` and
``abort_after_timeout`` in ``datapath/pending.rs``; a striped read likewise,
``DataPath::striped``). A given-up read is left to complete, and its slot comes back when
its ``Transfer`` is ``done``. (``Transfer.cancel()`` returning ``True`` would say the same
over TCP, shared memory and cross-memory attach, ``datapath/cancel.rs``, but a read left
running needs nothing more from the caller.) The exception is UCX: a UCX batch that fails
(its deadline, a lost endpoint) completes as ``FailedMayLand`` before the session it ends
has drained (``DataPath::post_one_sided``), so a get posted to the peer may still land; a
slot whose read failed where the session may carry UCX stays parked.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable


class SlotsTaken(Exception):
    """No slot came free by the deadline."""


#: ``ended(transfer)``: whether no byte of the given-up read ``transfer`` can land any more
#: (``None``: it may never stop, keep the slot parked for good).
ReadEnded = Callable[[Any], "bool | None"]


class ScratchSlots:
    """``count`` slots, any thread may take and give back."""

    def __init__(self, count: int):
        self.count = count
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(count):
            self._free.put(slot)
        self._lock = threading.Lock()
        # slot -> (the given-up read's transfer, when its bytes can no longer land)
        self._parked: dict[int, tuple[Any, ReadEnded]] = {}
        # slots whose read may land at any time for the worker's life
        self._lost: set[int] = set()

    def take(self, deadline: float) -> int:
        """A free slot, waiting for one until ``deadline`` (monotonic); ``SlotsTaken`` then.
        Parked slots whose reads ended are given back first."""
        while True:
            self.reclaim()
            left = max(0.0, deadline - time.monotonic())
            # while reads are parked, they are looked at again every 50 ms of the wait
            wait = min(0.05, left) if self.parked() else left
            try:
                return self._free.get(timeout=wait)
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise SlotsTaken from None

    def give_back(self, slot: int) -> None:
        """``slot``'s reads all ended: another load may use it."""
        self._free.put(slot)

    def park(self, slot: int, transfer: Any, ended: ReadEnded) -> None:
        """``slot``'s read ``transfer`` was given up but not cancelled: the slot comes back
        once ``ended(transfer)`` says no byte of it can land any more."""
        with self._lock:
            self._parked[slot] = (transfer, ended)

    def reclaim(self) -> int:
        """Gives back the parked slots whose reads ended; returns how many."""
        back = []
        with self._lock:
            for slot, (t, ended) in list(self._parked.items()):
                state = ended(t)
                if state is None:
                    del self._parked[slot]
                    self._lost.add(slot)
                elif state:
                    del self._parked[slot]
                    back.append(slot)
        for slot in back:
            self._free.put(slot)
        return len(back)

    def free(self) -> int:
        """Slots free now."""
        return self._free.qsize()

    def parked(self) -> int:
        """Slots waiting for a given-up read to end."""
        with self._lock:
            return len(self._parked)

    def lost(self) -> int:
        """Slots a given-up read may land in for the worker's life (never used again)."""
        with self._lock:
            return len(self._lost)
